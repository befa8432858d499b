"""Byte layout of the shm segment, as the kernel sees it: the numbers are ``csrc/layout.h``'s
own (read by ``arfuse.ctables``), so the pure-torch path and the kernel cannot disagree.

Header page: line 0 the segment's own identity (magic, version, creator, written before the
segment has a name, so that the sweep of stale segments removes only what is provably arfuse's
and provably abandoned), then per rank one line each of process identity, arrival flag and done
flag, then the copy-mode votes. A rank's arrival line holds its flag (int64 at byte 0) and,
beside it, the signature of its current call (``arfuse.signature``), one per call parity (R11:
every rank compares every signature before it waits for any block), the count of ranks asleep
on the flag (futex waits; the done line has one at the same offset) and the CPU the rank last
started a call on. Then, per rank and per buffer (double-buffered, so no trailing barrier), an
input slot of ``max_tokens`` rows and a result slot for the sums of the rows that rank owns in
two-shot mode (``ceil(max_tokens / world)`` rows).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ... import ctables
from ...sizing import ceil_div, round_up


def _constant(name: str) -> int:
    return ctables.int_constant("layout.h", name, Path(__file__).resolve().parent / "csrc")


CACHE_LINE = _constant("kCacheLine")
PAGE = _constant("kPage")
HEADER_BYTES = _constant("kHeaderBytes")
BUFFERS = _constant("kBuffers")
MAX_WORLD = _constant("kMaxWorld")
SEGMENT_MAGIC = _constant("kSegmentMagic")
SEGMENT_VERSION = _constant("kSegmentVersion")
MAGIC_OFFSET = _constant("kMagicOffset")
VERSION_OFFSET = _constant("kVersionOffset")
CREATOR_PID_OFFSET = _constant("kCreatorPidOffset")
CREATOR_START_OFFSET = _constant("kCreatorStartOffset")
CREATOR_PIDNS_OFFSET = _constant("kCreatorPidnsOffset")
SEGMENT_ID_BYTES = _constant("kSegmentIdBytes")
IDENTITY_OFFSET = _constant("kIdentityOffset")
ARRIVE_OFFSET = _constant("kArriveOffset")
DONE_OFFSET = _constant("kDoneOffset")
VOTE_OFFSET = _constant("kVoteOffset")
VOTE_BUCKETS = _constant("kVoteBuckets")
PROGRESS_UNITS = _constant("kProgressUnits")
MAX_TOKENS = _constant("kMaxTokens")
SIGNATURE_OFFSET = _constant("kSignatureOffset")
SIGNATURE_BYTES = _constant("kSignatureBytes")
WAITERS_OFFSET = _constant("kWaitersOffset")
CPU_OFFSET = _constant("kCpuOffset")
RING_OFFSET = _constant("kRingOffset")


@dataclass(frozen=True)
class SegmentId:
    """Line 0 of a segment: who made it, in which layout version."""

    version: int
    pid: int
    start: int
    pidns: int

    _FIELDS: ClassVar[tuple[tuple[str, int], ...]] = (
        ("version", VERSION_OFFSET), ("pid", CREATOR_PID_OFFSET),
        ("start", CREATOR_START_OFFSET), ("pidns", CREATOR_PIDNS_OFFSET))

    def encode(self) -> bytes:
        data = bytearray(SEGMENT_ID_BYTES)
        struct.pack_into("<q", data, MAGIC_OFFSET, SEGMENT_MAGIC)
        for name, offset in self._FIELDS:
            struct.pack_into("<q", data, offset, getattr(self, name))
        return bytes(data)

    @classmethod
    def decode(cls, data: bytes) -> SegmentId | None:
        """The identity in the first bytes of a file, or ``None`` when it has no arfuse magic."""
        if len(data) < SEGMENT_ID_BYTES or struct.unpack_from("<q", data, MAGIC_OFFSET)[0] \
                != SEGMENT_MAGIC:
            return None
        return cls(*(struct.unpack_from("<q", data, offset)[0] for _name, offset in cls._FIELDS))


@dataclass(frozen=True)
class ShmLayout:
    world_size: int
    max_tokens: int
    hidden: int
    elem_size: int

    @property
    def chunk_rows(self) -> int:
        return ceil_div(self.max_tokens, self.world_size)

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.elem_size

    @property
    def input_bytes(self) -> int:
        return round_up(self.max_tokens * self.row_bytes, CACHE_LINE)

    @property
    def result_bytes(self) -> int:
        return round_up(self.chunk_rows * self.row_bytes, CACHE_LINE)

    @property
    def slot_bytes(self) -> int:
        return self.input_bytes + self.result_bytes

    def slot_offset(self, rank: int, buffer: int) -> int:
        return HEADER_BYTES + (rank * BUFFERS + buffer) * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return round_up(HEADER_BYTES + self.world_size * BUFFERS * self.slot_bytes, PAGE)
