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
* quantisation reads ``out`` after its rounding to ``T`` (``arfuse.quant``: the row's rule).

Every step is one correctly rounded fp32 operation per element (add, multiply, divide, square
root; no fused multiply-add, no reduction whose order torch leaves open), and every rounding to
``T`` is the kernel's, a NaN's sign and payload included (``torch_types.round_to``). Where two
NaNs of different payloads meet in one addition, which one survives is torch's choice, not
always the kernel's; docs/design.md 3.6 lists that and the other exceptions. The tests check it
against the kernel bit for bit and against the float64 reference in ``tests/reference.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from . import ctables
from . import quant as q
from .call_checks import CallArgs
from .result import FusedOutput, deliver
from .torch_types import nans_differ, round_to

SUM_LANES = ctables.int_constant("numerics.h", "kSumLanes")
"""The lanes of the sum of squares (the kernel's ``kSumLanes``)."""


def rank_order_sum(parts: Sequence[torch.Tensor] | torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's rows (or every host's), in order -> fp32: rank 0, then 1, ... added one at
    a time (bit-identical anywhere; never the callers' memory): a new tensor, or ``out`` (fp32,
    shaped as a part; memory of its own, a kept buffer spares a large call its page faults)."""
    acc = parts[0].to(torch.float32, copy=True) if out is None else out.copy_(parts[0])
    for part in parts[1:]:
        acc.add_(part)
    return acc


def sum_of_squares(r: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, H]`` -> ``[T, 1]``: the squares added up as the kernel does (module docstring),
    each lane in order of h one addition at a time, then the 5 halvings.

    On the CPU the lanes are one ``index_add_`` of every step of squares (laid out
    ``[steps, T, 32]`` so that a step is one contiguous block) into the first step, a fixed
    dozen torch calls whatever H rather than one per step: torch adds the indexed slices one
    after another in index order, each as one elementwise fp32 addition (ATen's
    ``index_add_cpu_``, at present by way of ``scatter_add_``), which is the kernel's
    ``((+0 + s_0) + s_1) + ...`` (+0 + s_0 is s_0: a square is >= +0 or a quiet NaN). That
    order is torch's implementation, not its contract, so tests/test_epilogue_lanes.py pins it
    against the plain loop over many shapes, values and thread counts: a torch that adds
    otherwise fails there. Elsewhere (a GPU's ``index_add_`` adds atomically, in no fixed
    order) it is the plain loop, one elementwise add per step. Zero squares appended to fill
    the last step change no lane."""
    tokens, hidden = r.shape
    steps = -(-hidden // SUM_LANES)
    whole = hidden // SUM_LANES
    squares = torch.empty(steps, tokens, SUM_LANES, dtype=torch.float32, device=r.device)
    if whole:
        part = r[:, :whole * SUM_LANES].view(tokens, whole, SUM_LANES)
        torch.mul(part, part, out=squares[:whole].transpose(0, 1))
    if whole < steps:
        part = r[:, whole * SUM_LANES:]
        torch.mul(part, part, out=squares[whole, :, :part.shape[1]])
        squares[whole, :, part.shape[1]:].zero_()
    lanes = squares[0]
    if r.device.type == "cpu":
        lanes.unsqueeze(0).index_add_(0, step_index(steps - 1, r.device), squares[1:])
    else:
        for step in range(1, steps):
            lanes.add_(squares[step])
    half = SUM_LANES // 2
    while half >= 1:  # lane i + lane i + half: a sum of 2 rows is that one addition
        lanes = lanes.view(tokens, 2, half).sum(1)
        half //= 2
    return lanes


@functools.lru_cache(maxsize=64)
def step_index(steps: int, device: torch.device) -> torch.Tensor:
    """``steps`` zeros: ``index_add_``'s index that adds every step into the one row of lanes
    (cached, read only)."""
    return torch.zeros(steps, dtype=torch.long, device=device)


def rms_factor(r: torch.Tensor, eps: float) -> torch.Tensor:
    """``inv = 1 / sqrt(ss / H + eps)`` per row, ``[T, 1]``, as the kernel's ``row_inv``: H and
    eps rounded to fp32 first, then an fp32 division by the correctly rounded fp32 square root.

    torch's fp32 ``sqrt`` on CPU is not always correctly rounded (it differs from ``sqrtss`` by
    an ulp for about 1 value in 170), so the root is taken in fp64 and rounded to fp32: the
    exact root of an fp32 value lies at least 4 fp64 ulps from any fp32 rounding boundary,
    so any fp64 root within that rounds to the correctly rounded fp32 one."""
    mean = sum_of_squares(r).div_(r.shape[-1]).add_(eps)  # Python scalars: rounded to fp32
    return mean.double().sqrt_().float().reciprocal_()  # reciprocal: the fp32 division 1 / x


def apply(acc: torch.Tensor, call: CallArgs) -> FusedOutput:
    """The epilogue on an fp32 sum (see the module docstring for the exact rules), delivered
    into ``call.out``/``call.residual_out`` when given."""
    out, residual_out = rows(acc, call, nans=False)
    if nans_differ(out):  # a NaN in sum or residual_out makes its row of out all NaN
        out, residual_out = rows(acc, call, nans=True)
    quant_out, scale_out = q.quantize(out, call.output, call.scale, call.group_size)
    return deliver(FusedOutput(out, residual_out, quant_out, scale_out), call)


def rows(acc: torch.Tensor, call: CallArgs,
         nans: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out`` and ``residual_out`` (None without a weight), each rounding to ``T`` with
    ``torch_types.round_to(..., nans=nans)``."""
    dtype = call.x.dtype
    summed = round_to(acc, dtype, nans)
    if call.weight is None:
        return summed, None
    if call.residual is None:
        residual_out = summed
    elif nans:
        residual_out = round_to(torch.add(summed.float(), call.residual), dtype, nans)
    else:  # torch adds two 16-bit tensors in fp32 and rounds once: the same value
        residual_out = summed + call.residual
    r = residual_out.float()
    gain = call.weight.float() + call.weight_bias
    normed = r * rms_factor(r, call.eps)
    if nans:
        return round_to(normed.mul_(gain), dtype, nans), residual_out
    # the product rounded to T as it is stored: torch's rounding, as round_to's without nans
    return torch.mul(normed, gain, out=torch.empty_like(residual_out)), residual_out
