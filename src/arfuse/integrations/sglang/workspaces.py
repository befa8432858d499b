"""The fusion groups' FlashInfer workspaces: SGLang's per-group manager, made by arfuse's
negotiation on the group passed, the TP-wide "disabled" flag, pre-initialisation and cleanup."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from ... import group as group_mod
from ... import log, negotiate
from ...errors import NegotiationError
from ...ops import FusedAllReduce
from .. import common
from ..common import FLASHINFER_BACKENDS, drop_in_timeout_s
from .decision import (
    _comm,
    _decide,
    _decisions,
    _decline_cutedsl,
    _flashinfer,
    _runtime,
    resolve_fusion_group,
    uses_cutedsl_ar_fusion,
)

_MANAGERS = {True: "flashinfer_fusion_attn_tp_workspace",
             False: "flashinfer_fusion_moe_tp_workspace"}
_unavailable = False  # SGLang's "disabled permanently" flag, agreed across TP


def is_flashinfer_allreduce_unavailable() -> bool:
    return _unavailable or _flashinfer()[1]


def _size_check_kwargs(handle: Any, use_oneshot: bool | None) -> dict[str, Any]:
    """SGLang's adaptation of the one-shot choice to the workspace's own size check."""
    params = inspect.signature(handle.is_buffer_size_sufficient).parameters
    if "use_oneshot" in params:
        return {"use_oneshot": use_oneshot}
    if "strategy" in params and use_oneshot is not None:
        kind = type(params["strategy"].default)
        return {"strategy": getattr(kind, "ONESHOT" if use_oneshot else "TWOSHOT")}
    return {}


class FlashInferWorkspaceManager:
    """SGLang's per-group workspace holder: FlashInfer's own workspace in ``workspace``, made
    by arfuse's negotiation on the group passed and kept in arfuse's registry."""

    def __init__(self) -> None:
        self._reset()
        self._max_token_num_seen: int | None = None
        self._max_hidden_dim_seen: int | None = None
        self._tried: tuple[Any, ...] | None = None  # the last request that made no workspace
        self._attempts = 0  # creations tried (the same count on every rank of the group)

    def _reset(self) -> None:
        self.workspace: Any = None
        self.world_size: int | None = None
        self.rank: int | None = None
        self.group: tuple[Any, Any] | None = None
        self.max_token_num: int | None = None
        self.hidden_dim: int | None = None
        self.dtype: torch.dtype | None = None
        self.backend: str | None = None
        self.use_fp32_lamport: bool | None = None
        self.initialized = False
        self._op: FusedAllReduce | None = None

    def initialize(self, world_size: int, rank: int, max_token_num: int, hidden_dim: int,
                   backend: str = "auto", group: Any = None, use_fp32_lamport: bool = False,
                   dtype: torch.dtype | None = None, use_oneshot: bool | None = None,
                   device_group: Any = None, cpu_group: Any = None) -> None:
        """Collective on ``cpu_group`` (else ``group``): a workspace that holds
        ``max_token_num`` tokens, kept at the high-water mark of what was asked."""
        self._max_token_num_seen = max(max_token_num, self._max_token_num_seen or 0)
        self._max_hidden_dim_seen = max(hidden_dim, self._max_hidden_dim_seen or 0)
        want = dtype or torch.bfloat16
        if self.initialized and self.world_size == world_size and \
                self.is_buffer_size_sufficient(max_token_num, hidden_dim, want, use_oneshot):
            return
        if backend == "cutedsl":
            _decline_cutedsl()
            return
        if _comm() is None:
            log.once(logging.WARNING, "sglang no comm", "FlashInfer comm not available, "
                     "skipping workspace initialization")
            return
        negotiated = common.normalize(cpu_group if cpu_group is not None else group)
        own = common.rank_and_size(negotiated)
        if (rank, world_size) != own:
            raise ValueError(f"world_size={world_size}, rank={rank} do not match the group "
                             f"passed (rank {own[0]} of {own[1]}); arfuse uses the group")
        request = (group_mod.group_key(negotiated), backend, self._max_token_num_seen,
                   self._max_hidden_dim_seen, want)
        if request == self._tried:  # creation is collective: the same request is not retried
            return
        self.cleanup()
        self._tried, self._attempts = request, self._attempts + 1
        self._create(negotiated, backend, want, (device_group, cpu_group))
        if self.initialized and not self.is_buffer_size_sufficient(
                max_token_num, hidden_dim, want, use_oneshot):
            log.once(logging.WARNING, ("sglang short", request), "arfuse SGLang drop-in: the "
                     "%s workspace does not hold %d tokens of hidden %d; those calls run "
                     "unfused", self.backend, max_token_num, hidden_dim)
        elif self.initialized:
            self._tried = None

    def _create(self, group: Any, backend: str, dtype: torch.dtype,
                keys: tuple[Any, Any]) -> None:
        """Negotiate (strict: a FlashInfer backend or nothing); a failure, the same on every
        rank of the group, disables fusion as SGLang's does."""
        global _unavailable
        tokens, hidden = self._max_token_num_seen or 1, self._max_hidden_dim_seen or 1
        rank = common.rank_and_size(group)[0]
        try:
            op = FusedAllReduce(group, max_token_num=tokens, hidden_dim=hidden, dtype=dtype,
                                backend=backend, strict=True, device=common.cuda_if_available(),
                                timeout_s=drop_in_timeout_s())
        except (NegotiationError, ValueError) as exc:
            _unavailable = True
            log.once(common.level(rank, logging.WARNING), (group_mod.group_key(group), str(exc)),
                     "arfuse SGLang drop-in: no FlashInfer workspace (backend=%s, "
                     "max_token_num=%d hidden=%d dtype=%s); SGLang runs unfused: %s", backend,
                     tokens, hidden, dtype, exc)
            return
        handle = getattr(op.workspace, "handle", None)
        if op.backend not in FLASHINFER_BACKENDS or handle is None:
            op.close()
            return
        self._op, self.workspace, self.backend = op, handle, op.backend
        self.world_size, self.rank = op.workspace.ctx.world_size, op.workspace.ctx.rank
        self.group, self.max_token_num, self.hidden_dim, self.dtype = keys, tokens, hidden, dtype
        fp32 = dtype == torch.float32
        self.use_fp32_lamport = (getattr(handle, "metadata", None) or {}).get(
            "use_fp32_lamport", fp32) if self.backend == "trtllm" else None
        self.initialized = True
        log.once(common.level(rank, logging.INFO), (group_mod.group_key(group), id(handle)),
                 "FlashInfer AllReduce Fusion enabled and workspace initialized: backend=%s, "
                 "world_size=%d, max_token_num=%d, hidden_dim=%d (arfuse)", self.backend,
                 self.world_size, tokens, hidden)

    def is_buffer_size_sufficient(self, token_num: int, hidden_dim: int, dtype: torch.dtype,
                                  use_oneshot: bool | None = None) -> bool:
        """FlashInfer's own answer (R1); a size check that fails is a no."""
        if not self.initialized or self.workspace is None:
            return False
        try:
            return bool(self.workspace.is_buffer_size_sufficient(
                tp_size=self.world_size, num_tokens=token_num, hidden_dim=hidden_dim,
                dtype=dtype, **_size_check_kwargs(self.workspace, use_oneshot)))
        except Exception as exc:
            log.logger.debug("arfuse SGLang drop-in: FlashInfer's size check failed: %s", exc)
            return False

    def cleanup(self) -> None:
        """Free the workspace (R10: arfuse destroys everything it holds, IPC included)."""
        op = self._op
        self._reset()
        if op is not None:
            common.release([op], "SGLang")


