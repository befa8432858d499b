"""What both of ``arfuse run``'s jobs share (the all-reduce layer's, ``cli/run.py``, and the MoE
one's, ``cli/run_moe.py``): the options, a size's result, the checks of the outputs against
the reference and arfuse's own quantisation, and the side-by-side timing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..pattern import quant_output

EPS = 1e-6
# max |out - reference| / max |reference| allowed, per dtype: a few roundings of the dtype
TOLERANCE = {"bf16": 8 * 2.0**-8, "fp16": 8 * 2.0**-11, "fp32": 1e-4}


@dataclass(frozen=True)
class RunOptions:
    world_size: int
    tokens: tuple[int, ...]
    hidden: int
    dtype: str
    quant: str | None
    steps: int
    backend: str | None
    device: str
    strict: bool | None = None
    pattern: str = "residual_rmsnorm"  # or a MoE pattern (``moe_workload.MOE_PATTERNS``)
    top_k: int = 8
    experts: int = 64
    group_size: int | None = None  # fp8_group's (None: its default)
    scale_format: str | None = None  # the quant's scale layout (None: its default)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).to(x.dtype)


@dataclass(frozen=True)
class SizeResult:
    tokens: int
    out_err: float
    res_err: float
    identical: bool
    quant_ok: bool
    fused_us: float
    unfused_us: float
    ok: bool


def quant_matches(result: Any, quant: str | None, scale: float | None,
                  group_size: int | None = None, layout: str | None = None) -> bool:
    """The quantised outputs equal arfuse's own quantisation of the output it returned, by the
    row's rule (``arfuse.quant.quantize``): the codes but for rare one-ulp ties, fp32 scales
    within the rounding of their two fp32 operations (a fast-math kernel's), scale bytes but
    for rare ties."""
    from arfuse import quant as q

    output = quant_output(quant, layout)
    codes, scales = q.quantize(result.out.cpu(), output, scale, group_size or 0)
    if codes is not None and not _mostly_equal(result.quant_out, codes):
        return False
    if scales is None:
        return True
    if result.scale_out is None or tuple(result.scale_out.shape) != tuple(scales.shape):
        return False
    got = result.scale_out.cpu().contiguous()
    if got.dtype == torch.float32:
        want = scales.contiguous()
        return bool(((got.double() - want.double()).abs() <= want.double().abs() * 2.0**-22)
                    .all())
    return _mostly_equal(got, scales.contiguous())


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double().cpu() - want).abs().max() / want.abs().max()).item())


def _mostly_equal(got: torch.Tensor | None, expected: torch.Tensor) -> bool:
    """Quantised codes equal but for rare one-ulp ties (at most 0.1% of them)."""
    if got is None:
        return False
    a = got.cpu().view(torch.uint8)
    b = expected.view(torch.uint8)
    return a.shape == b.shape and (a != b).float().mean().item() <= 1e-3


def rounds_of(steps: int) -> tuple[int, int]:
    """Rounds of consecutive timed steps (up to 5), and steps per round: ``steps`` in all
    where 5 divides it or it is under 5, else the largest multiple of the rounds below it."""
    rounds = min(5, steps)
    return rounds, steps // rounds


def time_pair(fused: Callable[[], None], unfused: Callable[[], None], steps: int,
              cuda: bool) -> tuple[float, float]:
    """Median microseconds of two paths, in alternating rounds of consecutive steps
    (alternating every step would time the fused op waiting for a peer still leaving its
    previous gloo call)."""

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
    for _ in range(3):
        fused()
        unfused()
    sync()
    fused_t: list[int] = []
    unfused_t: list[int] = []
    rounds, per_round = rounds_of(steps)
    for _ in range(rounds):
        for fn, times in ((fused, fused_t), (unfused, unfused_t)):
            fn()  # the first step of a round absorbs the ranks' skew; not timed
            sync()
            for _ in range(per_round):
                start = time.perf_counter_ns()
                fn()
                sync()
                times.append(time.perf_counter_ns() - start)
    return statistics.median(fused_t) / 1e3, statistics.median(unfused_t) / 1e3
