"""What one ``arfuse bench`` run measures, and the defaults of its options."""

from __future__ import annotations

from dataclasses import dataclass

from ..torch_types import TORCH_DTYPES

EPS = 1e-6
BASELINE = "torch"  # the row every other is compared with
BENCH_TOKENS = tuple(2**i for i in range(13))
ROWS = ("shm", "torch", "deepspeed")  # what --backends may name


@dataclass(frozen=True)
class BenchOptions:
    world_size: int
    tokens: tuple[int, ...]
    hidden: int
    dtypes: tuple[str, ...]
    backends: tuple[str, ...]
    out: str
    min_seconds: float = 0.3
    max_iters: int = 400


def bytes_per_rank(tokens: int, hidden: int, dtypes: tuple[str, ...]) -> int:
    """A lower bound of what one rank allocates at once: the largest size's input and
    residual, of the widest dtype."""
    return 2 * tokens * hidden * max(TORCH_DTYPES[d].itemsize for d in dtypes)
