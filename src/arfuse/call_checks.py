"""The checks of one call of the fused op, in one place (DESIGN 3.6).

``check_call`` turns the arguments of ``FusedAllReduce.__call__`` into a ``CallArgs`` or raises a
``ValueError``/``TypeError`` that names the argument. The shm kernel's fast path mirrors these
rules in C++ (it declines, returning ``None``, wherever this module would raise); a test table
runs the same bad calls through both paths.

Numbers: any real scalar (Python, NumPy, a one-element tensor) is a number; the kernels compute
in fp32, so ``eps``, ``weight_bias`` and ``scale`` must survive the conversion to fp32 (finite,
and ``eps``/``scale`` still > 0), and an FP8 scale's reciprocal must be finite too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from . import signature
from .arg_checks import OpShape, Span, check_plain, fp32_number, overlap, span
from .dtypes import DTYPES
from .moe import ExpertStep
from .pattern import (
    QUANT_OUTPUTS,
    Pattern,
    QuantOutput,
    check_group_size,
    quant_output,
)
from .spec import parse_quant


@dataclass(frozen=True, slots=True)
class CallArgs:
    """One checked call: what every backend's ``Workspace.run`` receives."""

    x: torch.Tensor
    residual: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    eps: float = 1e-6
    weight_bias: float = 0.0
    quant: str | None = None
    scale: float | None = None
    layout: str | None = None  # the row's layout (None: its quant has one row)
    out: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None
    op: int = 0  # the op making the call, numbered alike on every rank (its signature names it)
    group_size: int = 0  # fp8_group's group size (its signature names it); 0 for the others
    # A MoE call: its expert step, which the backend runs into x (the op's input buffer)
    # before the all-reduce; x then holds this rank's rows.
    moe: ExpertStep | None = None

    @property
    def tokens(self) -> int:
        return int(self.x.shape[0])

    @property
    def pattern(self) -> Pattern:
        return Pattern.of_call(self.weight is not None, self.residual is not None, self.quant,
                               self.layout,
                               "all_reduce" if self.moe is None else self.moe.reduction)

    @property
    def output(self) -> QuantOutput:
        """The row of the quantised output the call makes (``none`` when it makes none)."""
        return quant_output(self.quant, self.layout)

    @property
    def moe_word(self) -> int:
        """What a MoE call adds to its signature's word 0 (0 for the other calls)."""
        return 0 if self.moe is None else self.moe.signature_bits()

    def signature_words(self, dtype: str, twoshot: bool = False) -> tuple[int, int]:
        """This call's two signature words (``arfuse.signature``) on an op of ``dtype``: what
        ranks compare so that calls which differ fail together (R11)."""
        return signature.words(self.tokens, DTYPES[dtype].code, int(self.x.shape[1]),
                               self.pattern.code, twoshot=twoshot, op=self.op,
                               moe=self.moe_word, group_size=self.group_size)

    def without_quant(self) -> CallArgs:
        return replace(self, quant=None, scale=None)

    def without_moe(self) -> CallArgs:
        """The all-reduce call that follows the expert step, once x holds its rows."""
        return replace(self, moe=None)


def check_call(shape: OpShape, x: Any, residual: Any, weight: Any, eps: Any, weight_bias: Any,
               quant: Any, scale: Any, layout: Any, out: Any, residual_out: Any,
               shared: Span | None, slot_start: int | None, op: int = 0,
               group_size: Any = None) -> CallArgs:
    """Every rule of one call. ``shared``: the memory the peers read during a call (no argument
    may lie there, except ``x`` starting exactly at ``slot_start``, the next input slot);
    ``layout``: None is the quant's default; ``group_size``: fp8_group's (None: 128)."""
    _check_x(shape, x)
    eps_f, bias_f = 1e-6, 0.0
    if residual is not None:
        if weight is None:
            raise ValueError("residual needs weight: the residual pattern is all-reduce + "
                             "residual + RMSNorm")
        check_like(residual, x, "residual")
    if weight is not None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
        check_plain(weight, "weight")
        if tuple(weight.shape) != (shape.hidden,):
            raise ValueError(f"weight must have shape ({shape.hidden},), got "
                             f"{tuple(weight.shape)}")
        if weight.dtype != x.dtype:
            raise ValueError(f"weight has dtype {weight.dtype}; it must match x ({x.dtype})")
        if weight.device != x.device:
            raise ValueError(f"weight is on {weight.device}; x is on {x.device}")
        if not weight.is_contiguous():
            raise ValueError("weight must be contiguous")
        eps_f = fp32_number(eps, "eps", positive=True)
        bias_f = fp32_number(weight_bias, "weight_bias")
    quant_name = parse_quant(quant)
    scale_f: float | None = None
    layout_name: str | None = None
    group = 0
    if quant_name is not None:  # as its rows of the quantised outputs say (arfuse.pattern)
        made = quant_output(quant_name, layout)
        if made.scale_in == "none" and scale is not None:
            raise ValueError(f"quant={quant_name!r} computes its own scales; pass scale=None")
        if made.scale_in != "none":
            if scale is None:
                raise ValueError(f"quant={quant_name!r} needs scale (fp8: the dequantisation "
                                 "scale; nvfp4: the global encode scale)")
            scale_f = fp32_number(scale, "scale", positive=True,
                                  reciprocal=made.scale_in == "dequant")
        if made.grouped:
            group = check_group_size(group_size, shape.hidden)
        problem = made.problem(shape.dtype_name, shape.hidden, group or None)
        if problem:
            raise ValueError(problem)
        layout_name = made.layout
    if group == 0 and group_size is not None:
        grouped = ", ".join(dict.fromkeys(repr(o.quant) for o in QUANT_OUTPUTS if o.grouped))
        raise ValueError(f"group_size={group_size!r} is only for quant={grouped} (got "
                         f"quant={quant_name!r}); pass group_size=None")
    _check_memory(x, residual, weight, out, residual_out, shared, slot_start)
    return CallArgs(x, residual, weight, eps_f, bias_f, quant_name, scale_f, layout_name, out,
                    residual_out, op, group)


