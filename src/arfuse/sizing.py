"""Workspace bytes and capacity per backend: pure arithmetic shared by the policy's prediction
and the backends' allocation, so what ``explain`` predicts is what ``create`` allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import Spec

MIB = 1 << 20
CACHE_LINE = 64
PAGE = 4096


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- shm: one segment per group -------------------------------------------------------------

SHM_HEADER_BYTES = PAGE
SHM_BUFFERS = 2  # double-buffered slots: no trailing barrier between calls


@dataclass(frozen=True)
class ShmLayout:
    """Byte offsets inside the shared segment.

    Header page: per-rank process identity and two sequence flags (arrive, done), one cache line
    each, then the copy-mode votes. Then, per rank and per buffer, an input slot of
    ``max_tokens`` rows and a result slot for the sums of the rows that rank owns in two-shot
    mode (``ceil(max_tokens / world)`` rows): every rank runs the epilogue from the sums, so
    no outputs cross between ranks.
    """

    world_size: int
    max_tokens: int
    hidden: int
    elem_size: int

    @property
    def chunk_rows(self) -> int:
        return ceil_div(self.max_tokens, self.world_size)

    @property
    def input_bytes(self) -> int:
        return _align(self.max_tokens * self.hidden * self.elem_size, CACHE_LINE)

    @property
    def result_row_bytes(self) -> int:
        return self.hidden * self.elem_size

    @property
    def result_bytes(self) -> int:
        return _align(self.chunk_rows * self.result_row_bytes, CACHE_LINE)

    @property
    def slot_bytes(self) -> int:
        return self.input_bytes + self.result_bytes

    def slot_offset(self, rank: int, buffer: int) -> int:
        return SHM_HEADER_BYTES + (rank * SHM_BUFFERS + buffer) * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return _align(SHM_HEADER_BYTES + self.world_size * SHM_BUFFERS * self.slot_bytes, PAGE)


def shm_layout(world_size: int, spec: Spec) -> ShmLayout:
    return ShmLayout(world_size, spec.max_tokens, spec.hidden, spec.elem_size)


# --- FlashInfer 0.6.13 ----------------------------------------------------------------------

def trtllm_bytes(world_size: int, spec: Spec) -> int:
    """About 4 * tp * S per rank, S = max_tokens * hidden * elem (DESIGN 4)."""
    return 4 * world_size * spec.max_tokens * spec.hidden * spec.elem_size


def mnnvl_buffer_bytes(world_size: int, spec: Spec) -> int:
    """One of the three rotating buffers (B in DESIGN 4)."""
    elem, hidden = spec.elem_size, spec.hidden
    oneshot_tokens = min(MIB // (world_size * elem * hidden), spec.max_tokens)
    oneshot = oneshot_tokens * world_size * hidden * elem
    twoshot = 2 * ceil_div(spec.max_tokens, world_size) * world_size * hidden * elem
    return max(oneshot, twoshot)


def mnnvl_capacity(world_size: int, spec: Spec, buffer_bytes: int) -> int:
    """Largest token count whose chosen mode fits one buffer (R1, vLLM #50877)."""
    elem, hidden = spec.elem_size, spec.hidden
    best = 0
    lo, hi = 0, spec.max_tokens
    while lo <= hi:  # the need grows with tokens, so bisect
        mid = (lo + hi) // 2
        if mid == 0 or mnnvl_need(world_size, mid, hidden, elem) <= buffer_bytes:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def mnnvl_use_oneshot(world_size: int, tokens: int, hidden: int, elem: int) -> bool:
    return tokens * world_size * hidden * elem <= MIB


def mnnvl_need(world_size: int, tokens: int, hidden: int, elem: int) -> int:
    if mnnvl_use_oneshot(world_size, tokens, hidden, elem):
        return tokens * world_size * hidden * elem
    return 2 * ceil_div(tokens, world_size) * world_size * hidden * elem


def predict(backend: str, world_size: int, spec: Spec) -> tuple[int, int]:
    """(workspace bytes per rank, fused capacity in tokens) of ``backend``."""
    if backend == "torch":
        return 0, 0
    if backend == "shm":
        layout = shm_layout(world_size, spec)
        return ceil_div(layout.total_bytes, world_size), spec.max_tokens
    if backend == "trtllm":
        return trtllm_bytes(world_size, spec), spec.max_tokens
    if backend == "mnnvl":
        buffer = mnnvl_buffer_bytes(world_size, spec)
        return 3 * buffer, mnnvl_capacity(world_size, spec, buffer)
    raise ValueError(f"backend={backend!r} is not valid; use mnnvl, trtllm, shm or torch")
