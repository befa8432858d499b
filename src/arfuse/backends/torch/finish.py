"""Every rank's rows, added in fp32 in rank order, then the epilogue: the one step every path
outside the shm segment ends with (the torch backend's calls, a fused backend's calls over its
capacity, hier with one rank per host).

On a CPU where this process has the shm kernel it runs there (``finish_parts``: the kernel's
own sum and epilogue on this process's memory, no segment); elsewhere (a GPU, no compiler, more
ranks than the kernel's rows take) in eager torch (``epilogue.apply``). Both give the kernel's
bytes, so which one ran does not show in the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...call_checks import CallArgs
from ...epilogue import apply, rank_order_sum
from ...pattern import output_code
from ...result import FusedOutput
from ...torch_types import TORCH_NAMES
from ..shm import build as shm_build
from ..shm.layout import MAX_WORLD

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def finishes(parts: Sequence[torch.Tensor], call: CallArgs) -> bool:
    """Whether the kernel finishes these parts: CPU rows it takes, an output it makes."""
    first = parts[0]
    return (first.device.type == "cpu" and first.dtype in _KERNEL_DTYPES
            and 0 < len(parts) <= MAX_WORLD and first.shape[0] > 0
            and not call.pattern.output.problem(TORCH_NAMES[first.dtype], first.shape[1],
                                                call.group_size or None))


def finish(parts: Sequence[torch.Tensor], call: CallArgs) -> FusedOutput:
    """``parts``: every rank's ``[T, H]`` rows in rank order (the call's dtype, each
    contiguous; this rank's may be ``call.x`` itself, even with ``out=x``: the kernel reads
    each element before it writes it); the call's result, delivered into
    ``call.out``/``call.residual_out`` when given. The kernel is the one this process has
    loaded, never built here (the CPU backends' local checks load it before any group
    meets), so a call never waits for a compiler."""
    module = shm_build.loaded()
    if module is not None and finishes(parts, call):
        return FusedOutput(*module.finish_parts(
            list(parts), call.residual, call.weight, call.eps, call.weight_bias,
            output_code(call.quant, call.layout), call.scale or 0.0, call.out,
            call.residual_out, call.group_size))
    return apply(rank_order_sum(parts), call)
