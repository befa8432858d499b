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
    pattern: str = "residual_rmsnorm"  # or a MoE pattern: its expert step fused first
    top_k: int = 8
    experts: int = 64
    threads: int = 1  # intra-op threads per rank (torch.set_num_threads), each on its own core


BENCH_TOKENS_MOE = tuple(2**i for i in range(10))  # a MoE layer's decode and small prefills


def bytes_per_rank(tokens: int, hidden: int, dtypes: tuple[str, ...], fan_in: int = 0) -> int:
    """A lower bound of what one rank allocates at once: the largest size's input and
    residual, of the widest dtype, and with ``fan_in`` (a MoE bench's top_k) its expert rows
    and shared expert."""
    return (2 + fan_in + (1 if fan_in else 0)) * tokens * hidden * max(
        TORCH_DTYPES[d].itemsize for d in dtypes)
