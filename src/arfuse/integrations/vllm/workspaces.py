"""The FlashInfer workspaces the drop-in holds for vLLM: the getters, the failures it
remembers, and destroy. Each workspace is negotiated by ``FusedAllReduce`` on the group passed."""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ... import group as group_mod
from ... import log, negotiate
from ...dtypes import parse_dtype
from ...errors import NegotiationError
from ...ops import FusedAllReduce
from ...spec import Spec
from ...torch_types import TORCH_DTYPES
from .. import common
from ..common import FLASHINFER_BACKENDS, drop_in_timeout_s
from ..common import cuda_if_available as _device_kind
from ..common import level as _level
from ..common import normalize as _normalize
from ..common import rank_and_size as _rank_and_size
from .decision import (
    DEFAULT_BACKEND,
    ENV_BACKEND,
    GroupDecision,
    _decide,
    _tuned_max_size,
    _use_flashinfer_env,
)

_TRTLLM_MULTI_NODE = ("Flashinfer allreduce is not supported for multi-node allreduce with "
                      "'trtllm' backend. Please use 'mnnvl' backend instead.")
_TRTLLM_MULTI_NODE_QUANT = ("Flashinfer allreduce quantization fusion is not supported for "
                            "multi-node allreduce with 'trtllm' backend. Please use 'mnnvl' "
                            "backend instead.")
_MAX_GROWTH = 8  # a workspace regrown for R1 is at most this many times the one that fell short



@dataclass(eq=False)
class _Held:
    """One ``FusedAllReduce`` the drop-in holds for vLLM, and the group it was made for."""

    group: Any
    op: FusedAllReduce
    superseded: bool = False

    @property
    def live(self) -> bool:
        return self.op.backend != "closed" and not self.op.workspace.destroyed

    @property
    def spec(self) -> Spec:
        return self.op.workspace.spec

    @property
    def handle(self) -> Any:
        return getattr(self.op.workspace, "handle", None)


_lock = threading.RLock()
_held: list[_Held] = []
# (group key, setting, hidden, dtype) -> the smallest max_token_num that failed: creation is
# collective, so a failure is not retried on every call (as vLLM does); destroy forgets them.
# A remembered failure is told in the group's exchange (``_acquire``), never answered alone
_failed: dict[tuple[str, str, int, str], int] = {}


def _covering(group: Any, spec: Spec, need: int) -> _Held | None:
    """The newest live workspace of this very group (R9) that fits, no collective. For the
    getters (``need`` > 0: vLLM hands the handle to FlashInfer for up to ``need`` tokens of
    this hidden size and dtype) that is FlashInfer's own answer for exactly that request (R4,
    R1): the fusion pass sizes one workspace for the widest model (target or draft) and every
    fused call then asks with its own tensor's shape. For the communicator (``need`` 0: it
    calls through the op) the op's hidden size and dtype."""
    for held in reversed(_held):
        if held.group is not group or held.superseded or not held.live:
            continue
        if need > 0 and _holds(held, need, spec):
            return held
        if need == 0 and held.spec.covers(spec):
            return held
    return None


def _holds(held: _Held, tokens: int, spec: Spec) -> bool:
    """FlashInfer's ``is_buffer_size_sufficient`` of the held workspace for this request."""
    handle = held.handle
    if handle is None:
        return False
    return bool(handle.is_buffer_size_sufficient(
        tp_size=held.op.workspace.ctx.world_size, num_tokens=tokens, hidden_dim=spec.hidden,
        dtype=TORCH_DTYPES[spec.dtype]))


def _drop_dead() -> None:
    """Workspaces destroyed behind the drop-in's back (``arfuse.destroy_all``) are forgotten."""
    for held in [h for h in _held if not h.live]:
        _held.remove(held)
        held.op.close()


def _failure_key(group: Any, spec: Spec) -> tuple[str, str, int, str]:
    """(group, the raw setting: an invalid one is an error every rank reports together,
    hidden, dtype)."""
    return (group_mod.group_key(group), os.environ.get(ENV_BACKEND, DEFAULT_BACKEND),
            spec.hidden, spec.dtype)


