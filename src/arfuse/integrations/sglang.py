"""Drop-in for SGLang 0.5.23's ``sglang/srt/layers/flashinfer_comm_fusion.py``.

Same public names, signatures and return conventions as that module (``docs/sglang.md`` has the
patch that makes SGLang's module re-export these); the groups still come from SGLang's own
``parallel_state`` (attention-TP or the MoE reduction group), but every decision goes through
arfuse (``docs/design.md``, R1-R10):

* ``--flashinfer-allreduce-fusion-backend`` (``auto``, ``trtllm``, ``mnnvl``, ``cutedsl``) is
  validated with SGLang's own rules and messages, on the node count of the fusion group (R6),
  not of the launch; ``auto`` is the first fused backend the group's capability allows (mnnvl
  with multicast on every rank, and a fabric across nodes; trtllm on one node only with NVLink
  between all pairs, R3), or ``None``; an explicit choice is never replaced by another;
  ``cutedsl`` is SGLang's CuTe DSL fusion, not arfuse's: declined here with a log line;
* the group's setting and facts are exchanged through the group's own store, under the
  drop-in's deadline (R7, R8, R9); workspaces are negotiated by ``FusedAllReduce``: every rank
  creates, votes and validates together, so a failed creation falls back (``auto``) or
  declines on every rank at once; fp32 works on every FlashInfer version (no
  ``use_fp32_lamport`` argument, which 0.7.2.post1 does not take);
* a workspace serves a call only when FlashInfer's ``is_buffer_size_sufficient`` says it holds
  it (R1); cleanup frees everything (R10).

The managers hold FlashInfer's own workspace object (``workspace``), which SGLang's callers
hand to ``allreduce_fusion``. Nothing here imports SGLang until a function needs its state.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional, Tuple, TypeVar  # noqa: UP035  (torch's op schema reads them)

import torch

from .. import group as group_mod
from .. import log, negotiate, policy
from ..errors import NegotiationError
from ..ops import FusedAllReduce
from ..settings import Settings
from ..spec import Spec
from ..topology import Topology
from . import common
from .common import FLASHINFER_BACKENDS, drop_in_timeout_s

__all__ = [
    "BACKEND_CHOICES",
    "FLAG",
    "FlashInferWorkspaceManager",
    "can_use_flashinfer_allreduce",
    "choose_backend",
    "cleanup_flashinfer_workspace",
    "ensure_workspace_initialized",
    "fake_flashinfer_allreduce_residual_rmsnorm",
    "flashinfer_allreduce",
    "flashinfer_allreduce_residual_rmsnorm",
    "is_flashinfer_allreduce_unavailable",
    "pre_initialize_workspaces",
    "resolve_flashinfer_allreduce_fusion_backend",
    "resolve_fusion_group",
    "resolve_fusion_world_size",
    "uses_cutedsl_ar_fusion",
]

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
_MANAGERS = {True: "flashinfer_fusion_attn_tp_workspace",
             False: "flashinfer_fusion_moe_tp_workspace"}

F = TypeVar("F", bound=Callable[..., Any])
_unavailable = False  # SGLang's "disabled permanently" flag, agreed across TP
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


def is_flashinfer_allreduce_unavailable() -> bool:
    return _unavailable or _flashinfer()[1]


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


def _decide(group: Any) -> GroupDecision:
    """Collective on ``group``, once per group and setting (SGLang asks on every fused call)."""
    group = common.normalize(group)
    cached = _decisions.get((group_mod.group_key(group), backend_setting()))
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
    no fused backend pays on it. Collective on that group when a backend is set."""
    if backend_setting() is None:
        return None
    return _decide(_attention_cpu_group()).backend


# --- the workspaces ---------------------------------------------------------------------------


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
    if _unavailable or _comm() is None:
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
