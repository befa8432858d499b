"""The rows of a MoE bench (``arfuse bench --pattern moe_finalize`` or ``moe_reduce``): the
fused call, and torch's expert step (``moe_workload.torch_expert_step``) before what users run
without it: arfuse's fused all-reduce, torch's all-reduce (gloo) + add + RMSNorm, DeepSpeed's
all-reduce + add + RMSNorm."""

from __future__ import annotations

from typing import Any

import torch

from ..moe_workload import ExpertRows, torch_expert_step
from .baselines import rmsnorm_add
from .options import EPS
from .timing import Row

FUSED_ROW = "shm"
EXPERT_STEP_ROWS = ("torch-step+shm", "torch", "torch-step+deepspeed+norm")
"""The unfused rows, each torch's expert step first (``torch`` is the baseline's name)."""


def moe_rows(comm: Any, inputs: ExpertRows, residual: torch.Tensor, weight: torch.Tensor,
             ds: Any, with_torch: bool) -> dict[str, Row]:
    """The fused call (when ``comm``), and torch's expert step before arfuse's fused op (when
    ``comm``), before gloo's all-reduce + add + RMSNorm (``with_torch``) and before DeepSpeed's
    all-reduce + add + RMSNorm (when ``ds``). No row overwrites its inputs."""
    import torch.distributed as dist

    def step() -> torch.Tensor:
        return torch_expert_step(inputs, has_none=False)

    def gloo() -> None:
        x = step()
        dist.all_reduce(x)
        rmsnorm_add(x, residual, weight)

    def deepspeed() -> None:
        x = step()
        ds.inference_all_reduce(x)
        rmsnorm_add(x, residual, weight)

    rows: dict[str, Row] = {}
    if comm is not None:
        rows[FUSED_ROW] = (lambda: inputs.call(comm, residual=residual, weight=weight,
                                               eps=EPS), None)
        rows["torch-step+shm"] = (lambda: comm(step(), residual=residual, weight=weight,
                                             eps=EPS), None)
    if with_torch:
        rows["torch"] = (gloo, None)
    if ds is not None:
        rows["torch-step+deepspeed+norm"] = (deepspeed, None)
    return rows


def expert_bytes(inputs: ExpertRows) -> tuple[int, int]:
    """Bytes of the expert rows a call reads, and of its shared expert or token input."""
    add = 0 if inputs.add is None else inputs.add.numel() * inputs.add.element_size()
    return inputs.rows.numel() * inputs.rows.element_size(), add
