"""Build the shm kernel at first use with ``torch.utils.cpp_extension``, cached per user.

The kernel is ``csrc/*.cpp`` plus the headers they include (``csrc/*.h`` and the core's
``arfuse/csrc/*.h``, the constants every backend shares). The build directory
is keyed by a hash of every one of those files, the compiler flags, torch's version, Python's
extension suffix, the CPU's instruction-set flags and the instruction set built for, so an
edit, an upgrade or another machine never loads a stale binary. No compiler (or a failed
build) is not an error: the shm backend then runs its pure-torch path, which ``arfuse doctor``
reports and the log says once.

Instruction sets (``csrc/vec.h`` picks the vector header from the compiler's target): the best
this CPU has of ``avx512`` (AVX-512 F/BW/VL/DQ, with AVX512_BF16 when present), ``avx2`` (with
F16C and FMA when present) and ``scalar`` (no vector code), or the one ``ARFUSE_SHM_ISA`` names
(also ``avx512-nobf16``: AVX-512 without AVX512_BF16; tests build every path the machine has;
one that it lacks is refused, not built). Every path gives the same bytes.

The cache is private: its directory is created with mode 0700, and a cache directory, build
directory or binary that another user owns, or that group or others may write, is never
loaded (someone else could have put code there), nor one reached through a directory or
symbolic link that a user other than root and this one owns, or through a directory that group
or others may write without the sticky bit (whoever can change the path can swap the cache):
the kernel is then built in a fresh private temporary directory instead, and the log names the
path and why. What is checked is what is loaded: the path is opened one component at a time,
each relative to the one before and never through a symbolic link (one is resolved by reading
it, itself checked), the opened descriptors are the ones checked, and the binary is loaded by
its descriptor's name (``/proc/self/fd/N``), as is a fresh build's directory.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from ... import ctables, log
from ...machine import cpu_flags

CSRC = Path(__file__).resolve().parent / "csrc"
_lock = threading.Lock()
_state: dict[str, object] = {}
_fake_registered: list[bool] = []
_held: list[int] = []  # see held_descriptors


def sources() -> list[Path]:
    """The translation units, compiled together into one extension module."""
    return sorted(CSRC.glob("*.cpp"))


def include_dirs() -> list[Path]:
    """Where the kernel's headers are: its own, then the core's shared constants
    (``arfuse/csrc``: the call signature, the quantised outputs, the call limits)."""
    return [CSRC, ctables.CSRC]


def kernel_files() -> list[Path]:
    """Every file the build reads: the sources and the headers they include."""
    return sorted(p for directory in include_dirs() for p in directory.iterdir()
                  if p.suffix in (".cpp", ".h"))


# best first; avx512-nobf16 is avx512 without AVX512_BF16's conversion, as on CPUs that lack
# it (Skylake-X, Ice Lake): the tests build it to check that path where the CPU has BF16
ISAS = ("avx512", "avx512-nobf16", "avx2", "scalar")
# what each needs of /proc/cpuinfo's flags, and what it uses where the CPU has it
_AVX512 = ("avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq")
_ISA_NEEDS = {"avx512": _AVX512, "avx512-nobf16": _AVX512, "avx2": ("avx2",), "scalar": ()}
_ISA_OPTIONS = {"avx2": "-mavx2", "f16c": "-mf16c", "fma": "-mfma", "avx512f": "-mavx512f",
                "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl",
                "avx512dq": "-mavx512dq", "avx512_bf16": "-mavx512bf16",
                "3dnowprefetch": "-mprfchw"}  # Linux's name for PREFETCHW
_ISA_USES = {"avx512": (*_AVX512, "fma", "avx512_bf16", "3dnowprefetch"),
             "avx512-nobf16": (*_AVX512, "fma", "3dnowprefetch"),
             "avx2": ("avx2", "f16c", "fma", "3dnowprefetch"), "scalar": ("3dnowprefetch",)}


def host_isas() -> list[str]:
    """The instruction sets this CPU can run the kernel in, best first."""
    cpu = cpu_flags()
    return [isa for isa in ISAS if all(flag in cpu for flag in _ISA_NEEDS[isa])]


def isa_problem(isa: str) -> str:
    """Why the kernel cannot be built for ``isa`` here ("" when it can)."""
    if isa not in ISAS:
        return f"ARFUSE_SHM_ISA={isa!r} is not one of {', '.join(ISAS)}"
    missing = [flag for flag in _ISA_NEEDS[isa] if flag not in cpu_flags()]
    if missing:
        return f"ARFUSE_SHM_ISA={isa}: this CPU lacks {' '.join(missing)}"
    return ""


def target_isa() -> str:
    """``ARFUSE_SHM_ISA`` when set, else the best instruction set this CPU has."""
    return os.environ.get("ARFUSE_SHM_ISA", "").strip().lower() or host_isas()[0]


def compile_flags(isa: str | None = None) -> list[str]:
    """-O3, no FP contraction (results must not depend on FMA), the -m options of ``isa``
    (``target_isa()`` by default) that the CPU has, and hidden symbols (only the module's entry
    point is exported, as pybind11 advises)."""
    isa = target_isa() if isa is None else isa
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-fvisibility=hidden",
             "-fopenmp"]
    cpu = cpu_flags()
    flags.extend(_ISA_OPTIONS[flag] for flag in _ISA_USES.get(isa, ()) if flag in cpu)
    return flags


def cache_root() -> Path:
    env = os.environ.get("ARFUSE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "arfuse"


def build_key() -> str:
    import torch

    digest = hashlib.sha256()
    for path in kernel_files():  # a header edit must rebuild as much as a source edit
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes())
    digest.update(target_isa().encode() + b"\0")
    digest.update(" ".join(compile_flags()).encode())
    digest.update(torch.__version__.encode())
    digest.update(str(sysconfig.get_config_var("EXT_SUFFIX")).encode())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    return digest.hexdigest()[:16]


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def load() -> ModuleType | None:
    """The compiled kernel, or ``None`` with the reason in ``why_not()`` (built once)."""
    with _lock:
        if "module" in _state:
            module = _state["module"]
            return module if isinstance(module, ModuleType) else None
        module, why = _build()
        if module is not None:
            try:
                _attach(module)
            except Exception as exc:  # an old or foreign binary: the pure path, not a crash
                module, why = None, f"the kernel does not work: {type(exc).__name__}: {exc}"
        _state["module"], _state["why"] = module, why
        if module is None:
            log.once(logging.WARNING, "shm-build", "arfuse shm: using the pure-torch path "
                     "(slower): %s", why)
        return module


def why_not() -> str:
    """Why the compiled kernel is not used ("" when it is, or before the first ``load``)."""
    return str(_state.get("why", ""))


def _attach(module: ModuleType) -> None:
    """Hand the kernel arfuse's error classes and give its torch operator a fake."""
    from ...errors import CallTimeout, MismatchedCall, WorkspaceBroken

    module.set_error_types(CallTimeout, MismatchedCall, WorkspaceBroken)
    _register_fake()


