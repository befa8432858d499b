"""The epilogue in device-agnostic torch: the torch backend's production epilogue, and the
pure-torch path's and every unfused fallback's (a call over a fused workspace's capacity).

It gives the shm kernel's bytes (``backends/shm/csrc/epilogue.h``), so that a row's result does
not depend on which path, and so which batch, it went through. From the fp32 rank-order sum
``acc``:

* ``sum = T(acc)`` (one rounding to the activation dtype ``T``);
* no weight: ``out = sum``;
* weight: ``residual_out = T(f32(sum) + f32(residual))``; ``r = f32(residual_out)``;
  ``ss`` = the squares ``r * r`` added up in 32 lanes (lane = h % 32, each in order of h),
  the lanes combined by halving (lane i + lane i + 16 for i < 16, then i + 8, 4, 2, 1);
  ``inv = 1 / sqrt(ss / H + eps)``; ``out = T((r * inv) * (weight_bias + f32(w)))``;
* quantisation reads ``out`` after its rounding to ``T`` (``arfuse.quant``, the kernel's rules).

Every step is one correctly rounded fp32 operation per element (add, multiply, divide, square
root; no fused multiply-add, no reduction whose order torch leaves open), and every rounding to
``T`` is the kernel's, a NaN's sign and payload included (``torch_types.round_to``). Where two
NaNs of different payloads meet in one addition, which one survives is torch's choice, not
always the kernel's; docs/design.md 3.6 lists that and the other exceptions. The tests check it
against the kernel bit for bit and against the float64 reference in ``tests/reference.py``.
"""

from __future__ import annotations

import torch

from ... import quant as q
from ...call_checks import CallArgs
from ...result import FusedOutput, deliver
from ...spec import QUANTS
from ...torch_types import nans_differ, round_to

SUM_LANES = 32
"""The lanes of the sum of squares (the kernel's ``kSumLanes``, conversions.h)."""


def rank_order_sum(parts: torch.Tensor) -> torch.Tensor:
    """``[world, T, H]`` -> fp32 ``[T, H]``, adding rank 0, then 1, ... (bit-identical anywhere)."""
    acc = parts[0].float()
    if parts.shape[0] > 1 and acc.data_ptr() == parts[0].data_ptr():
        acc = acc.clone()
    for r in range(1, parts.shape[0]):
        acc.add_(parts[r])
    return acc


def sum_of_squares(r: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, H]`` -> ``[T, 1]``: the squares added up as the kernel does (module docstring):
    one elementwise add per step of 32 along the row, then 5 for the halving. A zero square
    appended to fill the last step changes no lane (a lane is >= +0 or a NaN)."""
    tokens, hidden = r.shape
    steps = -(-hidden // SUM_LANES)
    squares = r * r
    if hidden % SUM_LANES:
        squares = torch.nn.functional.pad(squares, (0, steps * SUM_LANES - hidden))
    squares = squares.view(tokens, steps, SUM_LANES)
    lanes = squares[:, 0].clone()  # +0 + s is s: the kernel's lanes start at +0
    for step in range(1, steps):
        lanes.add_(squares[:, step])
    width = SUM_LANES // 2
    while width >= 1:
        lanes = lanes[:, :width] + lanes[:, width:2 * width]
        width //= 2
    return lanes


def rms_factor(r: torch.Tensor, eps: float) -> torch.Tensor:
    """``inv = 1 / sqrt(ss / H + eps)`` per row, ``[T, 1]``, as the kernel's ``row_inv``: H and
    eps rounded to fp32 first, then an fp32 division by the correctly rounded fp32 square root.

    torch's fp32 ``sqrt`` on CPU is not always correctly rounded (it differs from ``sqrtss`` by
    an ulp for about 1 value in 170), so the root is taken in fp64 and rounded to fp32: the
    exact root of an fp32 value lies at least 4 fp64 ulps from any fp32 rounding boundary,
    so any fp64 root within that rounds to the correctly rounded fp32 one."""
    def f32(value: float) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.float32, device=r.device)

    mean = sum_of_squares(r) / f32(r.shape[-1]) + f32(eps)
    return f32(1.0) / torch.sqrt(mean.double()).float()


def apply(acc: torch.Tensor, call: CallArgs) -> FusedOutput:
    """The epilogue on an fp32 sum (see the module docstring for the exact rules), delivered
    into ``call.out``/``call.residual_out`` when given."""
    out, residual_out = rows(acc, call, nans=False)
    if nans_differ(out):  # a NaN in sum or residual_out makes its row of out all NaN
        out, residual_out = rows(acc, call, nans=True)
    quant_out, scale_out = quantize(out, call.quant, call.scale, call.layout)
    return deliver(FusedOutput(out, residual_out, quant_out, scale_out), call)


def rows(acc: torch.Tensor, call: CallArgs,
         nans: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out`` and ``residual_out`` (None without a weight), each rounding to ``T`` with
    ``torch_types.round_to(..., nans=nans)``."""
    dtype = call.x.dtype
    summed = round_to(acc, dtype, nans)
    if call.weight is None:
        return summed, None
    pre = summed.float()
    if call.residual is not None:
        pre = pre + call.residual.float()
    residual_out = round_to(pre, dtype, nans)
    r = residual_out.float()
    gain = torch.tensor(call.weight_bias, dtype=torch.float32,
                        device=r.device) + call.weight.float()
    return round_to((r * rms_factor(r, call.eps)) * gain, dtype, nans), residual_out


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
