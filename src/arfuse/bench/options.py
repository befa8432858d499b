"""What one ``arfuse bench`` run measures, and the defaults of its options."""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import DTYPES
from ..moe_workload import expert_rows_bytes

EPS = 1e-6
BASELINE = "torch"  # the row every other is compared with: the user's two lines
BENCH_TOKENS = tuple(2**i for i in range(13))
ROWS = ("shm", "torch", "deepspeed", "arfuse-torch", "shm-over")
"""What --backends may name. ``arfuse-torch`` and ``shm-over`` are arfuse's paths outside the
kernel, called in place: the torch backend, and a shm op's call over its capacity (an op of
capacity ``OVER_CAPACITY``, not timed at sizes it fuses)."""
OVER_CAPACITY = 1


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
    quant: str | None = None  # the quantised output every row makes (scale-free quants only)
    group_size: int | None = None  # fp8_group's (None: its default)
    scale_format: str | None = None  # the quant's scale layout (None: its default)

    def quant_keywords(self) -> dict[str, object]:
        """What the fused rows add to each call (``quant``, ``layout``, ``group_size``)."""
        if self.quant is None:
            return {}
        kwargs: dict[str, object] = {"quant": self.quant, "layout": self.scale_format}
        if self.group_size is not None:
            kwargs["group_size"] = self.group_size
        return kwargs


BENCH_TOKENS_MOE = tuple(2**i for i in range(10))  # a MoE layer's decode and small prefills


def memory_needs(tokens: int, hidden: int, dtypes: tuple[str, ...], pattern: str = \
                 "residual_rmsnorm", top_k: int = 0, experts: int = 0) -> dict[str, int]:
    """Lower bounds of what one rank allocates at once, keyed by the flags that size each: the
    largest size's input and residual, of the widest dtype, and for a MoE pattern its expert
    rows and shared expert (``moe_workload.expert_rows_bytes``)."""
    itemsize = max(DTYPES[d].size for d in dtypes)
    sizes = f"--tokens {tokens} --hidden {hidden}"
    needs = {f"{sizes}, the inputs and residuals": 2 * tokens * hidden * itemsize}
    if pattern != "residual_rmsnorm":
        moe = expert_rows_bytes(pattern, tokens, hidden, top_k, experts, itemsize)
        needs[f"--top-k {top_k} {sizes}, the expert rows"] = \
            moe["rows"] + tokens * hidden * itemsize
        if "picks" in moe:
            needs[f"--experts {experts} --tokens {tokens}, each token's pick of its experts"] = \
                moe["picks"]
    return needs
