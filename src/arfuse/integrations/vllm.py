"""Drop-in for vLLM 0.33.0's ``vllm/distributed/device_communicators/flashinfer_all_reduce.py``.

Same names, signatures and return values as that module (``docs/vllm.md`` has the patch that
makes vLLM's module re-export these), but every decision goes through arfuse, so vLLM inherits
what arfuse designs out (``docs/design.md``, R1-R10):

* the backend follows ``VLLM_FLASHINFER_ALLREDUCE_BACKEND`` (``auto``, ``trtllm``, ``mnnvl``;
  case-sensitive, default ``auto``) with vLLM's rules: an explicit choice never falls back;
  ``auto`` is ``mnnvl`` with a ``trtllm`` fallback on one node, ``mnnvl`` alone across nodes on
  SM >= 100, nothing otherwise; explicit ``trtllm`` across nodes is vLLM's ``ValueError``;
* the node count is that of the group passed (R6), from facts every rank sends through that
  group's own store (R7, R9), with arfuse's deadline on every exchange (R8);
* workspaces are negotiated by ``FusedAllReduce`` and kept by arfuse's registry: all ranks
  create, vote and validate together (R2, R7); ``auto`` skips trtllm without NVLink between all
  pairs (R3); one workspace per group serves plain and quantised fusion (R5); a workspace is
  reused only when group, hidden size, dtype and capacity fit, else a larger one replaces it
  (R4); the getters return only a workspace that really holds ``max_token_num`` tokens and
  the standalone all-reduce admits only what its workspace holds (R1);
  ``destroy_fi_ar_workspace`` frees everything (R10).

The getters return FlashInfer's own workspace object (``allreduce_fusion`` dispatches on its
type), or ``None`` when no FlashInfer workspace can serve the group. vLLM passes its CPU (gloo)
group while its tensors are CUDA: the workspace is made for CUDA whenever CUDA is available.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from .. import group as group_mod
from .. import log, negotiate
from .. import topology as topology_mod
from ..dtypes import parse_dtype
from ..errors import NegotiationError
from ..ops import FusedAllReduce
from ..spec import Spec
from ..topology import Topology
from ..torch_types import TORCH_DTYPES
from . import common
from .common import DROP_IN_TIMEOUT_S, FLASHINFER_BACKENDS, drop_in_timeout_s
from .common import cuda_if_available as _device_kind
from .common import level as _level
from .common import normalize as _normalize
from .common import rank_and_size as _rank_and_size

__all__ = [
    "BACKEND_CHOICES",
    "DROP_IN_TIMEOUT_S",
    "ENV_BACKEND",
    "FI_ALLREDUCE_FUSION_MAX_SIZE_MB",
    "FI_MNNVL_ALLREDUCE_MAX_SIZE_MB",
    "PDL_ADVANCE_LAUNCH_TOKENS",
    "FlashInferAllReduce",
    "MiB",
    "backend_setting",
    "checkpoint_prepare_fi_ar_workspaces",
    "checkpoint_restore_fi_ar_workspaces",
    "choose_backend",
    "destroy_fi_ar_workspace",
    "drop_in_timeout_s",
    "fi_ar_available",
    "flashinfer_comm",
    "get_fi_ar_quant_workspace",
    "get_fi_ar_workspace",
    "resolve_fi_ar_backend",
]

# The empirical value for small batch (vLLM: allreduce completes at the end above it)
PDL_ADVANCE_LAUNCH_TOKENS = 16
MiB = 1024 * 1024

# vllm/envs.py: env_with_choices("VLLM_FLASHINFER_ALLREDUCE_BACKEND", "auto",
# ["auto", "trtllm", "mnnvl"]), case-sensitive
ENV_BACKEND = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"
BACKEND_CHOICES: list[str] = ["auto", "trtllm", "mnnvl"]
DEFAULT_BACKEND = "auto"
# vllm/envs.py: bool(int(os.getenv("VLLM_ALLREDUCE_USE_FLASHINFER", "1")))
ENV_USE_FLASHINFER = "VLLM_ALLREDUCE_USE_FLASHINFER"

# vLLM 0.33.0 vllm/compilation/passes/fusion/allreduce_rms_fusion.py: the largest input (MB)
# per SM and world size that FlashInferAllReduce admits (scripts/vllm_check.sh compares them)
FI_ALLREDUCE_FUSION_MAX_SIZE_MB: dict[int, dict[int, float]] = {
    90: {2: 64, 4: 2, 8: 0.5},
    100: {2: 64, 4: 32, 8: 1, 16: 64},
    103: {2: 64, 4: 64, 8: 4, 16: 64},
    107: {2: 64, 4: 64, 8: 2},
}
# vLLM 0.33.0 vllm/distributed/device_communicators/all_reduce_utils.py: tuned mnnvl sizes (MB)
# per (SM, world size, node count)
FI_MNNVL_ALLREDUCE_MAX_SIZE_MB: dict[tuple[int, int, int], float] = {
    (100, 8, 1): 128,
    (100, 8, 2): 128,
    (103, 4, 1): 80,
    (103, 8, 1): 128,
    (103, 8, 2): 128,
    (103, 16, 4): 8,
}

_TRTLLM_MULTI_NODE = ("Flashinfer allreduce is not supported for multi-node allreduce with "
                      "'trtllm' backend. Please use 'mnnvl' backend instead.")
_TRTLLM_MULTI_NODE_QUANT = ("Flashinfer allreduce quantization fusion is not supported for "
                            "multi-node allreduce with 'trtllm' backend. Please use 'mnnvl' "
                            "backend instead.")
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_GROWTH = 8  # a workspace regrown for R1 is at most this many times the one that fell short


def _load_flashinfer_comm() -> ModuleType | None:
    """``flashinfer.comm`` with ``TorchDistBackend``, as vLLM imports them; ``None`` if absent."""
    try:
        comm = importlib.import_module("flashinfer.comm")
        importlib.import_module("flashinfer.comm.mnnvl").TorchDistBackend  # noqa: B018
    except Exception:  # ImportError, or CUDA errors raised while importing
        return None
    return comm


flashinfer_comm: ModuleType | None = _load_flashinfer_comm()
fi_ar_available: bool = flashinfer_comm is not None and hasattr(flashinfer_comm,
                                                                "allreduce_fusion")


def _flashinfer_available() -> bool:
    """Checked again at use: FlashInfer may become importable after this module (tests)."""
    if fi_ar_available:
        return True
    comm = _load_flashinfer_comm()
    return comm is not None and hasattr(comm, "allreduce_fusion")


# --- the decision (vLLM's rules on the group's facts) -------------------------------------------


def backend_setting(env: Mapping[str, str] | None = None) -> str:
    """``VLLM_FLASHINFER_ALLREDUCE_BACKEND`` validated as vLLM's ``env_with_choices`` does:
    unset is ``auto``; anything but an exact allowed value is vLLM's ``ValueError``."""
    value = (os.environ if env is None else env).get(ENV_BACKEND)
    if value is None:
        return DEFAULT_BACKEND
    if value not in BACKEND_CHOICES:
        raise ValueError(f"Invalid value '{value}' for {ENV_BACKEND}. "
                         f"Valid options: {BACKEND_CHOICES}.")
    return value


