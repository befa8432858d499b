"""SGLang's fused calls on the fusion group's workspace: the fused all-reduce + residual +
RMSNorm (a torch custom op where SGLang is), and the plain all-reduce with its check."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any, Optional, Tuple, TypeVar  # noqa: UP035  (torch's op schema reads them)

import torch

from . import workspaces as _state
from .decision import _comm, resolve_fusion_world_size
from .workspaces import _get_workspace_manager, ensure_workspace_initialized

F = TypeVar("F", bound=Callable[..., Any])


def fake_flashinfer_allreduce_residual_rmsnorm(
        input_tensor: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
        eps: float = 1e-6, max_token_num: int = 16384, use_oneshot: Optional[bool] = None,  # noqa: UP045
        trigger_completion_at_end: bool = False, fp32_acc: bool = True,
        use_attn_tp_group: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
    return torch.empty_like(input_tensor), torch.empty_like(residual)


def _registered(fn: F) -> F:
    """Registered as SGLang registers it (a torch custom op with its fake), where SGLang is."""
    try:
        custom_op = importlib.import_module("sglang.srt.utils.custom_op")
    except Exception:  # no SGLang here (or one that does not import): the plain function
        return fn
    return custom_op.register_custom_op(  # type: ignore[no-any-return]
        mutates_args=["input_tensor", "residual", "weight"],
        fake_impl=fake_flashinfer_allreduce_residual_rmsnorm)(fn)


_TRIGGER: dict[int, bool] = {}


def _takes_trigger(comm: ModuleType) -> bool:
    """Whether this FlashInfer's ``allreduce_fusion`` takes ``trigger_completion_at_end``."""
    fn = comm.allreduce_fusion
    if id(fn) not in _TRIGGER:
        _TRIGGER[id(fn)] = "trigger_completion_at_end" in inspect.signature(fn).parameters
    return _TRIGGER[id(fn)]


def flashinfer_allreduce_residual_rmsnorm(
        input_tensor: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
        eps: float = 1e-6, max_token_num: int = 2048, use_oneshot: Optional[bool] = None,  # noqa: UP045
        trigger_completion_at_end: bool = False, fp32_acc: bool = True,
        use_attn_tp_group: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
    """FlashInfer's fused all-reduce + residual + RMSNorm on the fusion group's workspace:
    ``(norm_out, residual_out)``, or ``(None, None)`` to decline (the caller runs unfused)."""
    comm = _comm()
    if comm is None or resolve_fusion_world_size(use_attn_tp_group=use_attn_tp_group) <= 1:
        return None, None  # type: ignore[return-value]  # SGLang's decline
    assert input_tensor.shape[0] <= max_token_num
    if not (input_tensor.is_contiguous() and residual.is_contiguous()
            and weight.is_contiguous()):
        return None, None  # type: ignore[return-value]
    if not ensure_workspace_initialized(
            max_token_num=max_token_num, hidden_dim=input_tensor.shape[-1],
            use_fp32_lamport=input_tensor.dtype == torch.float32, dtype=input_tensor.dtype,
            token_num=input_tensor.shape[0], use_oneshot=use_oneshot,
            use_attn_tp_group=use_attn_tp_group):
        return None, None  # type: ignore[return-value]
    manager = _get_workspace_manager(use_attn_tp_group)
    residual_out, norm_out = torch.empty_like(residual), torch.empty_like(input_tensor)
    kwargs: dict[str, Any] = {
        "input": input_tensor, "workspace": manager.workspace,
        "pattern": comm.AllReduceFusionPattern.kARResidualRMSNorm, "launch_with_pdl": True,
        "residual_out": residual_out, "norm_out": norm_out, "residual_in": residual,
        "rms_gamma": weight, "rms_eps": eps, "use_oneshot": use_oneshot}
    if manager.backend == "trtllm":
        kwargs["fp32_acc"] = fp32_acc
    if _takes_trigger(comm):
        kwargs["trigger_completion_at_end"] = trigger_completion_at_end
    comm.allreduce_fusion(**kwargs)
    return norm_out, residual_out


flashinfer_allreduce_residual_rmsnorm = _registered(flashinfer_allreduce_residual_rmsnorm)


def can_use_flashinfer_allreduce(input_: torch.Tensor, *, use_attn_tp_group: bool,
                                 expected_world_size: int,
                                 expected_group_key: tuple[Any, Any]) -> bool:
    """Whether ``flashinfer_allreduce`` can serve this all-reduce: SGLang's rank-invariant
    checks, and the workspace's own size check (R1)."""
    if _state._unavailable or _comm() is None:
        return False
    if input_.ndim != 2 or not input_.is_contiguous():
        return False
    manager = _get_workspace_manager(use_attn_tp_group)
    if not manager.initialized or manager.workspace is None:
        return False
    if manager.world_size != expected_world_size or manager.group != expected_group_key:
        return False
    token_num, hidden_dim = input_.shape
    if manager.backend == "mnnvl" and hidden_dim % (16 // input_.element_size()) != 0:
        return False
    if torch.compiler.is_compiling():  # SGLang's stand-in for the size check while tracing
        return (manager.max_token_num is not None and manager.hidden_dim is not None
                and token_num <= manager.max_token_num and hidden_dim <= manager.hidden_dim
                and manager.dtype == input_.dtype)
    if manager.backend == "trtllm" and (
            token_num * hidden_dim > (manager.max_token_num or 0) * (manager.hidden_dim or 0)
            or manager.use_fp32_lamport != (input_.dtype == torch.float32)):
        return False
    return manager.is_buffer_size_sufficient(token_num, hidden_dim, input_.dtype)


def flashinfer_allreduce(input_: torch.Tensor, *, use_attn_tp_group: bool) -> torch.Tensor:
    """FlashInfer's plain all-reduce; ``can_use_flashinfer_allreduce`` said yes (SGLang's
    contract: no fallback here, kernel errors are not caught)."""
    comm = _comm()
    assert comm is not None, "call can_use_flashinfer_allreduce first"
    manager = _get_workspace_manager(use_attn_tp_group)
    output = torch.empty_like(input_)
    kwargs: dict[str, Any] = {
        "input": input_, "workspace": manager.workspace,
        "pattern": comm.AllReduceFusionPattern.kAllReduce, "launch_with_pdl": True,
        "output": output}
    if manager.backend == "trtllm":
        kwargs["fp32_acc"] = True
    if _takes_trigger(comm):
        kwargs["trigger_completion_at_end"] = False
    comm.allreduce_fusion(**kwargs)
    return output

