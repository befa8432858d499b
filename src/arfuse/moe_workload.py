"""A MoE layer's outputs as the jobs that exercise the MoE patterns make them (``arfuse run``,
``arfuse bench``, the scenarios), their float64 expert step, and the fastest finalize torch
offers: what an engine runs before an unfused all-reduce.

Finalize inputs are laid out as a grouped GEMM leaves them: each token picks ``top_k``
distinct experts of ``experts``, and the expanded rows are sorted by expert (then token), so
``index[t, k]`` points into that order. Reduction inputs are expert-major, ``[top_k, T, H]``.
The sizes and their checks need no torch (the verbs check flags before importing it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .pattern import REDUCTIONS

if TYPE_CHECKING:
    import torch

MOE_PATTERNS = tuple(name for name in REDUCTIONS if name.startswith("moe_"))


@dataclass(frozen=True)
class ExpertRows:
    """One rank's inputs of a MoE call: for ``moe_finalize`` ``rows`` [P, H], ``index`` int32
    [T, top_k], ``scales`` [T, top_k], ``add`` the shared expert [T, H] or None; for
    ``moe_reduce`` ``rows`` [top_k, T, H], ``scales`` [top_k, T], ``add`` the token input."""

    pattern: str
    rows: torch.Tensor
    scales: torch.Tensor
    index: torch.Tensor | None
    add: torch.Tensor | None
    routed: float = 1.0

    @property
    def tokens(self) -> int:
        return int(self.scales.shape[0] if self.index is not None else self.scales.shape[1])

    def call(self, comm: Any, **keywords: Any) -> Any:
        """The MoE call of ``comm`` (a ``FusedAllReduce``) on these inputs; ``keywords``: the
        all-reduce pattern's (residual, weight, eps, quant, ...)."""
        if self.index is not None:
            return comm.moe_finalize(
                self.rows, self.index, self.scales, shared_expert_output=self.add,
                routed_scaling_factor=self.routed, **keywords)
        return comm.moe_reduce(self.rows, self.scales, self.add, **keywords)


def check_moe_sizes(pattern: str, top_k: int, experts: int) -> None:
    """The flags of a MoE job: ``ValueError`` naming the one that is off."""
    if pattern not in MOE_PATTERNS:
        raise ValueError(f"pattern={pattern!r} is not a MoE pattern; use one of "
                         f"{', '.join(MOE_PATTERNS)}")
    from .signature import MAX_MOE_FAN_IN

    if not 1 <= top_k <= MAX_MOE_FAN_IN:
        raise ValueError(f"--top-k {top_k} is not valid; use 1..{MAX_MOE_FAN_IN}")
    if pattern == "moe_finalize" and experts < top_k:
        raise ValueError(f"--experts {experts} is fewer than --top-k {top_k}; each token picks "
                         "top_k distinct experts")


def expert_rows_bytes(pattern: str, tokens: int, hidden: int, top_k: int, experts: int,
                      itemsize: int) -> dict[str, int]:
    """A lower bound of what ``make_expert_rows`` allocates at once, by what sizes it: the
    expert rows (drawn in float32, kept in the dtype) and, for a finalize, each token's draw
    of ``top_k`` of its ``experts`` (a float32 score and an int64 order per expert)."""
    parts = {"rows": top_k * tokens * hidden * (4 + itemsize)}
    if pattern == "moe_finalize":
        parts["picks"] = tokens * experts * (4 + 8)
    return parts


def make_expert_rows(pattern: str, tokens: int, hidden: int, top_k: int, experts: int,
                     dtype: torch.dtype, gen: torch.Generator, *, none_every: int = 0,
                     shared: bool = True, routed: float = 1.0) -> ExpertRows:
    """One rank's random inputs of a ``pattern`` call. ``none_every``: every that many (t, k)
    entries of a finalize index is -1 (an expert not on this rank; 0: none); ``shared``: with a
    shared expert's rows."""
    import torch

    if pattern == "moe_reduce":
        rows = torch.randn(top_k, tokens, hidden, generator=gen).to(dtype)
        scales = torch.rand(top_k, tokens, generator=gen)
        add = torch.randn(tokens, hidden, generator=gen).to(dtype)
        return ExpertRows(pattern, rows, scales, None, add)
    check_moe_sizes(pattern, top_k, experts)
    picks = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].flatten()
    entry = torch.arange(tokens * top_k)
    # the expanded rows in expert order (ties: token order): where each (t, k) entry landed
    order = torch.argsort(picks * (tokens * top_k) + entry)
    index = torch.empty(tokens * top_k, dtype=torch.int32)
    index[order] = torch.arange(tokens * top_k, dtype=torch.int32)
    if none_every:
        index[none_every - 1::none_every] = -1
    rows = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
    scales = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    shared_rows = torch.randn(tokens, hidden, generator=gen).to(dtype) if shared else None
    return ExpertRows(pattern, rows, scales, index.view(tokens, top_k), shared_rows, routed)


def expert_step_float64(inputs: ExpertRows) -> torch.Tensor:
    """The expert step with no rounding: each rank's ``x`` for the float64 reference."""
    import torch

    scales = inputs.scales.double()
    if inputs.index is None:
        total = (scales.unsqueeze(-1) * inputs.rows.double()).sum(dim=0)
    else:
        index = inputs.index.long()
        keep = (index >= 0).double() * scales
        gathered = inputs.rows.double()[index.clamp(min=0)] if inputs.rows.shape[0] else \
            torch.zeros(*index.shape, inputs.rows.shape[1], dtype=torch.float64)
        total = (keep.unsqueeze(-1) * gathered).sum(dim=1) * inputs.routed
    return total + inputs.add.double() if inputs.add is not None else total


def torch_expert_step(inputs: ExpertRows, has_none: bool = True) -> torch.Tensor:
    """The fastest expert step torch offers, in the activation dtype: a gather and a ``bmm``
    (finalize), a ``bmm`` over the experts (reduction). ``has_none=False``: the index has no
    -1 entry (every token has all top_k experts here, as in tensor parallelism), so the scales
    need no mask."""
    import torch

    dtype = inputs.rows.dtype
    if inputs.index is None:
        assert inputs.add is not None  # a reduction's token input
        _, tokens, hidden = inputs.rows.shape
        weights = inputs.scales.to(dtype).t().unsqueeze(1)                      # [T, 1, k]
        summed = torch.bmm(weights, inputs.rows.transpose(0, 1)).view(tokens, hidden)
        return summed.add_(inputs.add)
    tokens, top_k = inputs.index.shape
    scales = inputs.scales
    index = inputs.index
    if has_none:
        scales = scales * (index >= 0)
        index = index.clamp(min=0)
    gathered = inputs.rows.index_select(0, index.view(-1)).view(tokens, top_k, -1)
    summed = torch.bmm(scales.to(dtype).unsqueeze(1), gathered).view(tokens, -1)
    if inputs.routed != 1.0:
        summed.mul_(inputs.routed)
    return summed.add_(inputs.add) if inputs.add is not None else summed