def _register_fake() -> None:
    """Shapes of ``torch.ops.arfuse.shm_fused_allreduce*`` without running it (torch.compile)."""
    if _fake_registered:
        return
    _fake_registered.append(True)
    import torch

    from ...pattern import quant_output_of_code

    def outputs(x: torch.Tensor, weight: torch.Tensor | None, quant: int,
                out: torch.Tensor | None, residual_out: torch.Tensor | None) -> list[Any]:
        if x.dim() != 2:
            raise ValueError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
        tokens, hidden = x.shape
        result = [out if out is not None else x.new_empty((tokens, hidden))]
        if weight is not None:
            result.append(residual_out if residual_out is not None
                          else x.new_empty((tokens, hidden)))
        made = quant_output_of_code(quant, "quant")  # quant_out, scale_out as its row says
        for shape, dtype in ((made.data_shape(tokens, hidden), made.data_dtype),
                             (made.scale_shape(tokens, hidden), made.scale_dtype)):
            if shape is not None and dtype is not None:
                result.append(x.new_empty(shape, dtype=getattr(torch, dtype)))
        return result

    def fake(handle: int, x: torch.Tensor, residual: torch.Tensor | None,
             weight: torch.Tensor | None, eps: float, weight_bias: float, quant: int,
             scale: float, out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None) -> list[Any]:
        return outputs(x, weight, quant, out, residual_out)

    try:
        torch.library.register_fake("arfuse::shm_fused_allreduce")(fake)
        torch.library.register_fake("arfuse::shm_fused_allreduce_functional")(fake)
    except (AttributeError, RuntimeError) as exc:  # an older torch: no torch.compile support
        log.logger.debug("arfuse shm: no fake for the torch operator: %s", exc)


