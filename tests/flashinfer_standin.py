"""A stand-in of FlashInfer 0.7.2.post1's fused all-reduce API for real gloo ranks (this machine
has no GPU; not a hardware test).

The minimum of ``test_flashinfer_backend``'s stand-in, kept apart so the vLLM drop-in's tests
do not follow that file's changes, plus what several processes need: the all-reduce really
sums over the workspace's group (arfuse validates with a known sum), creation exchanges handles
through the ``comm_backend`` it is handed (all ranks must arrive), workspaces hold FlashInfer's
own ``SymmDeviceMemory`` (checkpointable) or, with ``checkpoint=False``, torch's symmetric
memory (``NotImplementedError``), and ``flashinfer.comm`` exports what vLLM imports from it.
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

VERSION = "0.7.2.post1"
MIB = 1 << 20
WORLD_SIZES = {"mnnvl": {2, 4, 8, 16, 32, 64}, "trtllm": {2, 4, 8, 16}}


class SymmDeviceMemory:
    """FlashInfer's own cuMem allocation (``flashinfer.comm.mnnvl``)."""

    def __init__(self, size: int):
        self.allocation_size = size


class StandinWorkspace:
    """Sizing and sufficiency as FlashInfer computes them, the group it was made on, and the
    checkpoint calls it received."""

    def __init__(self, fake: StandinFlashInfer, kw: dict[str, Any]):
        self.backend, self.world_size, self.rank = kw["backend"], kw["world_size"], kw["rank"]
        self.group, self.comm, self._fake = kw.get("group"), kw["comm_backend"], fake
        self.elem = torch.tensor([], dtype=kw["dtype"]).element_size()
        self.max_token_num, self.hidden_dim = kw["max_token_num"], kw["hidden_dim"]
        self.mc_ptr = 0xABC
        self.destroyed = False
        self.checkpoints: list[tuple[str, Any]] = []
        row = self.hidden_dim * self.elem
        if self.backend == "trtllm":
            self.ipc_handles = [[1, 2]]
            size = 3 * self.world_size * self.max_token_num * row
            self.mem_handles = [SymmDeviceMemory(size)] if fake.checkpoint else [object()]
            return
        oneshot = min(MIB // (self.world_size * row), self.max_token_num)
        buffer = max(oneshot * self.world_size * row,
                     2 * math.ceil(self.max_token_num / self.world_size) * self.world_size * row)
        self.buffer_size_bytes = int(buffer * fake.buffer_scale)
        self.handle = types.SimpleNamespace(
            mcast_device_memory=SymmDeviceMemory(3 * buffer) if fake.checkpoint else None)

    def is_buffer_size_sufficient(self, tp_size: int, num_tokens: int, hidden_dim: int,
                                  dtype: Any, use_oneshot: Any = None) -> bool:
        if self.backend == "trtllm":
            return num_tokens * hidden_dim <= self.max_token_num * self.hidden_dim
        if num_tokens * hidden_dim * tp_size * self.elem <= MIB:
            need = num_tokens * hidden_dim * tp_size * self.elem
        else:
            need = 2 * math.ceil(num_tokens / tp_size) * tp_size * hidden_dim * self.elem
        return need <= self.buffer_size_bytes

    def checkpoint_prepare(self) -> None:
        if not self._fake.checkpoint:
            raise NotImplementedError("Stable-VA checkpointing is unavailable for workspaces "
                                      "backed by torch symmetric memory")
        self.comm.barrier()  # FlashInfer's: the comm_backend kept from creation
        self.checkpoints.append(("prepare", None))

    def checkpoint_restore(self, comm_backend: Any) -> None:
        if not self._fake.checkpoint:
            raise NotImplementedError("Stable-VA checkpointing is unavailable for workspaces "
                                      "backed by torch symmetric memory")
        comm_backend.allgather(f"handle-{self.rank}")
        comm_backend.barrier()
        self.checkpoints.append(("restore", getattr(comm_backend, "group", None)))

    def destroy(self) -> None:
        self.destroyed = True


class StandinFlashInfer:
    """``multicast(rank)`` says which ranks have NVSwitch multicast; ``buffer_scale`` shrinks
    mnnvl's buffers (a workspace that holds fewer tokens than asked for)."""

    def __init__(self, multicast: Callable[[int], bool] | None = None,
                 buffer_scale: float = 1.0, checkpoint: bool = True):
        self.multicast = multicast or (lambda rank: True)
        self.buffer_scale, self.checkpoint = buffer_scale, checkpoint
        self.created: list[dict[str, Any]] = []
        self.workspaces: list[StandinWorkspace] = []
        self.calls: list[dict[str, Any]] = []
        self.destroyed_ipc: list[Any] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fake = self

        class TorchDistBackend:
            def __init__(self, group: Any = None):
                self.group = group

        def create_allreduce_fusion_workspace(**kw: Any) -> StandinWorkspace:
            """Like FlashInfer: local checks, the handle exchange through ``comm_backend``
            (every rank must arrive), a closing barrier."""
            rank, comm = kw["rank"], kw["comm_backend"]
            fake.created.append(kw)
            if kw["backend"] == "mnnvl" and not fake.multicast(rank):
                raise RuntimeError("[SymmDeviceMemory] Device does not support multicasting.")
            comm.allgather(f"handle-{rank}")
            comm.bcast("mc-handle" if rank == 0 else None, root=0)
            ws = StandinWorkspace(fake, kw)
            comm.barrier()
            fake.workspaces.append(ws)
            return ws

        def allreduce_fusion(**kw: Any) -> torch.Tensor:
            fake.calls.append(kw)
            x, ws = kw["input"], kw["workspace"]
            if not isinstance(ws, StandinWorkspace) or ws.destroyed:
                raise RuntimeError("allreduce_fusion needs a live FlashInfer workspace")
            total = x.float().clone()
            if ws.group is not None and ws.world_size > 1:
                dist.all_reduce(total, group=ws.group)
            summed = total.to(x.dtype)
            if kw["pattern"] == 0:
                out = kw.get("output")
                out = torch.empty_like(x) if out is None else out
                out.copy_(summed)
                return out
            residual_out = summed + kw["residual_in"]
            kw["residual_out"].copy_(residual_out)
            kw["norm_out"].copy_(residual_out)
            return kw["norm_out"]

        def destroy_ipc(workspace: Any, group: Any = None) -> None:
            fake.destroyed_ipc.append((workspace, group))

        patterns = types.SimpleNamespace(kAllReduce=0, kARResidualRMSNorm=1,
                                         kARResidualRMSNormFP8Quant=2,
                                         kARResidualRMSNormFP4Quant=3)
        allreduce = types.ModuleType("flashinfer.comm.allreduce")
        mnnvl = types.ModuleType("flashinfer.comm.mnnvl")
        trtllm_ar = types.ModuleType("flashinfer.comm.trtllm_ar")
        comm = types.ModuleType("flashinfer.comm")
        utils = types.ModuleType("flashinfer.utils")
        root = types.ModuleType("flashinfer")
        for module in (allreduce, comm):
            module.create_allreduce_fusion_workspace = (  # type: ignore[attr-defined]
                create_allreduce_fusion_workspace)
            module.allreduce_fusion = allreduce_fusion  # type: ignore[attr-defined]
        comm.AllReduceFusionPattern = patterns  # type: ignore[attr-defined]
        comm.allreduce, comm.mnnvl, comm.trtllm_ar = allreduce, mnnvl, trtllm_ar  # type: ignore[attr-defined]
        mnnvl.TorchDistBackend = TorchDistBackend  # type: ignore[attr-defined]
        mnnvl.SymmDeviceMemory = SymmDeviceMemory  # type: ignore[attr-defined]
        mnnvl.is_multicast_supported = lambda device: True  # type: ignore[attr-defined]
        mnnvl.is_mnnvl_fabric_supported = lambda device: False  # type: ignore[attr-defined]
        trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion = destroy_ipc  # type: ignore[attr-defined]
        utils.is_confidential_compute = lambda: False  # type: ignore[attr-defined]
        root.comm, root.utils, root.__version__ = comm, utils, VERSION  # type: ignore[attr-defined]
        for name, module in {"flashinfer": root, "flashinfer.comm": comm,
                             "flashinfer.comm.allreduce": allreduce,
                             "flashinfer.comm.mnnvl": mnnvl,
                             "flashinfer.comm.trtllm_ar": trtllm_ar,
                             "flashinfer.utils": utils}.items():
            monkeypatch.setitem(sys.modules, name, module)
        self._allow_without_cuda(monkeypatch)

    def _allow_without_cuda(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The FlashInfer backends' local check wants CUDA; here it answers as it would on a
        GPU rank with or without multicast. The group's topology (``ARFUSE_TOPOLOGY``) still
        decides everything else."""
        from arfuse.backends.flashinfer import workspace

        fake = self

        def local_check(backend: Any, ctx: Any, spec: Any) -> str:
            sizes = getattr(workspace, "WORLD_SIZES", WORLD_SIZES)[backend.name]
            if ctx.world_size not in sizes:
                return f"world size {ctx.world_size} not in {sorted(sizes)}"
            if backend.name == "mnnvl" and not fake.multicast(ctx.rank):
                return "this GPU reports no multicast support (stand-in)"
            return ""

        monkeypatch.setattr(workspace.FlashInferBackend, "local_check", local_check)
