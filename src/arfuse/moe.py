"""The MoE patterns' expert step (docs/design.md 3.12): its inputs, their checks, and the torch
reference whose bytes every backend's step must equal.

Before the all-reduce, each rank combines its expert rows into the rows it reduces:

* ``moe_finalize``: ``x[t] = T((sum_k scale[t,k] * expanded[index[t,k]]) * routed + shared[t])``,
  an index of -1 skipped;
* ``moe_reduce``: ``x[t] = T(sum_e scale[e,t] * active[e,t] + token_input[t])``, expert-major;

in fp32, k (or e) in order from +0, each product and each sum rounded on its own (no fused
multiply-add), the multiply by ``routed`` only when it is not 1 and the shared expert only when
given. From ``x`` on, the call is the all-reduce pattern unchanged.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import torch

from . import signature
from .arg_checks import OpShape, Span, check_plain, fp32_number, overlap, span
from .pattern import REDUCTION_SHIFT, REDUCTIONS
from .torch_types import round_to


class RefusedStep(ValueError):
    """A MoE call this rank refused after its peers may have entered it (a bad index): the op
    tells the group before raising, so no peer waits for it."""


@dataclass(frozen=True, slots=True)
class ExpertStep:
    """The checked inputs of one MoE call's expert step."""

    reduction: str                 # "moe_finalize" or "moe_reduce"
    rows: torch.Tensor             # expanded [P, H], or active [E, T, H]
    scales: torch.Tensor           # [T, top_k], or [E, T]; fp32 or the activation dtype
    index: torch.Tensor | None     # int32 [T, top_k] (finalize)
    add: torch.Tensor | None       # shared expert [T, H] (finalize, optional), token input
    routed: float = 1.0            # routed_scaling_factor, as fp32 (finalize)
    refused: bool = False          # this rank refused the call (its signature says so)

    @property
    def tokens(self) -> int:
        return int(self.scales.shape[0] if self.index is not None else self.scales.shape[1])

    @property
    def fan_in(self) -> int:
        """top_k (finalize) or the experts (reduce)."""
        return int(self.index.shape[1] if self.index is not None else self.rows.shape[0])

    def signature_bits(self) -> int:
        """What this call adds to its signature's word 0: its reduction and MoE fields (fan-in 0
        for a call this rank refused, which no valid call has)."""
        reduction = REDUCTIONS[self.reduction] << (signature.PATTERN_SHIFT + REDUCTION_SHIFT)
        routed_bits = struct.unpack("<I", struct.pack("<f", self.routed))[0]
        return reduction | signature.moe_bits(0 if self.refused else self.fan_in,
                                              self.add is not None and self.index is not None,
                                              int(self.rows.shape[0]), routed_bits)

    def tensors(self) -> tuple[tuple[str, torch.Tensor], ...]:
        names = (("expanded", "expert_scales", "expanded_idx_to_permuted_idx",
                  "shared_expert_output") if self.index is not None else
                 ("active_experts_token_input", "scale_input", "", "token_input"))
        given = zip(names, (self.rows, self.scales, self.index, self.add), strict=True)
        return tuple((name, t) for name, t in given if t is not None)


def refusal(reduction: str, x: torch.Tensor) -> ExpertStep:
    """The expert step of a call this rank refused before it could read its arguments (they
    failed their checks): no rows, fan-in 0 in its signature, the tokens of ``x``."""
    rows = x.new_empty((0, x.shape[1]))
    if reduction == "moe_finalize":
        index = torch.empty((x.shape[0], 0), dtype=torch.int32, device=x.device)
        return ExpertStep(reduction, rows, index.float(), index, None, refused=True)
    scales = torch.empty((0, x.shape[0]), dtype=torch.float32, device=x.device)
    return ExpertStep(reduction, rows, scales, None, x, refused=True)


def check_finalize(shape: OpShape, expanded: Any, index: Any, scales: Any, shared: Any,
                   routed: Any) -> ExpertStep:
    """Every rule of a finalize call's own arguments (the index's values: ``index_problem``)."""
    _check_rows(shape, expanded, "expanded", 2)
    _check_tensor(shape, index, "expanded_idx_to_permuted_idx", dtype_ok=(torch.int32,))
    if index.dim() != 2:
        raise ValueError(
            f"expanded_idx_to_permuted_idx must be 2-D int32 [tokens, top_k], got shape "
            f"{tuple(index.shape)}" + (" (a flat index: pass it as .view(tokens, top_k))"
                                       if index.dim() == 1 else ""))
    tokens, top_k = int(index.shape[0]), int(index.shape[1])
    _check_fan_in(top_k, "top_k (expanded_idx_to_permuted_idx.shape[1])")
    _check_scales(shape, scales, "expert_scales", (tokens, top_k),
                  "[tokens, top_k] like expanded_idx_to_permuted_idx")
    if shared is not None:
        _check_rows(shape, shared, "shared_expert_output", 2)
        if tuple(shared.shape) != (tokens, shape.hidden):
            raise ValueError(f"shared_expert_output must have shape ({tokens}, {shape.hidden}) "
                             f"([tokens, hidden]), got {tuple(shared.shape)}")
    routed_f = fp32_number(routed, "routed_scaling_factor")
    routed_f32 = struct.unpack("<f", struct.pack("<f", routed_f))[0]
    return ExpertStep("moe_finalize", expanded, scales, index, shared, routed_f32)


