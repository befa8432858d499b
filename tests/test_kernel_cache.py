"""The kernel cache is private: a cached binary or directory that another user owns, or that
group or others may write, is never loaded, nor one under a directory or symbolic link that
another user could change (the kernel is built elsewhere, and the log says why); what was
checked is what is loaded, however the path changes meanwhile; the cache directory is created
with mode 0700; every source and header is in the key. A cached binary is loaded only when its
record beside it gives its size and sha256; an entry without one, or not matching it, is removed
and built again.

The kernel's compiler never runs here: ``cpp_extension.load`` is replaced by a recorder, and so
is ``import_extension`` except where a tiny shared object shows whose code ran."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from arfuse import log
from arfuse.backends.shm import build as shm_build
from arfuse.backends.shm import cache as shm_cache

OTHER_UID = 12345
NOBODY = 65534  # a real second user, for the processes that race the loader


class Recorder:
    """Records what would be imported and where the kernel would be built: the real paths of
    the files and directories meant, resolved when called (the loader may name them by an
    open descriptor, whose name means nothing once it is closed)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, record_imports: bool = True) -> None:
        self.imported: list[Path] = []
        self.import_paths: list[str] = []
        self.built_in: list[Path] = []
        self.build_paths: list[str] = []
        self.found_there: list[list[str]] = []  # what each build directory held beforehand
        from torch.utils import cpp_extension

        if record_imports:
            monkeypatch.setattr(shm_cache, "import_extension", self._import)
        monkeypatch.setattr(cpp_extension, "load", self._load)

    def _import(self, name: str, path: str) -> ModuleType:
        self.import_paths.append(str(path))
        self.imported.append(Path(os.path.realpath(path)))
        return ModuleType(name)

    def _load(self, name: str, build_directory: str, **_: Any) -> ModuleType:
        self.build_paths.append(build_directory)
        self.built_in.append(Path(os.path.realpath(build_directory)))
        self.found_there.append(sorted(os.listdir(build_directory)))
        built = Path(build_directory) / f"{name}.so"
        built.write_bytes(b"\x7fELF built here")
        built.chmod(0o755)
        return ModuleType(name)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    if os.geteuid() != 0:
        pytest.skip("simulating another user's files needs root (os.chown)")
    root = tmp_path / "cache"
    monkeypatch.setenv("ARFUSE_CACHE_DIR", str(root))
    monkeypatch.delenv("ARFUSE_SHM_PURE_TORCH", raising=False)
    key = shm_build.build_key()
    entry = root / f"shm-{key}"
    return root, entry, entry / f"arfuse_shm_{key}.so"


def record_path(binary: Path) -> Path:
    return binary.with_name(binary.name + shm_cache.RECORD_SUFFIX)


def write_record(binary: Path) -> None:
    """The record a build writes beside ``binary``, for its bytes as they are now."""
    data = binary.read_bytes()
    record_path(binary).write_text(shm_cache.record(len(data), hashlib.sha256(data).hexdigest()))


def plant(root: Path, entry: Path, binary: Path) -> None:
    root.mkdir(mode=0o700)
    entry.mkdir(mode=0o700)
    binary.write_bytes(b"\x7fELF not really")
    binary.chmod(0o755)
    write_record(binary)


