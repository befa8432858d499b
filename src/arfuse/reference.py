"""The op in float64, no intermediate rounding: what every backend's result is checked
against (the tests, ``arfuse run``, the scenarios, the GPU check). Quantised patterns give
``out`` before its quantisation; ``quantised`` gives any row's values and scales in float64
from its rule, and each caller bounds the quantised codes its own way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .pattern import DEFAULT_GROUP_SIZE, E2M1_MAX, E4M3_MAX, Pattern, QuantOutput, quant_output


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


def quantised(out: Any, output: QuantOutput, scale: float | None = None,
              group_size: int = 0) -> tuple[Any, Any | None]:
    """The quantised output of ``output``'s row in float64 from its rule (quant_outputs.h),
    no step rounded, on ``out`` as given (the output rounded to the activation dtype): the
    values the codes round (``out`` over its scale, before the e4m3 or e2m1 rounding and
    saturation) ``[T, H]``, and the scales ``[T, spans]`` before any rounding of theirs (None
    for a rule without). Per span, ``amax`` is the largest magnitude ignoring NaN; the scale
    is ``max(amax / 448, floor)`` (``amax_over_max``), ``max(amax, floor) / 448``
    (``floor_over_max``), ``2^ceil(log2(max(amax / 448, floor)))`` (``power_of_two``),
    ``scale * amax / 6`` (``encode_block``, its values ``out * scale / that``). Each kernel
    rounds the scale's operations to fp32: a caller bounds the difference."""
    import torch

    values = out.double()
    if output.rule == "static":
        assert scale is not None
        return values / scale, None
    tokens, hidden = values.shape
    span = output.span(hidden, group_size or DEFAULT_GROUP_SIZE)
    spans = values.reshape(tokens, hidden // span, span)
    magnitude = spans.abs()
    amax = torch.where(torch.isnan(magnitude), torch.zeros_like(magnitude),
                       magnitude).amax(dim=-1)
    if output.rule == "amax_over_max":
        scales = torch.clamp_min(amax / E4M3_MAX, output.floor)
    elif output.rule == "floor_over_max":
        scales = torch.clamp_min(amax, output.floor) / E4M3_MAX
    elif output.rule == "power_of_two":
        scales = torch.exp2(torch.ceil(torch.log2(torch.clamp_min(amax / E4M3_MAX,
                                                                  output.floor))))
    elif output.rule == "encode_block":
        assert scale is not None
        scales = scale * amax / E2M1_MAX
        return (spans * (scale / scales).unsqueeze(-1)).reshape(tokens, hidden), scales
    else:
        raise ValueError(f"rule {output.rule!r} quantises nothing")
    return (spans / scales.unsqueeze(-1)).reshape(tokens, hidden), scales


def fp8_group(out: Any, group_size: int, layout: str) -> tuple[Any, Any]:
    """fp8_group's ``quantised`` (``layout``: its row), the scales unpacked."""
    values, scales = quantised(out, quant_output("fp8_group", layout), None, group_size)
    assert scales is not None
    return values, scales
