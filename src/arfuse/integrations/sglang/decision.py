"""SGLang's flag and state, read where SGLang keeps them, and its backend rule on the fusion
group's agreed facts (one collective decision per group and setting)."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional

import torch

from ... import group as group_mod
from ... import log, policy
from ...settings import Settings
from ...spec import Spec
from ...topology import Topology
from .. import common

FLAG = "--flashinfer-allreduce-fusion-backend"
BACKEND_CHOICES = ("auto", "trtllm", "mnnvl", "cutedsl")
SM90, SM10X = (90,), (100, 103)
# sglang/srt/layers/layer_boundary/residual/add_norm.py: the largest fused batch, which also
# sizes the workspace SGLang pre-initialises; the resolver's capability question asks for it
FUSE_ALLREDUCE_MAX_BATCH_SIZE = 2048

# SGLang 0.5.23's own messages (``_resolve_backend``), raised where SGLang raises them
NEEDS_SM = "FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs."
CUTEDSL_NEEDS_BLACKWELL = ("FlashInfer allreduce fusion cutedsl backend requires a "
                           "Blackwell system.")
AUTO_MULTI_NODE = ("FlashInfer allreduce fusion does not support multi-node on "
                   "non-Blackwell systems.")
TRTLLM_MULTI_NODE = "FlashInfer allreduce fusion trtllm backend supports single-node only."
MNNVL_NEEDS = ("FlashInfer allreduce fusion mnnvl backend requires a Blackwell "
               "system, or SM90 single-node.")
_decisions: dict[tuple[str, str | None], GroupDecision] = {}


# --- SGLang's own state, read where SGLang keeps it -----------------------------------------


def _runtime() -> Any:
    return importlib.import_module("sglang.srt.runtime_context")


def backend_setting() -> str | None:
    """SGLang's published ``flashinfer_allreduce_fusion_backend`` (``None``: fusion off)."""
    value = _runtime().get_exec().comm.flashinfer_allreduce_fusion_backend
    if value is not None and value not in BACKEND_CHOICES:
        raise ValueError(f"{FLAG} must be one of {', '.join(BACKEND_CHOICES)} or unset, "
                         f"got {value!r}")
    return None if value is None else str(value)


def _flashinfer() -> tuple[ModuleType | None, bool]:
    """(``flashinfer.comm`` with the unified API, or None; whether FlashInfer is there but
    lacks it). As SGLang: only on CUDA."""
    if not torch.cuda.is_available():
        return None, False
    try:
        comm = importlib.import_module("flashinfer.comm")
    except Exception:  # ImportError, or CUDA errors raised while importing
        return None, False
    if hasattr(comm, "allreduce_fusion") and hasattr(comm, "create_allreduce_fusion_workspace"):
        return comm, False
    return None, True


def _comm() -> ModuleType | None:
    return _flashinfer()[0]


def uses_cutedsl_ar_fusion() -> bool:
    """Selected CuTe DSL owns both patterns, so the legacy workspace stands down."""
    return bool(_runtime().get_exec().comm.flashinfer_allreduce_fusion_backend == "cutedsl")


def resolve_fusion_world_size(*, use_attn_tp_group: bool) -> int:
    """Peer count of the fusion group (SGLang's: sizes only, no group coordinator)."""
    moe = importlib.import_module("sglang.srt.layers.moe.utils")
    parallel = _runtime().get_parallel()
    if use_attn_tp_group:
        return int(parallel.attn_tp_size)
    if moe.can_merge_post_experts_all_reduce():
        return int(parallel.tp_size)
    return int(parallel.moe_ep_size if parallel.moe_ep_size > 1 else parallel.moe_tp_size)


def resolve_fusion_group(*, use_attn_tp_group: bool) -> tuple[int, int, Any]:
    """(world_size, rank, coordinator) of the group the fused kernel reduces over."""
    parallel = _runtime().get_parallel()
    if use_attn_tp_group:
        return parallel.attn_tp_size, parallel.attn_tp_rank, parallel.attn_tp_group
    moe = importlib.import_module("sglang.srt.layers.moe.utils")
    group = moe.post_experts_reduction_group()
    return group.world_size, group.rank_in_group, group


