"""One call of a scenario: its inputs, the call form (``plain`` ... ``slot``) and the check of
its result against the float64 reference, within the dtype's and the format's bounds."""

from __future__ import annotations

from typing import Any

from ..pattern import Pattern
from ..reference import expected

PATTERNS = ("plain", "norm", "norm_residual", "fp8", "nvfp4", "in_place", "slot")
MOE_CALLS = ("moe_finalize", "moe_reduce")  # x is then the rank's ExpertRows
MOE_EXPERTS = 16                   # a finalize token picks top_k of these
FP8_SCALE = 0.0625                 # dequantisation scale: |out| up to ~28 fits e4m3
NVFP4_SCALE = 448.0 * 6.0 / 8.0    # global encode scale for |out| up to ~8
EPS = 1e-5
ULP = {"bf16": 2.0**-7, "fp16": 2.0**-10, "fp32": 2.0**-21}  # fp32: rsqrt may be off by ulps
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# --- inputs, the float64 reference and the tolerance -------------------------------------------


def make_inputs(seed: int, tokens: int, hidden: int, dtype: str,
                ranks: list[int]) -> tuple[list[Any], Any, Any]:
    """Every rank's ``x`` (keyed by global rank) plus a residual and weight shared by all, the
    same in every process: each rank can compute the reference of the whole group itself."""
    import torch

    from ..torch_types import TORCH_DTYPES

    tdt = TORCH_DTYPES[dtype]
    xs = []
    for r in ranks:
        gen = torch.Generator().manual_seed((seed * 1_000_003 + r * 7919 + tokens) % 2**62)
        xs.append((torch.randn(tokens, hidden, generator=gen) * (0.5 + 0.25 * r)).to(tdt))
    gen = torch.Generator().manual_seed((seed * 1_000_003 + 999_983) % 2**62)
    residual = torch.randn(tokens, hidden, generator=gen).to(tdt)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(tdt)
    return xs, residual, weight


def make_moe_inputs(seed: int, pattern: str, tokens: int, hidden: int, dtype: str,
                    ranks: list[int], top_k: dict[int, int],
                    bad_index: set[int]) -> tuple[list[Any], list[Any]]:
    """Every rank's MoE inputs (``moe_workload.ExpertRows``, keyed like ``make_inputs``) and
    their expert step by the torch reference (``moe.local_rows``): what each rank's ``x`` is.
    A rank in ``bad_index`` points its first index entry one past its rows (a reference of
    None: that call must fail)."""
    import torch

    from ..moe import ExpertStep, local_rows
    from ..moe_workload import make_expert_rows
    from ..torch_types import TORCH_DTYPES

    tdt = TORCH_DTYPES[dtype]
    inputs: list[Any] = []
    xs: list[Any] = []
    for r in ranks:
        gen = torch.Generator().manual_seed((seed * 1_000_003 + r * 7919 + tokens) % 2**62)
        rows = make_expert_rows(pattern, tokens, hidden, top_k[r], MOE_EXPERTS, tdt, gen,
                                none_every=5)
        if r in bad_index and rows.index is not None:
            rows.index[0, 0] = rows.rows.shape[0]
        inputs.append(rows)
        step = ExpertStep(pattern, rows.rows, rows.scales, rows.index, rows.add, rows.routed)
        try:
            xs.append(local_rows(step, torch.empty(tokens, hidden, dtype=tdt)))
        except ValueError:
            xs.append(None)
    return inputs, xs


