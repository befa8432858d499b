"""Reading a file whose path the user gives (a topology, a scenario): regular files only.

A FIFO blocks ``open()`` until a writer comes, a terminal or a device can block ``read()`` or
stream forever; none of them is a file of settings. The path is opened without blocking, the
opened file is checked (no race with a path replaced in between), and only then read, bounded.
"""

from __future__ import annotations

import os
import stat

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a file")


def read_regular_file(path: str | os.PathLike[str], max_bytes: int, label: str) -> bytes:
    """At most ``max_bytes + 1`` bytes of the regular file ``path`` (one more than allowed, so
    the caller can tell a file that is too large). Every problem is a ``ValueError`` that starts
    with ``label`` (what the file is and where its path came from)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ValueError(f"cannot read {label}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{label} is not a regular file ({_kind(mode)}); give the path of "
                             "a file")
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise ValueError(f"cannot read {label}: {exc.strerror}") from None
    finally:
        os.close(fd)