def _acquire(group: Any, world_size: int, rank: int, max_token_num: int, hidden_dim: int,
             dtype: Any, quant: bool, device: str | None,
             need: int = 0) -> FusedAllReduce | None:
    """The op whose FlashInfer workspace serves the request, negotiating one if none fits.

    ``need``: tokens the workspace must really hold (R1), for callers that hand it straight to
    FlashInfer (the getters: the fusion pass calls up to ``max_token_num``); the communicator
    gates each call on the capacity itself."""
    group = _normalize(group)
    spec, spec_error = negotiate.attempt_locally(
        lambda: Spec(max_tokens=max_token_num, hidden=hidden_dim, dtype=parse_dtype(dtype)))

    def check() -> None:
        """This rank's arguments, checked where every rank learns the verdict (``_decide``)."""
        if spec_error is not None:
            raise spec_error
        own_rank, own_size = _rank_and_size(group)
        if (world_size, rank) != (own_size, own_rank):
            raise ValueError(f"world_size={world_size}, rank={rank} do not match the group "
                             f"passed (rank {own_rank} of {own_size}); arfuse uses the group")

    with _lock:
        if spec is not None:
            found = _covering(group, spec, need)
            if found is not None:
                return found.op
        _drop_dead()
        # a failure this rank remembers is answered in the exchange, not instead of it: a
        # peer that forgot it (destroy on that rank) or whose arguments are refused is in the
        # exchange, and every rank learns every answer there
        decision = _decide(group, device, check, lambda: _failed.get(_failure_key(group, spec))
                           if spec is not None else None)
        assert spec is not None  # this rank's check raised above otherwise
        key = _failure_key(group, spec)
        if decision.backend == "trtllm" and decision.topology.node_count > 1:
            raise ValueError(_TRTLLM_MULTI_NODE_QUANT if quant else _TRTLLM_MULTI_NODE)
        remembered = [int(tokens) for tokens in decision.known if tokens is not None]
        if remembered:  # by any rank: every rank remembers the smallest, as one answer
            _failed[key] = min(remembered)
            if max_token_num >= _failed[key]:
                return None
        if decision.backend is None or decision.topology.device != "cuda":
            _failed[key] = 1  # no size will do: FlashInfer needs CUDA and a backend
            return None
        tokens = max_token_num
        tuned = _tuned_max_size(decision, world_size) if _use_flashinfer_env() else None
        if tuned is not None:
            tokens = max(tokens, tuned // spec.row_bytes)
        op = _create(group, decision, tokens, spec, quant, device)
        if op is not None and op.capacity < need:
            op = _grow(group, decision, op, need, spec, quant, device)
        if op is None:
            _failed[key] = min(max_token_num, _failed.get(key, max_token_num))
            return None
        for held in _held:
            if held.group is group and held.spec.hidden == spec.hidden \
                    and held.spec.dtype == spec.dtype:
                # kept alive until destroy: CUDA graphs captured with it may still run
                held.superseded = True
        _held.append(_Held(group, op))
        return op


def _create(group: Any, decision: GroupDecision, tokens: int, spec: Spec, quant: bool,
            device: str | None) -> FusedAllReduce | None:
    """Collective: arfuse negotiates (strict: a FlashInfer backend or nothing)."""
    kind = "quant" if quant else "plain"
    arfuse_backend = "auto" if decision.setting == "auto" else decision.setting
    try:
        op = FusedAllReduce(group, max_token_num=tokens, hidden_dim=spec.hidden,
                            dtype=spec.dtype, backend=arfuse_backend,
                            quant="fp8" if quant else None, strict=True, device=device,
                            timeout_s=drop_in_timeout_s())
    except (NegotiationError, ValueError) as exc:
        log.once(_level(decision.rank, logging.WARNING),
                 (decision.group_key, decision.setting, spec.hidden, spec.dtype, str(exc)),
                 "arfuse vLLM drop-in, group %s: no FlashInfer workspace (%s, %s=%s, "
                 "max_token_num=%d hidden=%d dtype=%s); vLLM runs unfused: %s",
                 decision.group_key, kind, ENV_BACKEND, decision.setting, tokens, spec.hidden,
                 spec.dtype, exc)
        return None
    handle = getattr(op.workspace, "handle", None)
    if op.backend not in FLASHINFER_BACKENDS or handle is None:
        op.close()
        return None
    log.once(_level(decision.rank, logging.INFO), (decision.group_key, id(handle)),
             "arfuse vLLM drop-in, group %s: FlashInfer %s workspace for %s fusion, "
             "max_token_num=%d hidden=%d dtype=%s, capacity %d tokens", decision.group_key,
             op.backend, kind, op.workspace.spec.max_tokens, spec.hidden, spec.dtype,
             op.capacity)
    return op


def _grow(group: Any, decision: GroupDecision, op: FusedAllReduce, need: int, spec: Spec,
          quant: bool, device: str | None) -> FusedAllReduce | None:
    """R1: a workspace that holds fewer tokens than asked for is replaced, once, by one sized
    so that it holds them (at most ``_MAX_GROWTH`` times larger); else there is none, and vLLM
    does not fuse. Every rank takes the same branch: capacity is FlashInfer's answer for the
    same arguments on every rank."""
    held_tokens, capacity = op.workspace.spec.max_tokens, op.capacity
    op.close()
    tokens = -(-need * held_tokens // max(capacity, 1))
    bigger = None
    if capacity > 0 and tokens <= _MAX_GROWTH * held_tokens:
        log.once(_level(decision.rank, logging.INFO), (decision.group_key, held_tokens, need),
                 "arfuse vLLM drop-in, group %s: a workspace for %d tokens holds %d, %d are "
                 "needed; asking for %d", decision.group_key, held_tokens, capacity, need,
                 tokens)
        bigger = _create(group, decision, tokens, spec, quant, device)
    if bigger is not None and bigger.capacity >= need:
        return bigger
    if bigger is not None:
        bigger.close()
    log.once(_level(decision.rank, logging.WARNING), (decision.group_key, "short", need),
             "arfuse vLLM drop-in, group %s: no FlashInfer workspace holds %d tokens (one for "
             "%d holds %d); vLLM runs unfused", decision.group_key, need, held_tokens, capacity)
    return None


def get_fi_ar_workspace(world_size: int, rank: int, max_token_num: int, hidden_dim: int,
                        dtype: torch.dtype, group: Any) -> Any:
    """FlashInfer's workspace for plain fusion and the standalone all-reduce, or ``None``.

    Collective when it has to create one (every rank, same arguments): vLLM's fusion pass and
    communicator call it alike on every rank of the group."""
    op = _acquire(group, world_size, rank, max_token_num, hidden_dim, dtype, False,
                  _device_kind(), need=max_token_num)
    return None if op is None else getattr(op.workspace, "handle", None)


def get_fi_ar_quant_workspace(world_size: int, rank: int, max_token_num: int, hidden_dim: int,
                              dtype: torch.dtype, group: Any) -> Any:
    """FlashInfer's workspace for quantised fusion: the plain one whenever it fits (R5)."""
    op = _acquire(group, world_size, rank, max_token_num, hidden_dim, dtype, True,
                  _device_kind(), need=max_token_num)
    return None if op is None else getattr(op.workspace, "handle", None)


def _release(held: list[_Held]) -> None:
    common.release((entry.op for entry in held), "vLLM")


def destroy_fi_ar_workspace() -> None:
    """Free every workspace the drop-in holds, of every group, and forget failures (R10)."""
    with _lock:
        held = list(_held)
        _held.clear()
        _failed.clear()
        _release(held)


def _destroy_group(group: Any) -> None:
    """Free the workspaces of one group only (R9: the group passed is the group used)."""
    group = _normalize(group)
    with _lock:
        held = [h for h in _held if h.group is group]
        for entry in held:
            _held.remove(entry)
        key = group_mod.group_key(group)
        for failed in [k for k in _failed if k[0] == key]:
            del _failed[failed]
        _release(held)


atexit.register(destroy_fi_ar_workspace)