# --- the decision (SGLang's rules, on the fusion group's facts) ------------------------------


def _auto_choice(topology: Topology) -> str | None:
    """The first fused backend arfuse's policy allows on the group (R2, R3), or None."""
    spec = Spec(max_tokens=FUSE_ALLREDUCE_MAX_BATCH_SIZE, hidden=4096)
    try:
        plan = policy.resolve(Settings(backend="auto", strict=True), topology, spec)
    except ValueError:  # strict, and no fused backend can run on this group
        return None
    return plan.viable[0] if plan.viable else None


def choose_backend(setting: str | None, topology: Topology) -> str | None:
    """SGLang's ``_resolve_backend`` on the group's topology, pure; ``auto`` by capability."""
    if setting is None:
        return None
    sm = topology.sm if topology.device == "cuda" else None
    if sm not in SM90 + SM10X:
        raise ValueError(NEEDS_SM)
    blackwell, multi_node = sm in SM10X, topology.node_count > 1
    if setting == "cutedsl":
        if not blackwell:
            raise ValueError(CUTEDSL_NEEDS_BLACKWELL)
        return setting
    if setting == "auto":
        if multi_node and not blackwell:
            raise ValueError(AUTO_MULTI_NODE)
        return _auto_choice(topology)
    if setting == "trtllm" and multi_node:
        raise ValueError(TRTLLM_MULTI_NODE)
    if setting == "mnnvl" and multi_node and not blackwell:
        raise ValueError(MNNVL_NEEDS)
    return setting


@dataclass(frozen=True)
class GroupDecision:
    """What every rank of the fusion group agreed on."""

    setting: str | None
    topology: Topology
    backend: str | None
    group_key: str
    rank: int


def _decline_cutedsl() -> None:
    log.once(logging.INFO, "sglang cutedsl", "arfuse SGLang drop-in: %s cutedsl is SGLang's "
             "CuTe DSL fusion, not arfuse's: arfuse creates no workspace for it, SGLang's CuTe "
             "DSL module stays in charge", FLAG)


def _flag() -> tuple[str | None, bool]:
    """(the flag, whether SGLang allows it), raising nothing: a rank whose flag is refused
    still meets its peers in the exchange, where its ``ValueError`` travels to them."""
    try:
        return backend_setting(), True
    except ValueError:
        return None, False


def _decide(group: Any) -> GroupDecision:
    """Collective on ``group``, once per group and setting (SGLang asks on every fused call).
    A refused flag is exchanged like any fact (``common.agree``): that rank raises its
    ``ValueError``, its peers ``PeerAborted``, at once and in step."""
    group = common.normalize(group)
    setting, allowed = _flag()
    cached = _decisions.get((group_mod.group_key(group), setting)) if allowed else None
    if cached is not None:
        return cached
    agreed = common.agree(group, common.cuda_if_available(), backend_setting, FLAG, "sglang")
    setting, topo = agreed.setting, agreed.topology
    backend = choose_backend(setting, topo)  # the same facts on every rank: all raise or none
    log.once(common.level(agreed.rank, logging.INFO),
             (agreed.group_key, setting, backend, topo.node_count),
             "arfuse SGLang drop-in, group %s (%d ranks, %d node(s), SM %s): %s %s -> %s",
             agreed.group_key, agreed.world_size, topo.node_count, topo.sm, FLAG, setting,
             backend)
    if backend == "cutedsl":
        _decline_cutedsl()
    decision = GroupDecision(setting, topo, backend, agreed.group_key, agreed.rank)
    _decisions[(agreed.group_key, setting)] = decision
    return decision


def _attention_cpu_group() -> Any:
    """The attention-TP group's gloo group; ``None`` (the default group) before groups exist."""
    try:
        return _runtime().get_parallel().attn_tp_group.cpu_group
    except (AttributeError, AssertionError, KeyError, ValueError):
        return None


def resolve_flashinfer_allreduce_fusion_backend() -> Optional[str]:  # noqa: UP045
    """The fusion backend for the attention-TP fusion group, or None when fusion is off or
    no fused backend pays on it. Collective on that group when a backend is set, or refused."""
    setting, allowed = _flag()
    if allowed and setting is None:
        return None
    return _decide(_attention_cpu_group()).backend

