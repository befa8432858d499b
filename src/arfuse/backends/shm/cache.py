"""The kernel cache: where it is, and its entries found, checked, verified, loaded, removed.

The cache is private: its directory is created with mode 0700, and a cache directory, build
directory or binary that another user owns, or that group or others may write, is never
loaded (someone else could have put code there), nor one reached through a path another user
could change (``trust``): the kernel is then built in a fresh private temporary directory
instead, and the log names the path and why. The binary is loaded by its checked descriptor's
name (``/proc/self/fd/N``), as is a fresh build's directory.

A cache entry is loaded only when its record (``<binary>.record``, written beside the binary
once it is built) gives the binary's size and sha256, both read from the descriptor that is
loaded: a binary cut short (a killed link, a full disk) would kill the process with SIGBUS.
An entry without a record, or not matching it, is logged, removed whole under the one-builder
lock (ninja would not relink a damaged binary whose inputs are unchanged) and built again.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from ... import log
from .trust import (
    OPEN_FILE,
    Untrusted,
    fd_path,
    open_checked,
    open_private_dir,
    open_trusted_dir,
    unsafe,
    unsafe_file,
)

_held: list[int] = []  # see held_descriptors


def cache_root() -> Path:
    env = os.environ.get("ARFUSE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "arfuse"


ENTRY_FORMAT = "2"
"""What a cache entry holds, in the build key: an entry of format 1 had no record."""
RECORD_SUFFIX = ".record"


def import_extension(name: str, path: str) -> ModuleType:
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


def _open_cache_entry(key: str) -> tuple[int, int | None]:
    """Descriptors of this key's build directory in the cache (created private) and of its
    binary when there is one, every component checked; ``Untrusted`` when one is unsafe or
    the cache cannot be used."""
    root = cache_root()
    try:
        root_fd = open_trusted_dir(root)
        try:
            return _open_entry(root_fd, root / f"shm-{key}", f"arfuse_shm_{key}.so")
        finally:
            os.close(root_fd)
    except OSError as exc:
        raise Untrusted(root, f"cannot be used ({type(exc).__name__}: {exc})") from exc


def _open_entry(root_fd: int, entry: Path, binary_name: str) -> tuple[int, int | None]:
    """Build directory ``entry`` in the open cache directory (created private), and its binary
    ``binary_name`` when there is one, both checked (``unsafe``)."""
    entry_fd = open_private_dir(root_fd, entry.name, entry, unsafe)
    binary = entry / binary_name
    try:
        return entry_fd, open_checked(entry_fd, binary.name, OPEN_FILE, binary, unsafe_file)
    except FileNotFoundError:
        return entry_fd, None
    except BaseException:
        os.close(entry_fd)
        raise


def _private_temp_dir() -> Path:
    """A fresh directory only this user can enter, removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="arfuse-shm-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _refuse(problem: Untrusted) -> Path:
    fallback = _private_temp_dir()
    log.logger.warning("arfuse shm: not using the kernel cache at %s: %s %s; building the "
                       "kernel in %s instead (fix that path's owner and mode, or set "
                       "ARFUSE_CACHE_DIR)", cache_root(), problem.path, problem.reason, fallback)
    return fallback


@contextlib.contextmanager
def build_dir(key: str) -> Iterator[tuple[int, int | None, bool]]:
    """Descriptors of this key's build directory and of its cached binary (``None``: build
    it), and whether that directory is in the cache; or a fresh private temporary directory
    when the cache (or the entry) is not safe to use. The directory's descriptor is closed
    after the block, the binary's is the caller's."""
    try:
        directory, binary = _open_cache_entry(key)
        cached = True
    except Untrusted as problem:
        directory, binary, cached = open_trusted_dir(_refuse(problem)), None, False
    try:
        yield directory, binary, cached
    finally:
        os.close(directory)


def cached_module(directory: int, name: str, binary: int,
                  where: str) -> tuple[ModuleType | None, str]:
    """The module of the cached ``binary`` when its record vouches for it, else ``None`` and
    what is wrong with the entry (``binary`` is closed then)."""
    try:
        problem = _entry_problem(directory, name, binary, where)
        if not problem:
            module = _import_cached(name, binary)
            module.__file__ = where  # not the descriptor's name, which means nothing later
            return module, ""
    except ImportError as exc:
        problem = f"it does not import: {exc}"
    except BaseException:
        os.close(binary)
        raise
    os.close(binary)
    return None, problem


def record(size: int, sha256: str) -> str:
    """The text of a binary's record: its size in bytes and the hex sha256 of its bytes."""
    return f"size {size}\nsha256 {sha256}\n"


def _digest(fd: int) -> str:
    """The hex sha256 of the open file ``fd``, read through that descriptor (what is loaded)."""
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _entry_problem(directory: int, name: str, binary: int, where: str) -> str:
    """What is wrong with the open cached ``binary`` by its record ("" when it matches)."""
    shown = Path(where + RECORD_SUFFIX)
    try:
        fd = open_checked(directory, shown.name, OPEN_FILE, shown, unsafe_file)
    except FileNotFoundError:
        return "it has no record of its size and sha256"
    except Untrusted as problem:
        return f"its record {problem.reason}"
    with os.fdopen(fd, "rb") as file:
        text = file.read(4096).decode(errors="replace")
    fields = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
    size = os.fstat(binary).st_size
    if fields.get("size") != str(size):
        return f"it is {size} bytes, its record says {fields.get('size', 'nothing')}"
    if fields.get("sha256") != _digest(binary):
        return "its sha256 is not the one its record gives"
    return ""


def write_record(directory: int, name: str, where: str) -> None:
    """Record the freshly built binary's size and sha256 beside it (written whole, then
    renamed into place, so a record is never seen half written)."""
    binary = open_checked(directory, f"{name}.so", OPEN_FILE, Path(where), unsafe_file)
    try:
        text = record(os.fstat(binary).st_size, _digest(binary))
    finally:
        os.close(binary)
    final = f"{name}.so{RECORD_SUFFIX}"
    temporary = f"{final}.{os.getpid()}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=directory)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(temporary, final, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=directory)
        raise


def clear_entry(directory: int) -> None:
    """Remove everything in the open build ``directory``, whose lock the caller holds."""
    listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=directory)
    try:
        names = os.listdir(listing)
    finally:
        os.close(listing)
    for name in names:
        try:
            os.unlink(name, dir_fd=directory)
        except IsADirectoryError:  # not one that torch makes, but nothing of the entry stays
            shutil.rmtree(os.path.join(fd_path(directory), name))


TORCH_BUILD_LOCK = "lock"
"""The file torch's ``cpp_extension.load`` holds in its build directory while it builds, and
waits on, for as long as it exists, before it builds there itself."""


@contextlib.contextmanager
def one_builder(directory: int) -> Iterator[None]:
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


def binary_if_built(directory: int, name: str, where: str) -> int | None:
    """The checked binary in the open build ``directory`` now (one another process built
    while this one waited, or the one found broken), if any."""
    try:
        return open_checked(directory, f"{name}.so", OPEN_FILE, Path(where), unsafe_file)
    except FileNotFoundError:
        return None


def _import_cached(name: str, binary: int) -> ModuleType:
    """The module from the open, checked ``binary``, which stays open for the life of the
    process: the dynamic loader knows a library by the name it was opened under, and would
    hand this one out again for another file opened later under the same descriptor number."""
    module = import_extension(name, fd_path(binary))
    _held.append(binary)
    return module


def held_descriptors() -> tuple[int, ...]:
    """Descriptors the loaded kernel keeps open for the life of the process (its binary), so
    that leak checks do not count them."""
    return tuple(_held)
