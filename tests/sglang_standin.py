"""A stand-in of what ``arfuse.integrations.sglang`` reads of SGLang 0.5.23, for ranks where
SGLang is not installed: ``tests/test_sglang_dropin.py`` and the SGLang rows of
``benchmarks/gpu_check.py``. scripts/sglang_check.sh runs the drop-in against the real SGLang.

What the drop-in reads: the published flag (``get_exec().comm.
flashinfer_allreduce_fusion_backend``), the parallel sizes and group coordinators
(``get_parallel()``), the managers' home (``get_resources().buffers``), all in
``sglang.srt.runtime_context``, and the MoE reduction group (``sglang.srt.layers.moe.utils``).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from arfuse.integrations import common


def coordinator(cpu_group: Any, device_group: Any = None) -> Any:
    """SGLang's GroupCoordinator as the drop-in uses it: its gloo ``cpu_group`` and its
    ``device_group`` (NCCL on a GPU machine; the gloo group itself here by default)."""
    rank, size = common.rank_and_size(cpu_group)
    return types.SimpleNamespace(world_size=size, rank_in_group=rank, cpu_group=cpu_group,
                                 device_group=cpu_group if device_group is None
                                 else device_group)


class SGLang:
    """One TP group (attention-TP, TP and the MoE reduction group alike) and the flag."""

    def __init__(self, setting: str | None, cpu_group: Any = None, device_group: Any = None,
                 nnodes: int = 1):
        self.exec = types.SimpleNamespace(comm=types.SimpleNamespace(
            flashinfer_allreduce_fusion_backend=setting))
        group = coordinator(cpu_group, device_group)
        size, rank = group.world_size, group.rank_in_group
        self.parallel = types.SimpleNamespace(
            attn_tp_size=size, attn_tp_rank=rank, attn_tp_group=group, tp_size=size,
            tp_group=group, moe_ep_size=1, moe_tp_size=size, nnodes=nnodes)
        self.resources = types.SimpleNamespace(buffers={})

    def install(self, mp: pytest.MonkeyPatch) -> None:
        runtime = types.ModuleType("sglang.srt.runtime_context")
        runtime.get_exec = lambda: self.exec  # type: ignore[attr-defined]
        runtime.get_parallel = lambda: self.parallel  # type: ignore[attr-defined]
        runtime.get_resources = lambda: self.resources  # type: ignore[attr-defined]
        moe = types.ModuleType("sglang.srt.layers.moe.utils")
        moe.can_merge_post_experts_all_reduce = lambda: True  # type: ignore[attr-defined]
        moe.post_experts_reduction_group = (  # type: ignore[attr-defined]
            lambda: self.parallel.tp_group)
        mp.setitem(sys.modules, "sglang.srt.runtime_context", runtime)
        mp.setitem(sys.modules, "sglang.srt.layers.moe.utils", moe)
