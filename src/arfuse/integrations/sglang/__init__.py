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

Modules: ``decision`` (SGLang's flag and state, its rule on the group's facts), ``workspaces``
(the per-group manager, the TP-wide "disabled" flag, pre-initialisation, cleanup), ``calls``
(the fused calls).
"""

from __future__ import annotations

from .calls import (
    can_use_flashinfer_allreduce,
    fake_flashinfer_allreduce_residual_rmsnorm,
    flashinfer_allreduce,
    flashinfer_allreduce_residual_rmsnorm,
)
from .decision import (
    AUTO_MULTI_NODE,
    BACKEND_CHOICES,
    CUTEDSL_NEEDS_BLACKWELL,
    FLAG,
    FUSE_ALLREDUCE_MAX_BATCH_SIZE,
    MNNVL_NEEDS,
    NEEDS_SM,
    TRTLLM_MULTI_NODE,
    backend_setting,
    choose_backend,
    resolve_flashinfer_allreduce_fusion_backend,
    resolve_fusion_group,
    resolve_fusion_world_size,
    uses_cutedsl_ar_fusion,
)
from .workspaces import (
    FlashInferWorkspaceManager,
    _get_workspace_manager,  # noqa: F401  (benchmarks/gpu_check.py reads the managers)
    cleanup_flashinfer_workspace,
    ensure_workspace_initialized,
    is_flashinfer_allreduce_unavailable,
    pre_initialize_workspaces,
)

__all__ = [
    "AUTO_MULTI_NODE",
    "BACKEND_CHOICES",
    "CUTEDSL_NEEDS_BLACKWELL",
    "FLAG",
    "FUSE_ALLREDUCE_MAX_BATCH_SIZE",
    "MNNVL_NEEDS",
    "NEEDS_SM",
    "TRTLLM_MULTI_NODE",
    "FlashInferWorkspaceManager",
    "backend_setting",
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