def _get_workspace_manager(use_attn_tp_group: bool) -> FlashInferWorkspaceManager:
    """The per-group manager, kept where SGLang keeps it (``get_resources().buffers``)."""
    buffers = _runtime().get_resources().buffers
    name = _MANAGERS[use_attn_tp_group]
    manager = buffers.get(name)
    if manager is None:
        manager = buffers[name] = FlashInferWorkspaceManager()
    return manager  # type: ignore[no-any-return]


def _sync_unavailable() -> None:
    """SGLang's TP-wide agreement on the disabled flag, as an arfuse exchange with a deadline
    (R8): ranks that disagree would diverge at graph capture."""
    global _unavailable
    tp = _runtime().get_parallel().tp_group
    if tp.world_size <= 1:
        return
    member = group_mod.join(tp.cpu_group)
    member.channel.begin(f"n{member.channel.next_epoch()}/sglang-unavailable")
    try:
        flags = negotiate.exchange_verdicts(member.channel, drop_in_timeout_s(), "unavailable",
                                            _unavailable, None)
    finally:
        common.forget_if_unused(member.key)
    if any(flags) and not _unavailable:
        _unavailable = True
        log.logger.warning("FlashInfer allreduce fusion disabled globally because workspace "
                           "initialization failed on at least one rank.")


