"""The shm backend's segment on disk: where it is made, its name, its creator's identity, how
each rank opens and reserves it, and the sweep of segments dead jobs left.

Lifecycle of the segment: group rank 0 makes it unnamed (``O_TMPFILE`` in ``segment_dir()``),
writes its identity (magic, layout version, creator) into the header and reserves its own part;
every other rank opens it through rank 0's descriptor (``/proc/<pid>/fd/<n>``), reserves its
own part and maps it, and closes its descriptor. So the segment never has a name and, once
mapped, no descriptor: the kernel frees it when the last mapping goes, even if the job is
killed. Only where that cannot be done (a peer in another pid namespace, or one that /proc
refuses; a filesystem without unnamed files) does the segment get a name,
``arfuse-<pid>-<start>-<random>``, which rank 0 unlinks as soon as every rank has it open. A
segment left with its name by a creator that died in between is removed by the next creation
on the machine (``clean_stale_segments``, which removes only segments whose header proves them
arfuse's and their creator gone).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import ctables, log
from ...errors import CreationFailed
from .layout import SEGMENT_ID_BYTES, SEGMENT_VERSION, SegmentId, ShmLayout

DEFAULT_SHM_DIR = Path("/dev/shm")
PREFIX = "arfuse-"


# the rule by which a waiting rank tells a dead peer (csrc/liveness.h, the kernel's too)
_LIVENESS = ctables.header("liveness.h", Path(__file__).resolve().parent / "csrc")
LIVENESS_LOOK_S = float(_LIVENESS["kLookS"])
_STATE_FIELD = int(_LIVENESS["kStatStateField"])
_START_FIELD = int(_LIVENESS["kStatStartField"])
_DEAD_STATES = ("Z", "X")  # zombie, dead: the kernel's process_alive (protocol.cpp)


def _stat(pid: int) -> tuple[str, int]:
    """(state, start time in clock ticks) of ``pid`` from /proc; ("", -1) when unreadable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "", -1
    fields = text[text.rindex(")") + 2:].split()  # from field 3 on
    return fields[_STATE_FIELD - 3], int(fields[_START_FIELD - 3])


def process_identity(pid: int | None = None) -> tuple[int, int]:
    """(pid, start time in clock ticks): a pid alone can be reused by another process."""
    pid = os.getpid() if pid is None else pid
    return pid, _stat(pid)[1]


def alive(pid: int, start: int) -> bool:
    """Whether the process that published (``pid``, ``start``) lives: the rule of
    ``csrc/liveness.h``, as the kernel's ``process_alive`` applies it."""
    state, found = _stat(pid)
    return found >= 0 and found == start and state not in _DEAD_STATES


def segment_dir() -> Path:
    """Where segments are made: ``ARFUSE_SHM_DIR``, read at each use (empty means unset, as
    for every arfuse variable), else /dev/shm."""
    return Path(os.environ.get("ARFUSE_SHM_DIR", "").strip() or DEFAULT_SHM_DIR)


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid; 0 when unknown): a pid
    means a process only within its namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def clean_stale_segments(directory: Path | None = None) -> list[str]:
    """Remove the segments a dead creator left in ``directory`` (default: ``segment_dir()``);
    returns their names. Only what is provably arfuse's and provably abandoned goes: a regular
    file of this user, named ``arfuse-*``, whose header has arfuse's magic and names a creator
    (pid and start time) in this pid namespace that is no longer alive. Anything else stays: a
    file merely named like a segment, another user's, one whose creator is unknown (no /proc
    when it was made) or cannot be seen from here."""
    directory = segment_dir() if directory is None else directory
    removed: list[str] = []
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return removed
    try:
        for name in sorted(os.listdir(dir_fd)):
            if name.startswith(PREFIX) and _abandoned(dir_fd, name):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
                    removed.append(name)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    if removed:
        log.logger.info("arfuse shm: removed segments of dead jobs from %s: %s", directory,
                        ", ".join(removed))
    return removed


def _abandoned(dir_fd: int, name: str) -> bool:
    """Whether ``name`` is a segment of this user whose creator is gone (see the sweep)."""
    try:
        # never open anything but a regular file (a FIFO would block, a device could act)
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return False
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        found = SegmentId.decode(os.pread(fd, SEGMENT_ID_BYTES, 0))
        if (found is None or found.start < 0 or found.pidns == 0
                or found.pidns != pid_namespace() or alive(found.pid, found.start)):
            return False  # not arfuse's, a creator it could not name, or one alive or unseen
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)  # still the file read
        return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)
    except OSError:
        return False
    finally:
        os.close(fd)


FileId = tuple[int, int]  # (st_dev, st_ino): which file a name or descriptor is


