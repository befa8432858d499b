"""The op in float64, no intermediate rounding: what every backend's result is checked
against (the tests, ``arfuse run``, the scenarios, the GPU check). Quantised patterns give
``out`` before its quantisation; each caller bounds the quantised codes its own way.
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