def run_pattern(comm: Any, pattern: str, x: Any, residual: Any, weight: Any) -> Any:
    """One call of ``pattern``; inputs that the pattern overwrites are copies. A MoE pattern's
    ``x`` is the rank's ``ExpertRows``."""
    if pattern in MOE_CALLS:
        return x.call(comm, residual=residual, weight=weight, eps=EPS)
    if pattern == "plain":
        return comm(x)
    if pattern == "norm":
        return comm(x, weight=weight, eps=EPS)
    if pattern == "norm_residual":
        return comm(x, residual=residual, weight=weight, eps=EPS)
    if pattern == "fp8":
        return comm(x, residual=residual, weight=weight, eps=EPS, quant="fp8", scale=FP8_SCALE)
    if pattern == "nvfp4":
        return comm(x, residual=residual, weight=weight, eps=EPS, quant="nvfp4",
                    scale=NVFP4_SCALE, layout="linear")
    if pattern == "in_place":
        xi, ri = x.clone(), residual.clone()
        return comm(xi, residual=ri, weight=weight, eps=EPS, out=xi, residual_out=ri)
    if pattern == "slot":
        buf = comm.input_buffer(int(x.shape[0]))
        buf.copy_(x)
        return comm(buf, residual=residual, weight=weight, eps=EPS)
    raise ValueError(f"pattern={pattern!r} is not valid; use one of "
                     f"{', '.join((*PATTERNS, *MOE_CALLS))}")


# what each call form computes (``run_pattern``)
FUSED_PATTERN = {"plain": Pattern(), "norm": Pattern("rmsnorm"),
                 "norm_residual": Pattern("residual_rmsnorm"),
                 "fp8": Pattern("residual_rmsnorm", "fp8"),
                 "nvfp4": Pattern("residual_rmsnorm", "nvfp4", "linear"),
                 "in_place": Pattern("residual_rmsnorm"), "slot": Pattern("residual_rmsnorm"),
                 # checked from each rank's expert step on: ``x`` is its output
                 "moe_finalize": Pattern("residual_rmsnorm"),
                 "moe_reduce": Pattern("residual_rmsnorm")}


def check_result(pattern: str, dtype: str, xs: list[Any], residual: Any, weight: Any,
                 result: Any) -> float:
    """Worst error over its bound against the float64 reference (<= 1 passes). Bounds: the
    dtype's roundings (sum, add, norm) and, for quantised outputs, the format's own step."""

    eps = ULP[dtype] * max(1, len(xs) - 1)
    want = expected(xs, FUSED_PATTERN[pattern], residual, weight, EPS)
    total, abs_sum, out = want.sum, want.abs_sum, result.out.double()
    if pattern == "plain" or FUSED_PATTERN[pattern].epilogue == "none":
        return float(((out - total).abs() / (eps * abs_sum + 1e-30)).max().item())
    ref, pre = want.out, want.residual_out
    assert pre is not None
    scale = ref.abs().max().item() + 1e-30
    ratios = [((out - ref).abs() / (3 * eps * scale + 3 * eps * ref.abs())).max().item()]
    res = result.residual_out.double()
    ratios.append(((res - pre).abs() / (eps * (abs_sum + pre.abs()) + 1e-30)).max().item())
    if pattern == "fp8":
        ratios.append(_fp8_ratio(result, ref, eps, scale))
    elif pattern == "nvfp4":
        ratios.append(_nvfp4_ratio(result, ref, eps))
    return float(max(ratios))


def _fp8_ratio(result: Any, ref: Any, eps: float, scale: float) -> float:
    import torch

    deq = result.quant_out.view(torch.float8_e4m3fn).double() * FP8_SCALE
    bound = (2.0**-4 + 4 * eps) * ref.abs() + FP8_SCALE * 2.0**-9 + 3 * eps * scale
    return float(((deq - ref).abs() / bound).max().item())


def _nvfp4_ratio(result: Any, ref: Any, eps: float) -> float:
    import torch

    packed = result.quant_out
    tokens, hidden = ref.shape
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(tokens, hidden).long()
    table = torch.tensor(E2M1, dtype=torch.float64)
    values = table[codes & 7] * torch.where((codes & 8) > 0, -1.0, 1.0)
    sf = result.scale_out.view(torch.float8_e4m3fn).double()  # linear [T, H/16]
    deq = (values.view(tokens, hidden // 16, 16) * sf[..., None] / NVFP4_SCALE)
    blocks = ref.view(tokens, hidden // 16, 16)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    bound = amax * (1 / 6 + 2.0**-4 + 4 * eps) + 1e-30
    return float(((deq - blocks).abs() / bound).max().item())
