"""vLLM's communicator for the standalone all-reduce, on the group's arfuse workspaces."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ... import log
from ... import topology as topology_mod
from ...ops import FusedAllReduce
from ..common import level as _level
from ..common import normalize as _normalize
from ..common import rank_and_size as _rank_and_size
from .decision import (
    FI_ALLREDUCE_FUSION_MAX_SIZE_MB,
    MiB,
    _decide,
    _flashinfer_available,
    _tuned_max_size,
)
from .workspaces import _acquire, _destroy_group

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)



def _device_type(device: Any) -> str:
    if isinstance(device, int) and not isinstance(device, bool):
        return "cuda"
    return torch.device(device).type


class FlashInferAllReduce:
    """vLLM's communicator for the standalone all-reduce, on the group's arfuse workspace."""

    def __init__(self, group: Any, device: int | str | torch.device) -> None:
        self.disabled = True
        self.group: Any = None
        # (hidden, dtype) with no workspace: those calls run unfused; other shapes keep theirs
        self._declined: set[tuple[int, torch.dtype]] = set()
        if not _flashinfer_available():
            log.once(logging.INFO, "no flashinfer", "FlashInfer All Reduce is disabled because "
                     "flashinfer is not available")
            return
        if not torch.cuda.is_available():
            log.once(logging.INFO, "no cuda", "FlashInfer All Reduce is disabled because it "
                     "requires CUDA platform")
            return
        self.group = group
        self.rank, self.world_size = _rank_and_size(_normalize(group))
        self.device = device
        self._device_kind = _device_type(device)
        if self.world_size == 1:
            return
        if self._device_kind not in topology_mod.DEVICES:
            log.once(logging.INFO, ("device", str(device)), "FlashInfer All Reduce is disabled: "
                     "arfuse runs on %s, not on %s", " or ".join(topology_mod.DEVICES), device)
            return
        decision = _decide(_normalize(group), self._device_kind)
        level = _level(decision.rank, logging.INFO)
        default_mb = FI_ALLREDUCE_FUSION_MAX_SIZE_MB.get(decision.topology.sm or 0, {}).get(
            self.world_size)
        if not default_mb:
            log.once(level, (decision.group_key, "world size"), "FlashInfer All Reduce is "
                     "disabled because it is not supported for world_size=%d (SM %s).",
                     self.world_size, decision.topology.sm)
            return
        if decision.backend is None:
            log.once(level, (decision.group_key, "no backend"), "FlashInfer All Reduce is "
                     "disabled because no supported backend is available for this process "
                     "group.")
            return
        tuned = _tuned_max_size(decision, self.world_size)
        self.max_workspace_size = tuned if tuned is not None else int(default_mb * MiB)
        self.max_num_tokens = 0
        self.disabled = False

    def _tokens(self, hidden_dim: int, dtype: torch.dtype) -> int:
        """Tokens of this hidden size and dtype that fit the byte budget (per shape: R4)."""
        element_size = torch.tensor([], dtype=dtype).element_size()
        tokens = self.max_workspace_size // (hidden_dim * element_size)
        if not self.max_num_tokens:
            self.max_num_tokens = tokens
        return tokens

    def _op(self, hidden_dim: int, dtype: torch.dtype) -> FusedAllReduce | None:
        """The op of this shape. A shape without one is declined from then on, and only it
        (vLLM, with one workspace for every shape, disables itself when that one fails)."""
        if (hidden_dim, dtype) in self._declined:
            return None
        op = _acquire(self.group, self.world_size, self.rank, self._tokens(hidden_dim, dtype),
                      hidden_dim, dtype, False, self._device_kind)
        if op is None:
            self._declined.add((hidden_dim, dtype))
        return op

    def should_use_fi_ar(self, input_tensor: torch.Tensor) -> bool:
        """vLLM's checks, then R1: at most the tokens the workspace really holds."""
        if self.disabled:
            return False
        if input_tensor.device.type != self._device_kind:
            return False
        if not input_tensor.is_contiguous() or input_tensor.dim() != 2:
            return False
        if input_tensor.dtype not in _SUPPORTED_DTYPES:
            return False
        if input_tensor.nbytes > self.max_workspace_size:
            return False
        num_tokens, hidden_dim = input_tensor.shape
        if num_tokens > self._tokens(hidden_dim, input_tensor.dtype):
            return False
        op = self._op(hidden_dim, input_tensor.dtype)
        return op is not None and num_tokens <= op.capacity

    def all_reduce(self, input_tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the group, through arfuse's op on the FlashInfer workspace. Only after
        ``should_use_fi_ar`` said yes (vLLM's contract): a disabled communicator has no group
        to reduce over, and says so."""
        if self.disabled:
            raise RuntimeError("FlashInfer All Reduce is disabled (see the log for why); "
                               "call should_use_fi_ar first and reduce another way")
        _, hidden_dim = input_tensor.shape
        op = self._op(hidden_dim, input_tensor.dtype)
        if op is None:
            raise RuntimeError("FlashInfer All Reduce has no workspace for this group; call "
                               "should_use_fi_ar first")
        return op(input_tensor).out

    def destroy(self) -> None:
        """Free this group's workspaces (vLLM frees every group's; R9 keeps it to this one),
        and forget the shapes it declined."""
        if self.group is not None:
            _destroy_group(self.group)
        self._declined.clear()