def ensure_workspace_initialized(max_token_num: int = 2048, hidden_dim: int = 4096,
                                 use_fp32_lamport: bool = False,
                                 dtype: torch.dtype | None = None, token_num: int | None = None,
                                 use_oneshot: bool | None = None,
                                 use_attn_tp_group: bool = True) -> bool:
    """Whether the fusion group has a workspace that holds ``token_num`` tokens (R1);
    creates one (collectively) when it has none that does."""
    if _unavailable or uses_cutedsl_ar_fusion() or _comm() is None:
        return False
    world_size, rank, coordinator = resolve_fusion_group(use_attn_tp_group=use_attn_tp_group)
    if world_size <= 1:
        return False
    device_group, cpu_group = coordinator.device_group, coordinator.cpu_group
    manager = _get_workspace_manager(use_attn_tp_group)
    token_num = token_num or max_token_num
    want = dtype or torch.bfloat16

    def holds() -> bool:
        return manager.group == (device_group, cpu_group) and manager.world_size == world_size \
            and manager.rank == rank and \
            manager.is_buffer_size_sufficient(token_num, hidden_dim, want, use_oneshot)

    if holds():
        return True
    decision = _decide(cpu_group)
    if decision.backend is None:
        return False
    attempts = manager._attempts
    manager.initialize(world_size=world_size, rank=rank, max_token_num=max_token_num,
                       hidden_dim=hidden_dim, backend=str(decision.setting), group=cpu_group,
                       use_fp32_lamport=use_fp32_lamport, dtype=dtype, use_oneshot=use_oneshot,
                       device_group=device_group, cpu_group=cpu_group)
    if manager._attempts != attempts:  # only after a creation: never a collective per call
        _sync_unavailable()
    return not _unavailable and holds()


def pre_initialize_workspaces(max_token_num: int, hidden_dim: int, dtype: torch.dtype,
                              use_oneshot: bool | None = None) -> None:
    """Both fusion groups' workspaces, before CUDA-graph capture (collective)."""
    if _unavailable or _comm() is None:
        return
    for attention in (False, True):  # SGLang's order: MoE, then attention
        ensure_workspace_initialized(max_token_num=max_token_num, hidden_dim=hidden_dim,
                                     dtype=dtype, use_oneshot=use_oneshot,
                                     use_attn_tp_group=attention)


def cleanup_flashinfer_workspace() -> None:
    """Free both managers' workspaces (R10) and forget the groups' decisions."""
    buffers = _runtime().get_resources().buffers
    for name in _MANAGERS.values():
        manager = buffers.get(name)
        if manager is not None:
            manager.cleanup()
    _decisions.clear()