def _import(name: str, path: str) -> ModuleType:
    """The extension module ``name`` (its ``PyInit_<name>``) from the shared object ``path``."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load_file(path: str) -> ModuleType:
    """The built kernel at ``path`` as a module of its own (named as the file: its
    ``PyInit_<name>``), beside any other build loaded into this process (each has its own
    ``ShmComm``): how two builds are compared in one process."""
    return _import(Path(path).name.split(".")[0], path)


def build_tree(tree: str) -> str:
    """Compile (or find in the kernel cache) the kernel of the arfuse source tree ``tree`` by
    that tree's own ``build.load()`` (a child Python with the tree first on PYTHONPATH, this
    environment otherwise: ARFUSE_SHM_ISA included); the path of its shared object."""
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    code = ("from arfuse.backends.shm import build; m = build.load(); "
            "print('kernel: ' + m.__file__ if m else 'no kernel: ' + str(build.why_not()))")
    done = subprocess.run([sys.executable, "-c", code], env=env, check=True, text=True,
                          capture_output=True)
    out = done.stdout
    if "kernel: " not in out or "no kernel: " in out:
        raise ValueError(f"{tree}: no compiled kernel:\n{out}{done.stderr}")
    return out.rsplit("kernel: ", 1)[1].strip()


# Who may change a path: its last component's owner, and whoever may write the directory
# holding it (in a sticky directory, as /tmp, only the owners of the entry and of the directory
# may rename or remove it). Root and this user are trusted; every other user is not.

def unsafe_on_the_way(info: os.stat_result) -> str:
    """Why a directory or symbolic link on the way to the cache is not trusted ("" when it is):
    owned by a user other than root and this one, or a directory that group or others may
    write without the sticky bit."""
    if info.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {info.st_uid}, neither root nor this user (uid {os.geteuid()})"
    if stat.S_ISDIR(info.st_mode) and info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return ("is writable by group or others without the sticky bit "
                f"(mode {stat.S_IMODE(info.st_mode):o})")
    return ""


def unsafe(info: os.stat_result) -> str:
    """Why the cache directory, a build directory or a binary in it is not trusted ("" when it
    is): owned by another user, or writable by group or others."""
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    if info.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return ""


class _Untrusted(Exception):
    """``path`` is not safe to load code from, for ``reason``."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path} {reason}")
        self.path, self.reason = path, reason


# every component is opened relative to the one before, never through a symbolic link: what
# is checked (fstat of the descriptor) is what is used, whatever the path names meanwhile
# (O_PATH: a directory this user may only search, as some parents are, opens all the same)
_OPEN_DIR = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_SYMLINKS = 40  # as the kernel's own path lookup


def _fd_path(fd: int) -> str:
    """A name for exactly the file or directory ``fd`` has open (Linux), whatever was renamed
    or replaced since it was opened."""
    return f"/proc/self/fd/{fd}"


