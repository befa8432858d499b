"""The reference epilogue, in device-agnostic torch: what every backend must compute.

From the fp32 rank-order sum ``acc`` (FlashInfer's fusion semantics, see ``quant``):

* ``sum = T(acc)`` (one rounding to the activation dtype ``T``);
* no weight: ``out = sum``;
* weight: ``residual_out = T(sum + residual)``; ``r = f32(residual_out)``;
  ``out = T(r * rsqrt(sum(r^2)/H + eps) * (weight_bias + weight))``;
* quantisation reads ``out`` after its rounding to ``T``.

The torch backend uses it as its epilogue and the tests use it as the reference for every
other backend.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import quant as q
from .call_checks import CallArgs


class FusedOutput(NamedTuple):
    """``out`` always; ``residual_out`` with a weight; ``quant_out``/``scale_out`` with quant."""

    out: torch.Tensor
    residual_out: torch.Tensor | None = None
    quant_out: torch.Tensor | None = None
    scale_out: torch.Tensor | None = None


def rank_order_sum(parts: torch.Tensor) -> torch.Tensor:
    """``[world, T, H]`` -> fp32 ``[T, H]``, adding rank 0, then 1, ... (bit-identical anywhere)."""
    acc = parts[0].float()
    if parts.shape[0] > 1 and acc.data_ptr() == parts[0].data_ptr():
        acc = acc.clone()
    for r in range(1, parts.shape[0]):
        acc.add_(parts[r])
    return acc


def apply(acc: torch.Tensor, call: CallArgs) -> FusedOutput:
    """The epilogue on an fp32 sum (see the module docstring for the exact rules), delivered
    into ``call.out``/``call.residual_out`` when given."""
    x = call.x
    summed = acc.to(x.dtype)
    if call.weight is None:
        out, residual_out = summed, None
    else:
        pre = summed.float()
        if call.residual is not None:
            pre = pre + call.residual.float()
        residual_out = pre.to(x.dtype)
        r = residual_out.float()
        inv = torch.rsqrt((r * r).sum(dim=-1, keepdim=True) / r.shape[-1] + call.eps)
        out = ((r * inv) * (call.weight.float() + call.weight_bias)).to(x.dtype)
    quant_out, scale_out = quantize(out, call.quant, call.scale, call.layout)
    return deliver(FusedOutput(out, residual_out, quant_out, scale_out), call)


def deliver(result: FusedOutput, call: CallArgs) -> FusedOutput:
    """Copy a computed result into caller-given destinations (``out=``/``residual_out=``).

    Runs after the whole result exists, so a destination may be the input it replaces."""
    if call.out is not None:
        call.out.copy_(result.out)
        result = result._replace(out=call.out)
    if call.residual_out is not None and result.residual_out is not None:
        call.residual_out.copy_(result.residual_out)
        result = result._replace(residual_out=call.residual_out)
    return result


def quantize(out: torch.Tensor, quant: str | None, scale: float | None,
             layout: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The quantisation step alone, for backends that do not fuse it."""
    if quant is None:
        return None, None
    if quant == "fp8_dynamic":
        return q.fp8_dynamic_quantize(out)
    assert scale is not None
    if quant == "fp8":
        return q.fp8_quantize(out, scale), None
    return q.nvfp4_quantize(out, scale, layout)
