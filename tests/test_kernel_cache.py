"""The kernel cache is private: a cached binary or directory that another user owns, or that
group or others may write, is never loaded (the kernel is built elsewhere, and the log says
why); the cache directory is created with mode 0700; every source and header is in the key.

No compiler runs here: ``_import`` and ``cpp_extension.load`` are replaced by recorders."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from arfuse.backends.shm import build as shm_build

OTHER_UID = 12345


class Recorder:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.imported: list[Path] = []
        self.built_in: list[Path] = []
        from torch.utils import cpp_extension

        monkeypatch.setattr(shm_build, "_import", self._import)
        monkeypatch.setattr(cpp_extension, "load", self._load)

    def _import(self, name: str, path: Path) -> ModuleType:
        self.imported.append(Path(path))
        return ModuleType(name)

    def _load(self, name: str, build_directory: str, **_: Any) -> ModuleType:
        self.built_in.append(Path(build_directory))
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


def plant(root: Path, entry: Path, binary: Path) -> None:
    root.mkdir(mode=0o700)
    entry.mkdir(mode=0o700)
    binary.write_bytes(b"\x7fELF not really")
    binary.chmod(0o755)


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
    for path in (root, entry):
        info = path.stat()
        assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700, path


def test_every_source_and_header_is_in_the_build_key(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(shm_build.CSRC, csrc)
    monkeypatch.setattr(shm_build, "CSRC", csrc)
    files = shm_build.kernel_files()
    assert {p.suffix for p in files} == {".cpp", ".h"}
    assert {p.name for p in shm_build.sources()} >= {"bindings.cpp"}
    assert all(p.suffix == ".cpp" for p in shm_build.sources())
    key = shm_build.build_key()
    for path in files:
        original = path.read_bytes()
        path.write_bytes(original + b"\n// edited\n")
        assert shm_build.build_key() != key, f"editing {path.name} does not change the key"
        path.write_bytes(original)
    assert shm_build.build_key() == key