def file_id(fd: int) -> FileId:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


@dataclass
class SegmentFile:
    """Where the segment is in the directory: its name ("" while it has none) and the file
    this rank has open."""

    directory: Path
    name: str = ""
    file: FileId | None = None

    def remove_name(self) -> None:
        """Unlink the name if it is still the file this rank has open (never another one)."""
        if not self.name or self.file is None:
            return
        path = self.directory / self.name
        with contextlib.suppress(OSError):
            st = os.stat(path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == self.file:
                os.unlink(path)


def reserve(fd: int, layout: ShmLayout, rank: int) -> None:
    """Reserve this rank's slots (rank 0 also the header), each rank its own: a full directory
    fails here, on the rank that cannot reserve, not as a SIGBUS in a call; and each rank's
    pages are first touched by the rank that writes them."""
    start = 0 if rank == 0 else layout.slot_offset(rank, 0)
    end = layout.slot_offset(rank + 1, 0) if rank + 1 < layout.world_size else layout.total_bytes
    os.posix_fallocate(fd, start, end - start)


def segment_label() -> str:
    """``arfuse-<pid>-<start>-<random>``: the segment's name in logs, and in the directory
    when it has one there."""
    pid, start = process_identity()
    return f"{PREFIX}{pid}-{start}-{secrets.token_hex(6)}"


def create_segment(directory: Path, layout: ShmLayout, label: str) -> tuple[int, str]:
    """Rank 0's segment, sized, its identity written and rank 0's part reserved: its
    descriptor, and its name in ``directory`` ("": none, ``O_TMPFILE``). Only a filesystem
    without unnamed files names it from the start (``label``; a creator killed before its
    first write then leaves a file that is not provably arfuse's)."""
    pid, start = process_identity()
    name = ""
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        name = label
        fd = os.open(directory / name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.ftruncate(fd, layout.total_bytes)  # sparse: every rank reserves its own part
        os.pwrite(fd, SegmentId(SEGMENT_VERSION, pid, start, pid_namespace()).encode(), 0)
        reserve(fd, layout, 0)
    except BaseException:
        os.close(fd)
        if name:
            with contextlib.suppress(OSError):
                os.unlink(directory / name)
        raise
    return fd, name


def name_segment(directory: Path, fd: int, label: str) -> str:
    """Give rank 0's unnamed segment the name ``label`` (for peers that cannot open it
    through /proc)."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:  # linkat(AT_SYMLINK_FOLLOW) of the descriptor's /proc link: a directory fd selects it
        os.link(f"/proc/self/fd/{fd}", label, dst_dir_fd=dir_fd, follow_symlinks=True)
    finally:
        os.close(dir_fd)
    return label


def _open_segment(path: Path, layout: ShmLayout, creator: tuple[int, int]) -> int:
    """A peer's descriptor of the segment at ``path``, checked to be the one rank 0 made."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        found = SegmentId.decode(os.pread(fd, SEGMENT_ID_BYTES, 0))
        if found is None or found.version != SEGMENT_VERSION or (found.pid,
                                                                 found.start) != creator:
            raise CreationFailed(f"{path} is not the segment rank 0 made (pid {creator[0]}, "
                                 f"layout version {SEGMENT_VERSION}): its header says {found}")
        size = os.fstat(fd).st_size
        if size != layout.total_bytes:
            raise CreationFailed(f"segment has {size} bytes, expected {layout.total_bytes} "
                                 "(ranks disagree on the layout)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_shared(segment: SegmentFile, shared: dict[str, Any], layout: ShmLayout) -> int:
    """A peer opens the segment rank 0 announced, in the segment directory they share: by
    its name if it has one, else through rank 0's descriptor (``/proc/PID/fd/N``, so that it
    never needs a name). -1: not that way (rank 0 is in another pid namespace, or its /proc is
    closed to this process: not dumpable), so it needs a name."""
    creator = (int(shared["creator"][0]), int(shared["creator"][1]))
    st = os.stat(segment.directory)
    if [st.st_dev, st.st_ino] != shared["directory"]:
        raise CreationFailed(f"this rank's segment directory {segment.directory} is not rank "
                             "0's (ARFUSE_SHM_DIR): the ranks do not share one")
    if segment.name:
        fd = _open_segment(segment.directory / segment.name, layout, creator)
    elif shared["pidns"] != pid_namespace():
        return -1
    else:
        try:
            fd = _open_segment(Path(f"/proc/{creator[0]}/fd/{shared['fd']}"), layout, creator)
        except (PermissionError, FileNotFoundError):
            return -1
    segment.file = file_id(fd)
    return fd