def check_reduce(shape: OpShape, active: Any, scales: Any, token_input: Any) -> ExpertStep:
    """Every rule of a reduction call's own arguments."""
    _check_rows(shape, active, "active_experts_token_input", 3)
    experts, tokens = int(active.shape[0]), int(active.shape[1])
    _check_fan_in(experts, "experts (active_experts_token_input.shape[0])")
    _check_scales(shape, scales, "scale_input", (experts, tokens),
                  "[experts, tokens] like active_experts_token_input's first two dimensions")
    _check_rows(shape, token_input, "token_input", 2)
    if tuple(token_input.shape) != (tokens, shape.hidden):
        raise ValueError(f"token_input must have shape ({tokens}, {shape.hidden}) ([tokens, "
                         f"hidden]), got {tuple(token_input.shape)}")
    return ExpertStep("moe_reduce", active, scales, None, token_input)


def check_not_shared(step: ExpertStep, shared: Span | None) -> None:
    """No input of the step may lie in the segment the step writes (the input slot)."""
    if shared is None:
        return
    for name, tensor in step.tensors():
        if overlap(span(tensor), shared):
            raise ValueError(f"{name} lies in the shared segment (input_buffer()); the expert "
                             "step writes there, so it cannot be an input")


def index_problem(step: ExpertStep) -> str:
    """Why the finalize index reads outside ``expanded`` ("" when every entry is -1 or a row):
    the first such entry, in the words of the shm kernel's own check."""
    index = step.index
    if index is None or index.numel() == 0:
        return ""
    rows = int(step.rows.shape[0])
    bad = ((index < -1) | (index >= rows)).flatten().nonzero()
    if bad.numel() == 0:
        return ""
    j = int(bad[0, 0])
    t, k = divmod(j, int(index.shape[1]))
    return (f"expanded_idx_to_permuted_idx[{t}, {k}] = {int(index[t, k])} is not a row of "
            f"expanded (it must be -1, for none, or 0..{rows - 1})")


def local_rows(step: ExpertStep, out: torch.Tensor) -> torch.Tensor:
    """The expert step in torch, into ``out`` ([T, H], the activation dtype): the reference.
    Raises ``RefusedStep`` for an index outside ``expanded``."""
    problem = index_problem(step)
    if problem:
        raise RefusedStep(problem)
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    scales = step.scales.float()
    if step.index is not None:
        index = step.index.long()
        for k in range(index.shape[1]):
            column = index[:, k]
            if step.rows.shape[0] == 0:
                continue  # every entry is -1
            product = scales[:, k:k + 1] * step.rows[column.clamp(min=0)].float()
            acc.add_(torch.where((column >= 0).unsqueeze(1), product, 0.0))
        if step.routed != 1.0:
            acc.mul_(torch.tensor(step.routed, dtype=torch.float32, device=acc.device))
    else:
        for e in range(step.rows.shape[0]):
            acc.add_(scales[e].unsqueeze(1) * step.rows[e].float())
    if step.add is not None:
        acc.add_(step.add.float())
    return out.copy_(round_to(acc, out.dtype))


def _check_tensor(shape: OpShape, tensor: Any, name: str,
                  dtype_ok: tuple[torch.dtype, ...]) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    check_plain(tensor, name)
    if tensor.dtype not in dtype_ok:
        raise ValueError(f"{name} has dtype {tensor.dtype}; it must be "
                         + " or ".join(str(d) for d in dtype_ok))
    if tensor.device != shape.device:
        raise ValueError(f"{name} is on {tensor.device}; this op's workspace is on "
                         f"{shape.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def _check_rows(shape: OpShape, tensor: Any, name: str, dim: int) -> None:
    _check_tensor(shape, tensor, name, dtype_ok=(shape.dtype,))
    if tensor.dim() != dim or tensor.shape[-1] != shape.hidden:
        form = "[rows, hidden]" if dim == 2 else "[experts, tokens, hidden]"
        raise ValueError(f"{name} must be {dim}-D {form} with hidden={shape.hidden}, got shape "
                         f"{tuple(tensor.shape)}")


def _check_scales(shape: OpShape, scales: Any, name: str, want: tuple[int, int],
                  form: str) -> None:
    dtypes = (torch.float32,) if shape.dtype == torch.float32 else (torch.float32, shape.dtype)
    _check_tensor(shape, scales, name, dtype_ok=dtypes)
    if tuple(scales.shape) != want:
        raise ValueError(f"{name} must have shape {want} ({form}), got {tuple(scales.shape)}")


def _check_fan_in(value: int, name: str) -> None:
    if not 1 <= value <= signature.MAX_MOE_FAN_IN:
        raise ValueError(f"{name} = {value} is not valid; it must be 1..{signature.MAX_MOE_FAN_IN}")