def _check_x(shape: OpShape, x: Any) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_plain(x, "x")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    if x.dtype != shape.dtype:
        raise ValueError(f"x has dtype {x.dtype}; this op was built for {shape.dtype}")
    if x.shape[1] != shape.hidden:
        raise ValueError(f"x has hidden size {x.shape[1]}; this op was built for "
                         f"hidden_dim={shape.hidden}")
    if x.device != shape.device:
        raise ValueError(f"x is on {x.device}; this op's workspace is on {shape.device}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous (call .contiguous() first)")


def check_like(tensor: Any, x: torch.Tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    check_plain(tensor, name)
    if tensor.shape != x.shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; x has {tuple(x.shape)}")
    if tensor.dtype != x.dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype}; x has {x.dtype}")
    if tensor.device != x.device:
        raise ValueError(f"{name} is on {tensor.device}; x is on {x.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_memory(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                  out: Any, residual_out: Any, shared: Span | None,
                  slot_start: int | None) -> None:
    """Inputs may not lie in the shared segment (a peer's copy or our own would overwrite
    them), except ``x`` written exactly at ``input_buffer()``. ``out`` is ``x`` or memory of
    its own; ``residual_out`` is ``residual`` (``x`` without one) or memory of its own;
    neither is in the shared segment, and neither may require grad (as torch's ``out=``)."""
    if shared is not None:
        x_span = span(x)
        if overlap(x_span, shared) and x_span[0] != slot_start:
            raise ValueError("x lies in the shared segment but does not start where "
                             "input_buffer() does (an offset view of it, or an older slot); "
                             "pass input_buffer(tokens) itself or memory of its own")
        for name, tensor in (("residual", residual), ("weight", weight)):
            if tensor is not None and overlap(span(tensor), shared):
                raise ValueError(f"{name} lies in the shared segment (input_buffer()); the "
                                 "copy of x into it would overwrite it")
    if out is None and residual_out is None:
        return
    if residual_out is not None and weight is None:
        raise ValueError("residual_out needs weight: without RMSNorm there is no residual_out")
    inputs = {"x": span(x)}  # each span once: the checks below ask for them repeatedly
    if residual is not None:
        inputs["residual"] = span(residual)
    if weight is not None:
        inputs["weight"] = span(weight)
    own_of_residual_out = "residual" if residual is not None else "x"
    for name, dest, own_name in (("out", out, "x"),
                                 ("residual_out", residual_out, own_of_residual_out)):
        if dest is None:
            continue
        check_like(dest, x, name)
        if dest.requires_grad:
            raise ValueError(f"{name} requires grad; an output written in place cannot take "
                             "part in autograd (as torch refuses out= tensors that require "
                             "grad)")
        dest_span = span(dest)
        if shared is not None and overlap(dest_span, shared):
            raise ValueError(f"{name} is in the shared input slot (input_buffer()); the other "
                             "ranks read it during the call, so it cannot take an output")
        own = inputs[own_name]
        if overlap(dest_span, own) and dest_span != own:
            raise ValueError(f"{name} overlaps {own_name} only partly; pass {own_name} itself "
                             "(in place) or memory of its own")
        for other_name, other in inputs.items():
            if other_name == own_name or other == own:
                continue
            if overlap(dest_span, other):
                raise ValueError(f"{name} overlaps {other_name}; it may only be {own_name} "
                                 "itself (in place) or memory of its own")
    if out is not None and residual_out is not None and overlap(span(out), span(residual_out)):
        raise ValueError("out and residual_out overlap; they must be different memory")