def _open_checked(dir_fd: int | None, name: str, flags: int, shown: Path,
                  check: Callable[[os.stat_result], str]) -> int:
    """``name`` in ``dir_fd`` opened (``flags``) and passed by ``check``, or ``_Untrusted``
    (``shown``: its path, for the message)."""
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:  # O_NOFOLLOW refuses a symbolic link with ELOOP, or ENOTDIR
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(
                os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise _Untrusted(shown, "is a symbolic link") from exc
        raise
    reason = check(os.fstat(fd))
    if reason:
        os.close(fd)
        raise _Untrusted(shown, reason)
    return fd


def _open_private_dir(dir_fd: int, name: str, shown: Path,
                      check: Callable[[os.stat_result], str]) -> int:
    """Directory ``name`` in ``dir_fd``, created with mode 0700 where missing, opened and passed
    by ``check`` (``_open_checked``)."""
    try:
        return _open_checked(dir_fd, name, _OPEN_DIR, shown, check)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        return _open_checked(dir_fd, name, _OPEN_DIR, shown, check)


class _Walk:
    """A directory descriptor moved one component at a time from ``/``, each directory and
    symbolic link on the way trusted (``unsafe_on_the_way``), missing directories created with
    mode 0700 (the caller closes ``fd``)."""

    def __init__(self) -> None:
        self.fd = _open_checked(None, "/", _OPEN_DIR, Path("/"), unsafe_on_the_way)
        self.at = Path("/")
        self.symlinks = 0

    def enter(self, name: str) -> None:
        """Into directory ``name`` (not a symbolic link), created where missing."""
        shown = self.at.parent if name == ".." else self.at / name
        fd = _open_private_dir(self.fd, name, shown, unsafe_on_the_way)
        os.close(self.fd)
        self.fd, self.at = fd, shown

    def link_target(self, name: str) -> str | None:
        """Where ``name`` points when it is a symbolic link (trusted), else ``None``."""
        try:
            info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISLNK(info.st_mode):
            return None
        reason = unsafe_on_the_way(info)
        self.symlinks += 1
        if not reason and self.symlinks > _MAX_SYMLINKS:
            reason = "leads through too many symbolic links"
        if reason:
            raise _Untrusted(self.at / name, reason)
        return os.readlink(name, dir_fd=self.fd)

    def restart(self) -> None:
        """Back at ``/``, for a symbolic link to an absolute path."""
        fd = _open_checked(None, "/", _OPEN_DIR, Path("/"), unsafe_on_the_way)
        os.close(self.fd)
        self.fd, self.at = fd, Path("/")


def _open_trusted_dir(path: Path) -> int:
    """A descriptor of directory ``path`` (created private where missing), reached from ``/``
    through trusted directories and symbolic links only, and itself private to this user;
    ``_Untrusted`` names the first component that is not."""
    walk = _Walk()
    try:
        names = deque(os.path.join(os.getcwd(), path).split("/"))
        while names:
            name = names.popleft()
            if name in ("", "."):
                continue
            target = walk.link_target(name)
            if target is None:
                walk.enter(name)
                continue
            names.extendleft(reversed(target.split("/")))
            if target.startswith("/"):
                walk.restart()
        reason = unsafe(os.fstat(walk.fd))
        if reason:
            raise _Untrusted(walk.at, reason)
        return walk.fd
    except BaseException:
        os.close(walk.fd)
        raise


def _open_cache_entry(key: str) -> tuple[int, int | None]:
    """Descriptors of this key's build directory in the cache (created private) and of its
    binary when there is one, every component checked; ``_Untrusted`` when one is unsafe or
    the cache cannot be used."""
    root = cache_root()
    try:
        root_fd = _open_trusted_dir(root)
        try:
            return _open_entry(root_fd, root / f"shm-{key}", f"arfuse_shm_{key}.so")
        finally:
            os.close(root_fd)
    except OSError as exc:
        raise _Untrusted(root, f"cannot be used ({type(exc).__name__}: {exc})") from exc


def _open_entry(root_fd: int, entry: Path, binary_name: str) -> tuple[int, int | None]:
    """Build directory ``entry`` in the open cache directory (created private), and its binary
    ``binary_name`` when there is one, both checked (``unsafe``)."""
    entry_fd = _open_private_dir(root_fd, entry.name, entry, unsafe)
    binary = entry / binary_name
    try:
        return entry_fd, _open_checked(entry_fd, binary.name, _OPEN_FILE, binary, _unsafe_binary)
    except FileNotFoundError:
        return entry_fd, None
    except BaseException:
        os.close(entry_fd)
        raise


def _unsafe_binary(info: os.stat_result) -> str:
    return unsafe(info) or ("" if stat.S_ISREG(info.st_mode) else "is not a regular file")


def _private_temp_dir() -> Path:
    """A fresh directory only this user can enter, removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="arfuse-shm-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _refuse(problem: _Untrusted) -> Path:
    fallback = _private_temp_dir()
    log.logger.warning("arfuse shm: not using the kernel cache at %s: %s %s; building the "
                       "kernel in %s instead (fix that path's owner and mode, or set "
                       "ARFUSE_CACHE_DIR)", cache_root(), problem.path, problem.reason, fallback)
    return fallback


@contextlib.contextmanager
def _build_dir(key: str) -> Iterator[tuple[int, int | None]]:
    """Descriptors of this key's build directory and of its cached binary (``None``: build
    it), or of a fresh private temporary directory when the cache (or the entry) is not safe
    to use. The directory's is closed after the block, the binary's is the caller's."""
    try:
        directory, binary = _open_cache_entry(key)
    except _Untrusted as problem:
        directory, binary = _open_trusted_dir(_refuse(problem)), None
    try:
        yield directory, binary
    finally:
        os.close(directory)