def choose_backend(setting: str, topology: Topology) -> tuple[str | None, bool]:
    """vLLM's ``_resolve_fi_ar_backend`` rule, pure: ``(backend, allow_trtllm_fallback)``."""
    if setting != "auto":
        return setting, False
    if topology.node_count == 1:
        return "mnnvl", True
    if (topology.sm or 0) >= 100:  # MNNVL across nodes needs Blackwell-class GPUs
        return "mnnvl", False
    return None, False


@dataclass(frozen=True)
class GroupDecision:
    """What every rank of the group agreed on: the setting, the group's topology, the backend."""

    setting: str
    topology: Topology
    backend: str | None
    allow_trtllm_fallback: bool
    group_key: str
    rank: int


def _use_flashinfer_env() -> bool:
    return bool(int(os.getenv(ENV_USE_FLASHINFER, "1")))


def _tuned_max_size(decision: GroupDecision, world_size: int) -> int | None:
    """vLLM's ``_get_tuned_standalone_max_size``, on the group's SM and node count."""
    if decision.backend != "mnnvl" or decision.topology.sm is None:
        return None
    size_mb = FI_MNNVL_ALLREDUCE_MAX_SIZE_MB.get(
        (decision.topology.sm, world_size, decision.topology.node_count))
    return None if size_mb is None else int(size_mb * MiB)


