"""The epilogue in device-agnostic torch: the torch backend's production epilogue, and the
pure-torch path's and every unfused fallback's (a call over a fused workspace's capacity).

From the fp32 rank-order sum ``acc`` (FlashInfer's fusion semantics, see ``arfuse.quant``):

* ``sum = T(acc)`` (one rounding to the activation dtype ``T``);
* no weight: ``out = sum``;
* weight: ``residual_out = T(sum + residual)``; ``r = f32(residual_out)``;
  ``out = T(r * rsqrt(sum(r^2)/H + eps) * (weight_bias + weight))``;
* quantisation reads ``out`` after its rounding to ``T``.

The tests check it, like every other backend, against the float64 reference in
``tests/reference.py``.
"""

from __future__ import annotations

import torch

from ... import quant as q
from ...call_checks import CallArgs
from ...result import FusedOutput, deliver
from ...spec import QUANTS


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


def quantize(out: torch.Tensor, quant: str | None, scale: float | None,
             layout: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The quantisation step alone, for backends that do not fuse it."""
    if quant is None:
        return None, None
    if quant == "fp8_dynamic":
        return q.fp8_dynamic_quantize(out)
    if quant not in ("fp8", "nvfp4"):
        raise ValueError(f"quant={quant!r} is not valid; use one of None, {', '.join(QUANTS)}")
    assert scale is not None
    if quant == "fp8":
        return q.fp8_quantize(out, scale), None
    return q.nvfp4_quantize(out, scale, layout)