def _build() -> tuple[ModuleType | None, str]:
    if os.environ.get("ARFUSE_SHM_PURE_TORCH") == "1":
        return None, "ARFUSE_SHM_PURE_TORCH=1"
    if compiler() is None:
        return None, "no C++ compiler found (install g++ or set CXX)"
    problem = isa_problem(target_isa())
    if problem:  # a binary for an instruction set the CPU lacks would die of SIGILL
        return None, problem
    try:
        from torch.utils import cpp_extension
    except ImportError as exc:  # pragma: no cover - torch without cpp_extension
        return None, f"torch.utils.cpp_extension unavailable: {exc}"
    key = build_key()
    name = f"arfuse_shm_{key}"
    try:
        with _build_dir(key) as (directory, binary):
            where = os.path.join(os.path.realpath(_fd_path(directory)), f"{name}.so")
            if binary is not None:  # cached: import it directly (ninja's check costs ~0.3 s)
                found = _cached_module(name, binary, where)
                if found is not None:
                    return found, ""
            with _one_builder(directory):
                binary = _binary_if_built(directory, name, where)  # by whom we waited for
                found = None if binary is None else _cached_module(name, binary, where)
                return (found, "") if found is not None else _compile(cpp_extension, name,
                                                                       directory, where)
    except (OSError, _Untrusted) as exc:
        return None, f"no safe build directory: {type(exc).__name__}: {exc}"


def _cached_module(name: str, binary: int, where: str) -> ModuleType | None:
    """The module of a cached binary, or ``None`` for a broken cache entry (rebuilt)."""
    try:
        module = _import_cached(name, binary)
    except ImportError:
        return None
    module.__file__ = where  # not the descriptor's name, which means nothing later
    return module


TORCH_BUILD_LOCK = "lock"
"""The file torch's ``cpp_extension.load`` holds in its build directory while it builds, and
waits on, for as long as it exists, before it builds there itself."""


@contextlib.contextmanager
def _one_builder(directory: int) -> Iterator[None]:
    """One build at a time in the open build ``directory``, under a lock the kernel drops when
    its holder dies. torch's own lock is a file: a build killed midway (Ctrl-C, a job's kill)
    leaves it, and every later build of that key would wait for it for ever. Under this lock no
    live build holds torch's, so one found is stale and goes."""
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(TORCH_BUILD_LOCK, dir_fd=directory)
        yield
    finally:
        os.close(fd)  # and with it the lock


def _binary_if_built(directory: int, name: str, where: str) -> int | None:
    """The checked binary another process built while this one waited, if any."""
    try:
        return _open_checked(directory, f"{name}.so", _OPEN_FILE, Path(where), _unsafe_binary)
    except FileNotFoundError:
        return None


def _import_cached(name: str, binary: int) -> ModuleType:
    """The module from the open, checked ``binary``, which stays open for the life of the
    process: the dynamic loader knows a library by the name it was opened under, and would
    hand this one out again for another file opened later under the same descriptor number."""
    module = _import(name, _fd_path(binary))
    _held.append(binary)
    return module


def held_descriptors() -> tuple[int, ...]:
    """Descriptors the loaded kernel keeps open for the life of the process (its binary), so
    that leak checks do not count them."""
    return tuple(_held)


def _compile(cpp_extension: Any, name: str, directory: int,
             where: str) -> tuple[ModuleType | None, str]:
    """Build the kernel in the open ``directory`` and import it from there (by its descriptor's
    name, so a path changed meanwhile cannot substitute another directory)."""
    try:
        module = cpp_extension.load(
            name=name, sources=[str(p) for p in sources()],
            extra_cflags=compile_flags(), extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(d) for d in include_dirs()],
            build_directory=_fd_path(directory), verbose=False)
    except Exception as exc:  # a broken toolchain means the pure path, not a crash
        return None, f"building the kernel failed: {type(exc).__name__}: {str(exc)[-500:]}"
    module.__file__ = where
    return module, ""
