"""Opening a path so that no other user can choose what it names: the kernel cache's checks.

Trusted are root and this user. A directory or symbolic link on the way must belong to one of
them, and a directory there must not be writable by group or others unless it is sticky (as
``/tmp``): whoever can change the path can swap what it names. What is checked is what is used:
the path is opened one component at a time, each relative to the one before and never through
a symbolic link (one is resolved by reading it, itself checked), and the opened descriptors are
the ones checked; a file is then used by its descriptor's name (``/proc/self/fd/N``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections import deque
from collections.abc import Callable
from pathlib import Path

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


class Untrusted(Exception):
    """``path`` is not safe to load code from, for ``reason``."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path} {reason}")
        self.path, self.reason = path, reason


# every component is opened relative to the one before, never through a symbolic link: what
# is checked (fstat of the descriptor) is what is used, whatever the path names meanwhile
# (O_PATH: a directory this user may only search, as some parents are, opens all the same)
OPEN_DIR = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_SYMLINKS = 40  # as the kernel's own path lookup


def fd_path(fd: int) -> str:
    """A name for exactly the file or directory ``fd`` has open (Linux), whatever was renamed
    or replaced since it was opened."""
    return f"/proc/self/fd/{fd}"


def open_checked(dir_fd: int | None, name: str, flags: int, shown: Path,
                 check: Callable[[os.stat_result], str]) -> int:
    """``name`` in ``dir_fd`` opened (``flags``) and passed by ``check``, or ``Untrusted``
    (``shown``: its path, for the message)."""
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:  # O_NOFOLLOW refuses a symbolic link with ELOOP, or ENOTDIR
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(
                os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise Untrusted(shown, "is a symbolic link") from exc
        raise
    reason = check(os.fstat(fd))
    if reason:
        os.close(fd)
        raise Untrusted(shown, reason)
    return fd


def open_private_dir(dir_fd: int, name: str, shown: Path,
                     check: Callable[[os.stat_result], str]) -> int:
    """Directory ``name`` in ``dir_fd``, created with mode 0700 where missing, opened and passed
    by ``check`` (``open_checked``)."""
    try:
        return open_checked(dir_fd, name, OPEN_DIR, shown, check)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        return open_checked(dir_fd, name, OPEN_DIR, shown, check)


class _Walk:
    """A directory descriptor moved one component at a time from ``/``, each directory and
    symbolic link on the way trusted (``unsafe_on_the_way``), missing directories created with
    mode 0700 (the caller closes ``fd``)."""

    def __init__(self) -> None:
        self.fd = open_checked(None, "/", OPEN_DIR, Path("/"), unsafe_on_the_way)
        self.at = Path("/")
        self.symlinks = 0

    def enter(self, name: str) -> None:
        """Into directory ``name`` (not a symbolic link), created where missing."""
        shown = self.at.parent if name == ".." else self.at / name
        fd = open_private_dir(self.fd, name, shown, unsafe_on_the_way)
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
            raise Untrusted(self.at / name, reason)
        return os.readlink(name, dir_fd=self.fd)

    def restart(self) -> None:
        """Back at ``/``, for a symbolic link to an absolute path."""
        fd = open_checked(None, "/", OPEN_DIR, Path("/"), unsafe_on_the_way)
        os.close(self.fd)
        self.fd, self.at = fd, Path("/")


def open_trusted_dir(path: Path) -> int:
    """A descriptor of directory ``path`` (created private where missing), reached from ``/``
    through trusted directories and symbolic links only, and itself private to this user;
    ``Untrusted`` names the first component that is not."""
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
            raise Untrusted(walk.at, reason)
        return walk.fd
    except BaseException:
        os.close(walk.fd)
        raise


def unsafe_file(info: os.stat_result) -> str:
    """As ``unsafe``, and not a regular file (a binary or its record)."""
    return unsafe(info) or ("" if stat.S_ISREG(info.st_mode) else "is not a regular file")
