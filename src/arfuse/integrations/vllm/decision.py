"""vLLM's backend rule on the group's agreed facts: ``VLLM_FLASHINFER_ALLREDUCE_BACKEND`` read
as vLLM reads it, vLLM's size tables, and the collective decision every getter and the
communicator start from."""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ... import log
from ...topology import Topology
from .. import common
from ..common import cuda_if_available as _device_kind
from ..common import level as _level
from ..common import normalize as _normalize

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
    known: tuple[Any, ...] = ()  # what each rank remembered of the request (``_decide``)


def _use_flashinfer_env() -> bool:
    return bool(int(os.getenv(ENV_USE_FLASHINFER, "1")))


def _tuned_max_size(decision: GroupDecision, world_size: int) -> int | None:
    """vLLM's ``_get_tuned_standalone_max_size``, on the group's SM and node count."""
    if decision.backend != "mnnvl" or decision.topology.sm is None:
        return None
    size_mb = FI_MNNVL_ALLREDUCE_MAX_SIZE_MB.get(
        (decision.topology.sm, world_size, decision.topology.node_count))
    return None if size_mb is None else int(size_mb * MiB)


def _decide(group: Any, device: str | None, check: Callable[[], None] = lambda: None,
            known: Callable[[], Any] = lambda: None) -> GroupDecision:
    """Collective on ``group``: every rank's setting and facts through the group's own store
    (``common.agree``), then vLLM's rule on the same facts on every rank. ``check``: the
    caller's checks of its arguments, which every rank learns the verdict of; ``known``: what
    this rank remembers of the request, which every rank learns too."""
    agreed = common.agree(group, device, backend_setting, ENV_BACKEND, "vllm", check, known)
    setting, topo = str(agreed.setting), agreed.topology
    backend, allow = choose_backend(setting, topo)
    log.once(_level(agreed.rank, logging.INFO),
             (agreed.group_key, setting, backend, allow, topo.node_count),
             "arfuse vLLM drop-in, group %s (%d ranks, %d node(s), SM %s): %s=%s -> backend %s, "
             "trtllm fallback %s", agreed.group_key, agreed.world_size, topo.node_count, topo.sm,
             ENV_BACKEND, setting, backend, "allowed" if allow else "no")
    return GroupDecision(setting, topo, backend, allow, agreed.group_key, agreed.rank,
                         agreed.known)


def resolve_fi_ar_backend(group: Any = None) -> tuple[str | None, bool]:
    """``(backend, allow_trtllm_fallback)`` for ``group`` (``None``: the default group, or one
    process); ``backend`` is ``None`` when ``auto`` has no supported backend for the group.

    Collective (vLLM's is too under ``auto``): every rank of the group must call it."""
    decision = _decide(_normalize(group), _device_kind())
    return decision.backend, decision.allow_trtllm_fallback


_resolve_fi_ar_backend = resolve_fi_ar_backend
