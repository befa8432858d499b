"""The segment's mapping in one process, made to outlive every tensor view of it.

``torch.frombuffer`` keeps the object it is given alive but releases its buffer at once, so an
``mmap.mmap`` of the segment can be closed (unmapped) under live views, and reading one then
kills the process. Here an anonymous reservation owns the address range: every view keeps it
alive, and the last view to go unmaps the range. The segment is mapped over the reservation,
and at close its pages are replaced in place by private zero pages: the shared memory goes
with the workspace, a view still held reads zeros, and nothing is unmapped under it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings

import torch

# mmap(2) flag: replace whatever is mapped at the address (the same value on every Linux this
# backend runs on: x86, arm, ppc, s390, riscv)
_MAP_FIXED = 0x10

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long)


def _map_over(address: int, length: int, flags: int, fd: int) -> None:
    got = _mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE, flags | _MAP_FIXED, fd, 0)
    if got != address:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mapping {length} bytes at {address:#x}: {os.strerror(errno)}")


def map_segment(fd: int, length: int) -> torch.Tensor:
    """The first ``length`` bytes of the file ``fd``, shared, as a uint8 tensor. Every view of
    it keeps the mapping; the fd may be closed at once."""
    # no access (PROT_NONE, which the mmap module does not name) and private: the reservation
    # holds addresses, not memory
    reservation = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE, prot=0)
    with warnings.catch_warnings():  # "not writable": the pages mapped over it are
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        view = torch.frombuffer(reservation, dtype=torch.uint8)
    _map_over(view.data_ptr(), length, mmap.MAP_SHARED, fd)
    return view


def retire(segment: torch.Tensor) -> bool:
    """Replace the pages of ``segment`` (a tensor from ``map_segment``) with private zero
    pages: this process lets go of the shared memory, views of it read zeros from now on, and
    the last of them frees the range. False when the kernel refused (memory limits): the views
    then keep the segment mapped until the last of them goes."""
    try:
        _map_over(segment.data_ptr(), segment.numel(), mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
    except OSError:
        return False
    return True
