"""The op in float64, no intermediate rounding: what every backend's result is checked
against (the tests, ``arfuse run``, the scenarios, the GPU check). Quantised patterns give
``out`` before its quantisation; each caller bounds the quantised codes its own way
(``fp8_group`` has its float64 scales and values here: ``fp8_group``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .pattern import Pattern


@dataclass(frozen=True)
class Expected:
    """float64 results of one call: the sum over ranks (and its sum of magnitudes, which
    bounds the rounding of a sum), ``residual_out`` and ``out`` as the pattern defines them."""

    sum: Any
    abs_sum: Any
    out: Any
    residual_out: Any | None


def expected(xs: Sequence[Any], pattern: Pattern, residual: Any = None, weight: Any = None,
             eps: float = 1e-6, weight_bias: float = 0.0) -> Expected:
    """``xs``: every rank's ``x``; ``residual`` and ``weight`` as passed to the op."""
    import torch

    total = torch.zeros_like(xs[0], dtype=torch.float64)
    abs_sum = torch.zeros_like(total)
    for x in xs:
        total = total + x.double()
        abs_sum = abs_sum + x.double().abs()
    if not pattern.norm:
        return Expected(total, abs_sum, total, None)
    if weight is None:
        raise ValueError(f"pattern {pattern.name} needs weight")
    pre = total + residual.double() if pattern.epilogue == "residual_rmsnorm" else total
    inv = torch.rsqrt((pre * pre).mean(dim=-1, keepdim=True) + eps)
    return Expected(total, abs_sum, pre * inv * (weight.double() + weight_bias), pre)


FP8_GROUP_EPS = 1e-10
FP8_MAX = 448.0


def fp8_group(out: Any, group_size: int, layout: str) -> tuple[Any, Any]:
    """fp8_group in float64 from its documented formula (docs/design.md 3.6), on ``out`` as
    given (the output rounded to the activation dtype): per token and group of
    ``group_size`` columns, ``amax`` = the largest magnitude ignoring NaN; the scale
    ``max(amax, 1e-10) / 448`` (``fp32``, ``fp32_column_major``) or
    ``2^ceil(log2(max(amax / 448, 1e-10)))`` (``ue8m0_packed``); returns ``(out / scale``
    as float64 ``[T, H]`` before its e4m3 rounding and saturation, the scales float64
    ``[T, H / group_size]``, unpacked).
    Each kernel rounds the scale's operations to fp32: a caller bounds the difference."""
    import torch

    values = out.double()
    tokens, hidden = values.shape
    grouped = values.reshape(tokens, hidden // group_size, group_size)
    magnitude = grouped.abs()
    amax = torch.where(torch.isnan(magnitude), torch.zeros_like(magnitude),
                       magnitude).amax(dim=-1)
    if layout == "ue8m0_packed":
        floor = torch.clamp_min(amax / FP8_MAX, FP8_GROUP_EPS)
        scale = torch.exp2(torch.ceil(torch.log2(floor)))
    else:
        scale = torch.clamp_min(amax, FP8_GROUP_EPS) / FP8_MAX
    return (grouped / scale.unsqueeze(-1)).reshape(tokens, hidden), scale
