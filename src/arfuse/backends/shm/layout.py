"""Byte layout of the shm segment, as the kernel sees it (``csrc/layout.h`` holds the same
numbers; tests/test_shm_kernel_contract.py checks that the two agree).

Header page: line 0 the segment's own identity (magic, version, creator), then per rank one
line each of process identity, arrival flag and done flag, then the copy-mode votes. A rank's
arrival line holds its flag (int64 at byte 0) and, beside it, the descriptor of its current
call, one per call parity (R11: every rank compares every descriptor before it waits for any
block), the count of ranks asleep on the flag (futex waits; the done line has one at the same
offset) and the CPU the rank last started a call on.
Then, per rank and per buffer (double-buffered, so no trailing barrier), an input slot of
``max_tokens`` rows and a result slot for the sums of the rows that rank owns in two-shot mode
(``ceil(max_tokens / world)`` rows).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

from ...call_checks import MAX_OP
from ...sizing import ceil_div, round_up

CACHE_LINE = 64
PAGE = 4096
HEADER_BYTES = PAGE
BUFFERS = 2
MAX_WORLD = 16
# Line 0: the segment's identity, written by its creator before the segment has a name, so that
# the sweep of stale segments removes only what is provably arfuse's and provably abandoned.
# int64 fields; these five stay at these offsets in every version.
SEGMENT_MAGIC = 0x4D53657375667261                    # the bytes b"arfuseSM", little-endian
SEGMENT_VERSION = 1                                   # the version of this layout
MAGIC_OFFSET = 0
VERSION_OFFSET = 8
CREATOR_PID_OFFSET = 16
CREATOR_START_OFFSET = 24                             # clock ticks after boot (/proc/PID/stat)
CREATOR_PIDNS_OFFSET = 32                             # inode of the creator's /proc/self/ns/pid
SEGMENT_ID_BYTES = 40
IDENTITY_OFFSET = CACHE_LINE                          # MAX_WORLD lines: pid, start time
ARRIVE_OFFSET = CACHE_LINE * (1 + MAX_WORLD)          # MAX_WORLD lines: arrival flags
DONE_OFFSET = CACHE_LINE * (1 + 2 * MAX_WORLD)        # MAX_WORLD lines: done flags
VOTE_OFFSET = CACHE_LINE * (1 + 3 * MAX_WORLD)        # MAX_WORLD x VOTE_BUCKETS bytes
VOTE_BUCKETS = 40
PROGRESS_UNITS = 1 << 20                              # arrival flag units per call
MAX_TOKENS = PROGRESS_UNITS - MAX_WORLD               # a call has fewer blocks than that

# The call descriptor: two int64 words per call parity, after the flag in the arrival line.
# Word 0 packs the call's shape, word 1 is the hidden size.
DESC_OFFSET = 8                                       # bytes into the arrival line
DESC_BYTES = 16                                       # per parity
DESC_TOKENS_SHIFT = 0                                 # 32 bits
DESC_PATTERN_SHIFT = 32                               # 2 bits: PATTERN_*
DESC_QUANT_SHIFT = 34                                 # 2 bits: the quant code's low bits
DESC_LAYOUT_SHIFT = 36                                # 1 bit: NVFP4 scales swizzled
DESC_QUANT_HIGH_SHIFT = 37                            # 1 bit: the quant code's bit 2
# quant codes: 0 none, 1 fp8, 2 nvfp4, 3 other (announce: a quant the kernel does not run),
# 4 fp8_dynamic
WAITERS_OFFSET = 40                                   # into a flag's line: int32, ranks asleep
CPU_OFFSET = 44                                       # into an arrival line: int32, its CPU
DESC_MODE_SHIFT = 38                                  # 1 bit: two-shot
DESC_DTYPE_SHIFT = 40                                 # 2 bits: the dtype's kernel code
DESC_OP_SHIFT = 32                                    # word 1: hidden below, the op above
MAX_HIDDEN = (1 << 31) - 1
PATTERN_PLAIN = 0                                     # all-reduce only
PATTERN_NORM = 1                                      # + RMSNorm
PATTERN_NORM_RESIDUAL = 2                             # + residual + RMSNorm

_DTYPE_NAMES = ("bf16", "fp16", "fp32")
_PATTERN_NAMES = ("plain", "norm", "norm+residual")
_QUANT_NAMES = ("none", "fp8", "nvfp4", "other", "fp8_dynamic")
_FIELDS = ("tokens", "dtype", "hidden", "pattern", "quant", "layout", "mode", "op")


def descriptor(tokens: int, dtype_code: int, hidden: int, pattern: int, quant_code: int,
               swizzled: bool, twoshot: bool = False, op: int = 0) -> tuple[int, int]:
    """The two words a rank publishes for a call (the kernel's ``descriptor_word`` and
    ``descriptor_word1``), as signed int64 like the segment holds them."""
    layout_bit = 1 if quant_code == 2 and swizzled else 0
    word0 = (min(tokens, 0xFFFFFFFF) << DESC_TOKENS_SHIFT | pattern << DESC_PATTERN_SHIFT
             | (quant_code & 3) << DESC_QUANT_SHIFT | (quant_code >> 2) << DESC_QUANT_HIGH_SHIFT
             | layout_bit << DESC_LAYOUT_SHIFT | int(twoshot) << DESC_MODE_SHIFT
             | dtype_code << DESC_DTYPE_SHIFT)
    word1 = (hidden & 0xFFFFFFFF) | (op & MAX_OP) << DESC_OP_SHIFT
    return word0, word1 - (1 << 64) if word1 >= 1 << 63 else word1


def _fields(word0: int, word1: int) -> tuple[int, ...]:
    word1 &= (1 << 64) - 1
    return ((word0 >> DESC_TOKENS_SHIFT) & 0xFFFFFFFF, (word0 >> DESC_DTYPE_SHIFT) & 3,
            word1 & 0xFFFFFFFF, (word0 >> DESC_PATTERN_SHIFT) & 3,
            ((word0 >> DESC_QUANT_SHIFT) & 3) | (((word0 >> DESC_QUANT_HIGH_SHIFT) & 1) << 2),
            (word0 >> DESC_LAYOUT_SHIFT) & 1, (word0 >> DESC_MODE_SHIFT) & 1,
            (word1 >> DESC_OP_SHIFT) & MAX_OP)


def _name(names: tuple[str, ...], value: int) -> str:
    return names[value] if 0 <= value < len(names) else "?"


def describe_descriptor(word0: int, word1: int) -> str:
    """``tokens=1 dtype=fp32 hidden=64 pattern=plain quant=none mode=oneshot op=3`` (as the
    kernel writes it)."""
    tokens, dtype, hidden, pattern, quant, swizzled, twoshot, op = _fields(word0, word1)
    text = (f"tokens={tokens} dtype={_name(_DTYPE_NAMES, dtype)} hidden={hidden} "
            f"pattern={_name(_PATTERN_NAMES, pattern)} quant={_name(_QUANT_NAMES, quant)}")
    if quant == 2:
        text += " layout=" + ("swizzled_128x4" if swizzled else "linear")
    return text + f" mode={'twoshot' if twoshot else 'oneshot'} op={op}"


def mismatch_message(call: int, descriptors: list[tuple[int, int]]) -> str:
    """The ``MismatchedCall`` text for one descriptor per rank (the kernel's, word for word)."""
    fields = [_fields(*words) for words in descriptors]
    differ = [name for i, name in enumerate(_FIELDS) if len({f[i] for f in fields}) > 1]
    ranks = "".join(f"; rank {r}: {describe_descriptor(*words)}"
                    for r, words in enumerate(descriptors))
    return (f"arfuse shm: the ranks of the group called with different arguments (call {call}; "
            "every rank raises this before any rank reads a peer's data, so the workspace "
            f"stays usable for calls that match): they differ in {', '.join(differ)}{ranks}")


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