def refused(recorder: Recorder, binary: Path, caplog: pytest.LogCaptureFixture,
            culprit: Path) -> None:
    assert binary not in recorder.imported, "an unsafe cached kernel was loaded"
    assert len(recorder.built_in) == 1
    built_in = recorder.built_in[0]
    assert culprit not in (built_in, *built_in.parents)
    info = built_in.stat()
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700
    assert any(str(culprit) in r.getMessage() and "not using the kernel cache" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("what", ["binary", "entry", "root"])
@pytest.mark.parametrize("how", ["other owner", "mode 0666/0777"])
def test_unsafe_cache_is_refused(cache: tuple[Path, Path, Path], what: str, how: str,
                                 monkeypatch: pytest.MonkeyPatch,
                                 caplog: pytest.LogCaptureFixture) -> None:
    root, entry, binary = cache
    plant(root, entry, binary)
    culprit = {"binary": binary, "entry": entry, "root": root}[what]
    if how == "other owner":
        os.chown(culprit, OTHER_UID, OTHER_UID)
    else:
        culprit.chmod(0o666 if culprit.is_file() else 0o777)
    recorder = Recorder(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="arfuse"):
        module, why = shm_build._build()
    assert module is not None and why == ""
    refused(recorder, binary, caplog, culprit)


def test_a_0666_binary_of_another_user_is_not_loaded(cache: tuple[Path, Path, Path],
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The reported case: both at once."""
    root, entry, binary = cache
    plant(root, entry, binary)
    os.chown(binary, OTHER_UID, OTHER_UID)
    binary.chmod(0o666)
    recorder = Recorder(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="arfuse"):
        shm_build._build()
    refused(recorder, binary, caplog, binary)


def test_a_symlinked_binary_is_not_loaded(cache: tuple[Path, Path, Path], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    root, entry, binary = cache
    plant(root, entry, binary)
    elsewhere = tmp_path / "elsewhere.so"
    shutil.move(binary, elsewhere)
    binary.symlink_to(elsewhere)
    recorder = Recorder(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="arfuse"):
        shm_build._build()
    refused(recorder, binary, caplog, binary)


def test_own_private_cache_entry_is_loaded(cache: tuple[Path, Path, Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    root, entry, binary = cache
    plant(root, entry, binary)
    recorder = Recorder(monkeypatch)
    module, why = shm_build._build()
    assert module is not None and why == ""
    assert recorder.imported == [binary]
    assert recorder.import_paths[0].startswith("/proc/self/fd/"), "not loaded from what was checked"
    assert recorder.built_in == []


def test_cache_directory_is_created_private(cache: tuple[Path, Path, Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    root, entry, _binary = cache
    old = os.umask(0o022)  # the usual umask: the modes below must not depend on it
    try:
        recorder = Recorder(monkeypatch)
        shm_build._build()
    finally:
        os.umask(old)
    assert recorder.built_in == [entry]
    assert recorder.build_paths[0].startswith("/proc/self/fd/"), "not built in what was checked"
    for path in (root, entry):
        info = path.stat()
        assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700, path


def test_the_translation_unit_includes_every_other_source_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernel.cpp is the one file compiled: a .cpp it leaves out (or includes twice) would be
    missing from (or defined twice in) the module, so the build refuses and says which."""
    assert shm_build.unit_problem() == ""
    csrc = tmp_path / "csrc"
    shutil.copytree(shm_build.CSRC, csrc)
    monkeypatch.setattr(shm_build, "CSRC", csrc)
    (csrc / "extra.cpp").write_text("// a new part\n")
    assert "extra.cpp" in shm_build.unit_problem()
    unit = csrc / "kernel.cpp"
    unit.write_text(unit.read_text() + '#include "extra.cpp"\n')
    assert shm_build.unit_problem() == ""
    unit.write_text(unit.read_text() + '#include "comm.cpp"\n')
    assert "must include each" in shm_build.unit_problem()
    monkeypatch.setenv("ARFUSE_CACHE_DIR", str(tmp_path / "cache"))
    module, why = shm_build._build()
    assert module is None and "comm.cpp" in why


def test_every_source_and_header_is_in_the_build_key(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(shm_build.CSRC, csrc)
    monkeypatch.setattr(shm_build, "CSRC", csrc)
    files = shm_build.kernel_files()
    assert {p.suffix for p in files} == {".cpp", ".h"}
    assert [p.name for p in shm_build.sources()] == ["kernel.cpp"]
    assert {p.name for p in shm_build.parts()} >= {"bindings.cpp", "comm.cpp"}
    key = shm_build.build_key()
    for path in files:
        original = path.read_bytes()
        path.write_bytes(original + b"\n// edited\n")
        assert shm_build.build_key() != key, f"editing {path.name} does not change the key"
        path.write_bytes(original)
    assert shm_build.build_key() == key


def shared_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> Path:
    """``tmp_path/name``, made the cache root's parent (the cache inside it, planted)."""
    parent = tmp_path / name
    parent.mkdir()
    root = parent / "cache"
    monkeypatch.setenv("ARFUSE_CACHE_DIR", str(root))
    entry = root / f"shm-{shm_build.build_key()}"
    plant(root, entry, entry / f"arfuse_shm_{shm_build.build_key()}.so")
    return parent


@pytest.mark.parametrize("how", ["other owner", "mode 0777", "group-writable 0770"])
def test_a_cache_under_a_directory_another_user_can_change_is_refused(
        cache: tuple[Path, Path, Path], tmp_path: Path, how: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The cache itself is private, but whoever may write its parent can swap it."""
    parent = shared_parent(tmp_path, monkeypatch, "shared")
    binary = next(parent.glob("cache/shm-*/*.so"))
    if how == "other owner":
        os.chown(parent, OTHER_UID, OTHER_UID)
    else:
        parent.chmod(0o777 if how == "mode 0777" else 0o770)
    recorder = Recorder(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="arfuse"):
        shm_build._build()
    refused(recorder, binary, caplog, parent)
    reason = "uid 12345" if how == "other owner" else "without the sticky bit"
    assert any(reason in r.getMessage() for r in caplog.records)


def test_a_private_cache_in_a_sticky_shared_directory_is_used(
        cache: tuple[Path, Path, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As in /tmp: others may add entries there, but not rename or remove this user's."""
    parent = shared_parent(tmp_path, monkeypatch, "sticky")
    parent.chmod(0o1777)
    binary = next(parent.glob("cache/shm-*/*.so"))
    recorder = Recorder(monkeypatch)
    shm_build._build()
    assert recorder.imported == [binary] and recorder.built_in == []


def test_a_symlink_another_user_owns_in_a_sticky_directory_is_refused(
        cache: tuple[Path, Path, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Its owner may replace it at any time, to point the cache elsewhere."""
    root, entry, binary = cache
    plant(root, entry, binary)
    sticky = tmp_path / "sticky"
    sticky.mkdir(mode=0o1777)
    sticky.chmod(0o1777)
    link = sticky / "cache"
    link.symlink_to(root)
    os.lchown(link, OTHER_UID, OTHER_UID)
    monkeypatch.setenv("ARFUSE_CACHE_DIR", str(link))
    recorder = Recorder(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="arfuse"):
        shm_build._build()
    refused(recorder, binary, caplog, link)


def test_a_symlink_of_this_user_to_a_private_cache_is_followed(
        cache: tuple[Path, Path, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    root, entry, binary = cache
    plant(root, entry, binary)
    (tmp_path / "link").symlink_to("cache")  # relative, resolved in the link's directory
    monkeypatch.setenv("ARFUSE_CACHE_DIR", str(tmp_path / "link"))
    recorder = Recorder(monkeypatch)
    shm_build._build()
    assert recorder.imported == [binary] and recorder.built_in == []


# --- a symbolic link flipped while the kernel loads -------------------------------------------
# Each load runs in a fresh process: a process's dynamic loader opens a path once, and later
# loads of the same path reuse it, whatever the path names by then.

LOADS = 200

MARKING_LIBRARY = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void mark(void) {
    int fd = open(MARKER, O_WRONLY | O_CREAT, 0600);
    if (fd >= 0) close(fd);
}
"""


def marking_library(path: Path, marker: Path) -> None:
    """A shared object (not a Python module) that creates ``marker`` when loaded."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the shared objects the loader races over")
    source = path.with_suffix(".c")
    source.write_text(MARKING_LIBRARY)
    subprocess.run([cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', str(source), "-o", str(path)],
                   check=True, capture_output=True)


def planted_cache(base: Path, key: str, marker: Path) -> Path:
    """A cache directory at ``base`` whose entry for ``key`` is a marking library."""
    entry = base / f"shm-{key}"
    entry.mkdir(parents=True, mode=0o700)
    base.chmod(0o700)
    marking_library(entry / f"arfuse_shm_{key}.so", marker)
    write_record(entry / f"arfuse_shm_{key}.so")
    return base


@contextlib.contextmanager
def flipping(link: Path, targets: tuple[Path, Path], uid: int | None) -> Iterator[None]:
    """A process (as ``uid`` when given) that points ``link`` at each target in turn, as fast
    as it can, until the block ends; ``link`` points at ``targets[0]`` afterwards."""
    ready, tell_ready = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(ready)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            spare = link.with_name(link.name + ".new")
            while True:
                for target in targets:
                    os.symlink(target, spare)
                    os.replace(spare, link)
                    if tell_ready >= 0:
                        os.close(tell_ready)
                        tell_ready = -1
        finally:
            os._exit(1)
    os.close(tell_ready)
    try:
        os.read(ready, 1)  # the child closed its end: it has flipped once, or died
        os.close(ready)
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the flipping process died"
        yield
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    spare = link.with_name(link.name + ".new")
    spare.unlink(missing_ok=True)
    os.symlink(targets[0], spare)
    os.replace(spare, link)


def load_in_fresh_processes(times: int, until: Path | None = None) -> list[int]:
    """The exit statuses of ``times`` processes, one after the other, each forked to run the
    loader once (0: it returned); fewer once ``until`` exists."""
    statuses: list[int] = []
    for _ in range(times):
        if until is not None and until.exists():
            break
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                shm_build._build()
                code = 0
            finally:
                os._exit(code)
        statuses.append(os.waitpid(pid, 0)[1])
    return statuses


@pytest.fixture
def racing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The build key, fixed; fallback build directories in ``tmp_path`` (the forked loaders
    leave theirs behind); ``import_extension`` real, the build recorded."""
    monkeypatch.delenv("ARFUSE_SHM_PURE_TORCH", raising=False)
    key = shm_build.build_key()
    monkeypatch.setattr(shm_build, "build_key", lambda isa=None: key)
    (tmp_path / "tmp").mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    Recorder(monkeypatch, record_imports=False)
    return key


def test_a_binary_swapped_after_its_check_is_never_loaded(racing: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The link flips between a private cache and one whose binary group and others may
    write: what is loaded is what was checked, so the second's code never runs."""
    safe_marker, unsafe_marker = tmp_path / "safe-ran", tmp_path / "unsafe-ran"
    safe = planted_cache(tmp_path / "safe", racing, safe_marker)
    unsafe = planted_cache(tmp_path / "unsafe", racing, unsafe_marker)
    next(unsafe.glob("shm-*/*.so")).chmod(0o777)
    link = tmp_path / "cache-link"
    link.symlink_to(safe)
    monkeypatch.setenv("ARFUSE_CACHE_DIR", str(link))
    with flipping(link, (safe, unsafe), uid=None):
        statuses = load_in_fresh_processes(LOADS, until=unsafe_marker)
    assert not unsafe_marker.exists(), f"a binary that failed its check ran (load {len(statuses)})"
    assert statuses == [0] * LOADS
    assert load_in_fresh_processes(1) == [0] and safe_marker.exists(), "nothing is loaded at all"


def test_another_users_kernel_never_runs_while_they_flip_the_cache_path(
        racing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The reported attack, by a real second user: a link in their directory flips between
    this user's private cache and theirs, which holds their ``arfuse_shm_<key>.so``."""
    if os.geteuid() != 0:
        pytest.skip("racing the loader as a second user needs root (os.chown, os.setuid)")
    marker = tmp_path / "planted-ran"
    ours = planted_cache(tmp_path / "ours", racing, tmp_path / "ours-ran")
    attacker = Path(tempfile.mkdtemp(prefix="arfuse-attacker-", dir="/tmp"))
    try:
        theirs = planted_cache(attacker / "theirs", racing, marker)
        for path in (attacker, *theirs.rglob("*"), theirs):
            os.lchown(path, NOBODY, NOBODY)
        attacker.chmod(0o755)
        link = attacker / "cache"
        monkeypatch.setenv("ARFUSE_CACHE_DIR", str(link))
        with flipping(link, (ours, theirs), uid=NOBODY):
            statuses = load_in_fresh_processes(LOADS, until=marker)
        assert not marker.exists(), f"another user's kernel ran here (load {len(statuses)})"
        assert statuses == [0] * LOADS
        recorder = Recorder(monkeypatch)
        with caplog.at_level(logging.WARNING, logger="arfuse"):
            shm_build._build()
        refused(recorder, ours / f"shm-{racing}" / f"arfuse_shm_{racing}.so", caplog, attacker)
    finally:
        shutil.rmtree(attacker)


def test_torch_waits_on_the_lock_file_a_killed_build_leaves() -> None:
    """What the next test relies on: torch's build holds (and waits on) a file of this name in
    the build directory."""
    import inspect

    from torch.utils import cpp_extension

    source = inspect.getsource(cpp_extension._jit_compile)
    assert f"FileBaton(os.path.join(build_directory, '{shm_cache.TORCH_BUILD_LOCK}'))" in source


def test_a_lock_left_by_a_killed_build_does_not_stop_the_next_build(
        cache: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A build killed midway (Ctrl-C, a job's kill) leaves torch's lock file: the next build
    of that key waited for it for ever. Under arfuse's own lock it is known stale and goes."""
    root, entry, _binary = cache
    root.mkdir(mode=0o700)
    entry.mkdir(mode=0o700)
    (entry / shm_cache.TORCH_BUILD_LOCK).write_text("")
    recorder = Recorder(monkeypatch)
    seen: list[bool] = []
    build = recorder._load

    def load(name: str, build_directory: str, **kwargs: Any) -> ModuleType:
        seen.append(os.path.exists(os.path.join(build_directory, shm_cache.TORCH_BUILD_LOCK)))
        return build(name, build_directory, **kwargs)

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", load)
    module, why = shm_build._build()
    assert module is not None and why == ""
    assert recorder.built_in == [entry] and seen == [False]


def test_a_build_waits_for_a_live_builder_and_loads_what_it_built(
        cache: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes that find no binary: one builds, the other waits for it (the lock is on
    the build directory) and then loads its binary instead of building again."""
    import fcntl
    import threading

    root, entry, binary = cache
    root.mkdir(mode=0o700)
    entry.mkdir(mode=0o700)
    recorder = Recorder(monkeypatch)
    other_builder = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(other_builder, fcntl.LOCK_EX)
    result: list[tuple[ModuleType | None, str]] = []
    waiter = threading.Thread(target=lambda: result.append(shm_build._build()), daemon=True)
    try:
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and recorder.built_in == [], "built beside a live builder"
        binary.write_bytes(b"\x7fELF not really")
        binary.chmod(0o755)
        write_record(binary)
    finally:
        os.close(other_builder)
    waiter.join(60)
    assert result and result[0][0] is not None, result
    assert recorder.built_in == [] and recorder.imported == [binary]


def compiling_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "compiling the C++ kernel" in r.getMessage()]


def test_a_cold_build_says_so_once_and_a_warm_load_does_not(
        cache: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The first use waits about a minute for the compiler: the log says so before it starts,
    once per process, with where the kernel is cached."""
    _root, entry, _binary = cache
    monkeypatch.setattr(log, "_seen", set())  # as in a fresh process
    Recorder(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="arfuse"):
        shm_build._build()
    said = compiling_messages(caplog)
    assert len(said) == 1 and str(entry) in said[0] and "later runs reuse it" in said[0], said
    caplog.clear()
    monkeypatch.setenv("ARFUSE_CACHE_DIR", str(tmp_path / "another-cache"))
    with caplog.at_level(logging.WARNING, logger="arfuse"):
        shm_build._build()  # cold again, in the same process
    assert compiling_messages(caplog) == []
    monkeypatch.setattr(log, "_seen", set())
    monkeypatch.setenv("ARFUSE_CACHE_DIR", str(entry.parent))
    recorder = Recorder(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="arfuse"):
        shm_build._build()
    assert recorder.built_in == [] and compiling_messages(caplog) == []


# --- a damaged cache entry --------------------------------------------------------------------
# A link killed midway or a full disk can leave a binary cut short, which would kill the process
# that loads it (SIGBUS); ninja would not relink it, its inputs being unchanged.

STALE_BUILD_FILES = ("build.ninja", ".ninja_log", "bindings.o")


def damaged_entry(cache: tuple[Path, Path, Path], how: str) -> Path:
    """A planted entry whose binary its record no longer vouches for (``how``), beside the
    files of the build that made it."""
    root, entry, binary = cache
    plant(root, entry, binary)
    for name in STALE_BUILD_FILES:
        (entry / name).write_text("stale")
    data = binary.read_bytes()
    if how == "cut short":
        binary.write_bytes(data[:len(data) // 2])
    elif how == "same size, other bytes":
        binary.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        record_path(binary).unlink()
    return binary


@pytest.mark.parametrize("how", ["cut short", "same size, other bytes", "no record"])
def test_a_damaged_cache_entry_is_removed_and_built_again(
        cache: tuple[Path, Path, Path], how: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    binary = damaged_entry(cache, how)
    entry = binary.parent
    recorder = Recorder(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="arfuse"):
        module, why = shm_build._build()
    assert module is not None and why == ""
    assert recorder.imported == [], "a binary its record does not vouch for was loaded"
    assert recorder.built_in == [entry] and recorder.found_there == [[]], recorder.found_there
    said = {"cut short": "its record says", "same size, other bytes": "sha256",
            "no record": "no record"}[how]
    assert any(str(binary) in r.getMessage() and "broken" in r.getMessage()
               and said in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    data = binary.read_bytes()  # the new binary, and its record
    assert record_path(binary).read_text() == shm_cache.record(
        len(data), hashlib.sha256(data).hexdigest())


def test_a_rebuilt_entry_is_then_loaded(cache: tuple[Path, Path, Path],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    binary = damaged_entry(cache, "cut short")
    Recorder(monkeypatch)
    shm_build._build()
    recorder = Recorder(monkeypatch)
    module, why = shm_build._build()
    assert module is not None and why == ""
    assert recorder.imported == [binary] and recorder.built_in == []


LOAD_IN_CHILD = """
import logging
logging.basicConfig(level=logging.WARNING)
from arfuse.backends.shm import build
module = build.load()
print("kernel: " + module.__file__ if module else "no kernel: " + build.why_not())
"""


def test_a_kernel_cut_short_in_the_cache_is_removed_not_loaded(tmp_path: Path) -> None:
    """The real kernel's entry, its binary cut to half its size: loading it killed the process
    with SIGBUS. The entry is found broken, removed, and built again; the compiler here is
    ``false``, so that build fails at once and the process goes on without the kernel (that a
    rebuilt entry is then loaded: test_a_damaged_cache_entry_is_removed_and_built_again)."""
    module = shm_build.load()
    if module is None or not module.__file__:
        pytest.skip(f"no compiled kernel to damage: {shm_build.why_not()}")
    failing = shutil.which("false")
    if failing is None:
        pytest.skip("no `false` command to stand in for the compiler")
    built = Path(module.__file__)
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    entry = root / built.parent.name
    shutil.copytree(built.parent, entry)  # with its object files: ninja finds nothing to do
    binary = entry / built.name
    size = binary.stat().st_size
    os.truncate(binary, size // 2)
    env = {**os.environ, "ARFUSE_CACHE_DIR": str(root), "CXX": failing}
    done = subprocess.run([sys.executable, "-c", LOAD_IN_CHILD], env=env, text=True,
                          capture_output=True, timeout=900)
    assert done.returncode == 0, f"the loader died ({done.returncode}):\n{done.stderr[-2000:]}"
    assert done.stdout.startswith("no kernel: building the kernel failed"), (
        done.stdout + done.stderr[-2000:])
    assert f"{binary} is broken" in done.stderr, done.stderr[-2000:]
    assert not binary.exists() and not record_path(binary).exists()
