"""What a fused call returns, and its delivery into caller-given destinations (every backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .call_checks import CallArgs


class FusedOutput(NamedTuple):
    """``out`` always; ``residual_out`` with a weight; ``quant_out``/``scale_out`` with quant."""

    out: torch.Tensor
    residual_out: torch.Tensor | None = None
    quant_out: torch.Tensor | None = None
    scale_out: torch.Tensor | None = None


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