def _decide(group: Any, device: str | None,
            check: Callable[[], None] = lambda: None) -> GroupDecision:
    """Collective on ``group``: every rank's setting and facts through the group's own store
    (``common.agree``), then vLLM's rule on the same facts on every rank. ``check``: the
    caller's checks of its arguments, which every rank learns the verdict of."""
    agreed = common.agree(group, device, backend_setting, ENV_BACKEND, "vllm", check)
    setting, topo = str(agreed.setting), agreed.topology
    backend, allow = choose_backend(setting, topo)
    log.once(_level(agreed.rank, logging.INFO),
             (agreed.group_key, setting, backend, allow, topo.node_count),
             "arfuse vLLM drop-in, group %s (%d ranks, %d node(s), SM %s): %s=%s -> backend %s, "
             "trtllm fallback %s", agreed.group_key, agreed.world_size, topo.node_count, topo.sm,
             ENV_BACKEND, setting, backend, "allowed" if allow else "no")
    return GroupDecision(setting, topo, backend, allow, agreed.group_key, agreed.rank)


def resolve_fi_ar_backend(group: Any = None) -> tuple[str | None, bool]:
    """``(backend, allow_trtllm_fallback)`` for ``group`` (``None``: the default group, or one
    process); ``backend`` is ``None`` when ``auto`` has no supported backend for the group.

    Collective (vLLM's is too under ``auto``): every rank of the group must call it."""
    decision = _decide(_normalize(group), _device_kind())
    return decision.backend, decision.allow_trtllm_fallback


_resolve_fi_ar_backend = resolve_fi_ar_backend


# --- the workspaces vLLM holds ------------------------------------------------------------------


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
# collective, so a failure is not retried on every call (as vLLM does); destroy forgets them
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
            if max_token_num >= _failed.get(_failure_key(group, spec), max_token_num + 1):
                return None
        _drop_dead()
        decision = _decide(group, device, check)
        assert spec is not None  # this rank's check raised above otherwise
        key = _failure_key(group, spec)
        if decision.backend == "trtllm" and decision.topology.node_count > 1:
            raise ValueError(_TRTLLM_MULTI_NODE_QUANT if quant else _TRTLLM_MULTI_NODE)
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


# --- checkpointing (suspend / resume) -----------------------------------------------------------


def _workspaces_of(group: Any) -> list[Any]:
    group = _normalize(group)
    seen: set[int] = set()
    found: list[Any] = []
    for held in _held:
        if held.group is group and held.live and id(held.op.workspace) not in seen:
            seen.add(id(held.op.workspace))
            found.append(held.op.workspace)
    return found


def _checkpoint(workspace: Any, phase: str, group: Any) -> None:
    """arfuse's own checkpoint methods where the workspace has them, else FlashInfer's."""
    supports = getattr(workspace, "supports_checkpoint", None)
    method = getattr(workspace, f"checkpoint_{phase}", None)
    if supports is not None and method is not None:
        if callable(supports):
            supports = supports()
        if not supports:
            raise NotImplementedError(f"the arfuse {workspace.backend} workspace does not "
                                      "support checkpointing")
        method()
        return
    handle = workspace.handle
    if not hasattr(handle, f"checkpoint_{phase}"):
        raise NotImplementedError(f"FlashInfer's {type(handle).__name__} has no "
                                  f"checkpoint_{phase} (FlashInfer >= 0.7 has)")
    if phase == "prepare":
        handle.checkpoint_prepare()
    else:
        mnnvl = importlib.import_module("flashinfer.comm.mnnvl")
        handle.checkpoint_restore(mnnvl.TorchDistBackend(group=_normalize(group)))


def _checkpoint_all(group: Any, phase: str, skip_unsupported: bool) -> None:
    with _lock:
        for workspace in _workspaces_of(group):
            try:
                _checkpoint(workspace, phase, group)
            except NotImplementedError:
                if not skip_unsupported:
                    raise
                log.once(logging.INFO, ("vllm-checkpoint", workspace.backend),
                         "arfuse vLLM drop-in: the FlashInfer %s workspace cannot be "
                         "checkpointed; it stays resident during suspend", workspace.backend)


def checkpoint_prepare_fi_ar_workspaces(group: Any, skip_unsupported: bool = False) -> None:
    """Detach the physical memory of this group's workspaces (collective, as FlashInfer's)."""
    _checkpoint_all(group, "prepare", skip_unsupported)


def checkpoint_restore_fi_ar_workspaces(group: Any, skip_unsupported: bool = False) -> None:
    """Map this group's workspaces again, exchanging handles on this very group."""
    _checkpoint_all(group, "restore", skip_unsupported)


# --- the standalone all-reduce ------------------------------------------------------------------


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
        """The sum over the group, through arfuse's op on the FlashInfer workspace."""
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
