"""Byte layout of the shm segment, as the kernel sees it (``csrc/layout.h`` holds the same
numbers; a test checks that the two agree).

Header page: line 0 unused, then per rank one line each of process identity, arrival flag and
done flag, then the copy-mode votes. Then, per rank and per buffer (double-buffered, so no
trailing barrier), an input slot of ``max_tokens`` rows and a result slot for the sums of the
rows that rank owns in two-shot mode (``ceil(max_tokens / world)`` rows).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...sizing import ceil_div, round_up

CACHE_LINE = 64
PAGE = 4096
HEADER_BYTES = PAGE
BUFFERS = 2
MAX_WORLD = 16
IDENTITY_OFFSET = CACHE_LINE                          # MAX_WORLD lines: pid, start time
ARRIVE_OFFSET = CACHE_LINE * (1 + MAX_WORLD)          # MAX_WORLD lines: arrival flags
DONE_OFFSET = CACHE_LINE * (1 + 2 * MAX_WORLD)        # MAX_WORLD lines: done flags
VOTE_OFFSET = CACHE_LINE * (1 + 3 * MAX_WORLD)        # MAX_WORLD x VOTE_BUCKETS bytes
VOTE_BUCKETS = 40
PROGRESS_UNITS = 1 << 20                              # arrival flag units per call
MAX_TOKENS = PROGRESS_UNITS - MAX_WORLD               # a call has fewer blocks than that


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
