"""The FlashInfer glue, driven through a stand-in of FlashInfer's unified API (this machine has
no GPU): what it passes, what it checks, what it frees, how creation ends when one rank fails.
Not a hardware test; ``tests/contract/flashinfer_contract.py`` checks the real packages' API.

The stand-in behaves as the FlashInfer version it is given (0.6.13 or 0.7.2.post1): allocation
sizes, checkpoint methods, the multicast check before its handle exchange, and the exchange
itself through the ``comm_backend`` it is handed (allgather, bcast, barrier)."""

from __future__ import annotations

import math
import os
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from arfuse import catalog
from arfuse.backends import flashinfer
from arfuse.backends.flashinfer import comm as fi_comm
from arfuse.backends.flashinfer import probe, sizes
from arfuse.backends.flashinfer.workspace import (
    FlashInferBackend,
    MnnvlBackend,
    TrtllmBackend,
    trtllm_use_oneshot,
)
from arfuse.call_checks import CallArgs
from arfuse.errors import ArfuseError, CreationFailed, PeerAborted
from arfuse.group import GroupContext
from arfuse.negotiate import _try
from arfuse.pattern import Pattern
from arfuse.rendezvous import Channel
from arfuse.settings import Settings
from arfuse.spec import Spec
from arfuse.topology import Topology
from arfuse.torch_types import TORCH_DTYPES

MIB = 1 << 20
BACKENDS: dict[str, type[FlashInferBackend]] = {"mnnvl": MnnvlBackend, "trtllm": TrtllmBackend}
OLD, NEW = "0.6.13", "0.7.2.post1"


def _v(version: str) -> tuple[int, ...]:
    return sizes.version_tuple(version)


def _round_up(value: int, to: int) -> int:
    return -(-value // to) * to


class SymmDeviceMemory:
    """Stands for ``flashinfer.comm.mnnvl.SymmDeviceMemory``."""


class FakeSymmDeviceMemory(SymmDeviceMemory):
    """FlashInfer's own allocation (>= 0.6.15): ``round_up(size + 2048, granularity)``, to the
    multicast granularity too when multicast is on."""

    def __init__(self, size: int, multicast: bool, granularity: int, mc_granularity: int):
        self.allocation_size = _round_up(size + 2048, granularity)
        if multicast:
            self.allocation_size = _round_up(self.allocation_size, mc_granularity)


class Wire:
    """What the GPUs would exchange, for stand-in ranks that are threads of one process."""

    def __init__(self, world: int):
        self.world = world
        self.slots: dict[int, torch.Tensor] = {}
        self.barrier = threading.Barrier(world)

    def sum(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = x.clone()
        self.barrier.wait(timeout=10)
        total = self.slots[0].clone()
        for r in range(1, self.world):
            total += self.slots[r]
        self.barrier.wait(timeout=10)
        return total


class FakeWorkspace:
    """Sizing and sufficiency as FlashInfer computes them (independently written)."""

    def __init__(self, fake: FakeFlashInfer, backend: str, world_size: int, rank: int,
                 max_token_num: int, hidden_dim: int, dtype: torch.dtype, comm: Any):
        self.fake, self.backend, self.world_size, self.rank = fake, backend, world_size, rank
        self.elem = torch.tensor([], dtype=dtype).element_size()
        self.max_token_num, self.hidden_dim = max_token_num, hidden_dim
        self.mc_ptr = fake.mc_ptr
        self.comm = comm
        self.destroyed = False
        self.events: list[str] = []
        version = _v(fake.version)
        own_memory = version >= (0, 6, 15)
        if backend == "trtllm":
            self.ipc_handles = [[1, 2]]
            lamport = 4 if self.elem == 4 else 2
            buffer = lamport if version >= (0, 7, 2) else 2
            wth = world_size * max_token_num * hidden_dim
            requested = [wth * buffer, world_size * 256 * 4, 3 * wth * lamport]
            self.mem_handles = [
                FakeSymmDeviceMemory(_round_up(s, 16), False, fake.granularity,
                                     fake.mc_granularity) if own_memory else object()
                for s in requested]
            return
        self.ipc_handles = None
        row = hidden_dim * self.elem
        oneshot_tokens = min(MIB // (world_size * row), max_token_num)
        requested = max(oneshot_tokens * world_size * row,
                        2 * math.ceil(max_token_num / world_size) * world_size * row)
        if version >= (0, 6, 18):
            requested = _round_up(requested, 32)
        if own_memory:
            memory = FakeSymmDeviceMemory(3 * requested, True, fake.granularity,
                                          fake.mc_granularity)
            self.handle = types.SimpleNamespace(mcast_device_memory=memory)
            align = 32 if version >= (0, 6, 18) else 16
            self.buffer_size_bytes = (memory.allocation_size - 2048) // 3 // align * align
        else:
            self.handle = types.SimpleNamespace(buffer_size=3 * requested)  # torch's
            self.buffer_size_bytes = requested
        self.buffer_size_bytes = int(self.buffer_size_bytes * fake.buffer_scale)
        self.workspace_size_bytes = 3 * self.buffer_size_bytes

    def is_buffer_size_sufficient(self, tp: int, tokens: int, hidden: int, dtype: Any,
                                  strategy: Any = None) -> bool:
        if self.backend == "trtllm":
            return tokens * hidden <= self.max_token_num * self.hidden_dim
        if tokens * hidden * tp * self.elem <= MIB:
            need = tokens * hidden * tp * self.elem
        else:
            need = 2 * math.ceil(tokens / tp) * tp * hidden * self.elem
        return need <= self.buffer_size_bytes

    def destroy(self) -> None:
        self.destroyed = True


class CheckpointingWorkspace(FakeWorkspace):
    """FlashInfer >= 0.6.15: release and restore the memory, exchanging through a comm."""

    def checkpoint_prepare(self) -> None:
        self.comm.barrier()  # FlashInfer's: the comm_backend stored at creation
        self.events.append("prepare")

    def checkpoint_restore(self, comm_backend: Any) -> None:
        comm_backend.allgather(f"handle-{self.rank}")
        comm_backend.barrier()
        self.events.append("restore")
        self.restored_with = comm_backend


UNIFIED_PARAMETERS = frozenset((
    "input", "workspace", "pattern", "launch_with_pdl", "trigger_completion_at_end", "output",
    "residual_out", "norm_out", "quant_out", "scale_out", "residual_in", "rms_gamma",
    "rms_eps", "scale_factor", "layout_code", "use_oneshot", "fp32_acc",
    "moe_reduction_device_num_experts", "moe_reduction_scale_input",
    "moe_reduction_active_experts_token_input", "moe_reduction_token_input",
    "expanded_idx_to_permuted_idx", "expert_scale_factor", "shared_expert_output",
    "block_quant_group_size", "weight_bias"))
"""``allreduce_fusion``'s keywords in 0.6.13 and 0.7.2.post1 (no ``routed_scaling_factor``)."""


def kernel_finalize_rows(kw: dict[str, Any]) -> torch.Tensor:
    """Pattern 7's expert step as its kernel reads the arguments: flat pointers, ``top_k`` the
    index's last dimension, the scales in the activation dtype, each product and sum rounded
    to it; an index read past its end or outside ``expanded`` raises (a GPU would read it)."""
    residual = kw["residual_in"]
    tokens, hidden = residual.shape
    dtype = residual.dtype
    index, scales = kw["expanded_idx_to_permuted_idx"], kw["expert_scale_factor"]
    if index.dtype != torch.int32 or scales.dtype != dtype:
        raise TypeError(f"the kernel reads int32 indices and {dtype} scales, got "
                        f"{index.dtype} and {scales.dtype}")
    top_k, rows = index.shape[-1], kw["input"].reshape(-1, hidden)
    flat_index, flat_scales = index.reshape(-1), scales.reshape(-1)
    acc = torch.zeros(tokens, hidden, dtype=dtype)
    for t in range(tokens):
        for k in range(top_k):
            j = t * top_k + k
            if j >= flat_index.numel() or j >= flat_scales.numel():
                raise IndexError(f"read past the index: entry {j} of {flat_index.numel()}")
            row = int(flat_index[j])
            if row == -1:
                continue
            if not 0 <= row < rows.shape[0]:
                raise IndexError(f"read row {row} of {rows.shape[0]}")
            acc[t] += (rows[row].float() * float(flat_scales[j])).to(dtype)
    if kw.get("shared_expert_output") is not None:
        acc = (acc.float() + kw["shared_expert_output"].float()).to(dtype)
    return acc


def kernel_reduction_rows(kw: dict[str, Any]) -> torch.Tensor:
    """Pattern 6's expert step as its kernel reads it: ``active`` at ``e*T*H + t*H + h``,
    fp32 scales at ``e*T + t`` (it reads floats), rounded to the activation dtype."""
    residual = kw["residual_in"]
    tokens, hidden = residual.shape
    experts = kw["moe_reduction_device_num_experts"]
    scales = kw["moe_reduction_scale_input"]
    if scales.dtype != torch.float32:
        raise TypeError(f"the kernel reads float scales, got {scales.dtype}")
    active = kw["moe_reduction_active_experts_token_input"].reshape(-1)
    active = active[:experts * tokens * hidden].view(experts, tokens, hidden)
    scales = scales.reshape(-1)[:experts * tokens].view(experts, tokens)
    acc = torch.zeros(tokens, hidden, dtype=residual.dtype)
    for e in range(experts):
        acc += (active[e].float() * scales[e].unsqueeze(1)).to(acc.dtype)
    return (acc.float() + kw["moe_reduction_token_input"].float()).to(acc.dtype)


KERNEL_MOE_ROWS = {6: kernel_reduction_rows, 7: kernel_finalize_rows}


def kernel_group_fp8(kw: dict[str, Any]) -> None:
    """Pattern 9's quantisation as FlashInfer's kernel writes it, from its source: the
    unified API's checks of ``scale_out`` (ValueError), then per token and group of
    ``block_quant_group_size`` the amax of the norm output, ``s = max(amax / 448, 1e-10)``
    rounded up to a power of two by its bits, ``q = e4m3(clamp(y / s))``, and the exponent
    byte of group j at byte ``j % 4`` of int32 ``(j // 4) * ceil(T/4)*4 + t``."""
    y, scale_out, group = kw["norm_out"], kw["scale_out"], kw["block_quant_group_size"]
    tokens, hidden = y.shape
    if group is None or group <= 0 or hidden % group:
        raise ValueError(f"block_quant_group_size {group} with hidden_dim {hidden}")
    groups = hidden // group
    packs, aligned = (groups + 3) // 4, (tokens + 3) // 4 * 4
    if scale_out.shape != (tokens, packs) or scale_out.stride() != (1, aligned) \
            or scale_out.dtype != torch.int32:
        raise ValueError(f"scale_out {tuple(scale_out.shape)} {scale_out.stride()} "
                         f"{scale_out.dtype}")
    storage = scale_out.as_strided(((packs - 1) * aligned + tokens,), (1,)).view(torch.uint8)
    quant = kw["quant_out"]
    for t in range(tokens):
        for j in range(groups):
            row = y[t, j * group:(j + 1) * group].float()
            amax = torch.tensor(max(abs(float(v)) for v in row), dtype=torch.float32)
            s = torch.clamp_min(amax / 448.0, 1e-10).view(torch.int32)
            if int(s) & 0x7FFFFF:
                s = (s + 0x800000) & 0x7F800000
            storage[((j // 4) * aligned + t) * 4 + j % 4] = int(s) >> 23
            quant[t, j * group:(j + 1) * group] = (row / s.view(torch.float32)).clamp(
                -448.0, 448.0).to(torch.float8_e4m3fn)


class FakeFlashInfer:
    def __init__(self, mc_ptr: int = 0xABC, buffer_scale: float = 1.0, version: str = NEW,
                 multicast: Callable[[int], bool] | None = None,
                 granularity: int = 2 * MIB, mc_granularity: int = 2 * MIB,
                 wire: Wire | None = None):
        self.mc_ptr, self.buffer_scale, self.version = mc_ptr, buffer_scale, version
        self.multicast = multicast or (lambda rank: True)
        self.granularity, self.mc_granularity = granularity, mc_granularity
        self.wire = wire
        self.created: list[dict[str, Any]] = []
        self.entered: list[int] = []
        self.calls: list[dict[str, Any]] = []
        self.destroyed_ipc: list[Any] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fake = self

        class TorchDistBackend:
            def __init__(self, group: Any = None):
                self.group = group

        allreduce = types.ModuleType("flashinfer.comm.allreduce")

        def create_allreduce_fusion_workspace(**kw: Any) -> FakeWorkspace:
            """Like FlashInfer: local checks, then the handle exchange through comm_backend
            (all ranks must arrive), then a closing barrier."""
            rank, comm = kw["rank"], kw["comm_backend"]
            fake.created.append(kw)
            fake.entered.append(rank)
            if (kw["backend"] == "mnnvl" and _v(fake.version) >= (0, 6, 15)
                    and not fake.multicast(rank)):
                raise RuntimeError("[SymmDeviceMemory] Device does not support multicasting.")
            handles = comm.allgather(f"handle-{rank}")
            assert len(handles) == comm.Get_size() or len(handles) == 1
            comm.bcast("mc-handle" if rank == 0 else None, root=0)
            cls = (CheckpointingWorkspace if _v(fake.version) >= (0, 6, 15)
                   else FakeWorkspace)
            ws = cls(fake, kw["backend"], kw["world_size"], rank, kw["max_token_num"],
                     kw["hidden_dim"], kw["dtype"], comm)
            comm.barrier()
            return ws

        def allreduce_fusion(**kw: Any) -> torch.Tensor:
            unknown = set(kw) - UNIFIED_PARAMETERS
            if unknown:  # as Python would for the real function
                raise TypeError(f"allreduce_fusion() got unexpected arguments {unknown}")
            fake.calls.append(kw)
            x, ws = kw["input"], kw["workspace"]
            if kw["pattern"] in KERNEL_MOE_ROWS:
                x = KERNEL_MOE_ROWS[kw["pattern"]](kw)
            total = fake.wire.sum(ws.rank, x) if fake.wire is not None else x
            if kw["pattern"] == 0:  # one rank, or the wire's sum
                kw["output"].copy_(total)
                return kw["output"]
            kw["residual_out"].copy_(total + kw["residual_in"])
            kw["norm_out"].copy_(kw["residual_out"])
            if kw["pattern"] == 9:
                kernel_group_fp8(kw)
            return kw["norm_out"]

        allreduce.create_allreduce_fusion_workspace = create_allreduce_fusion_workspace  # type: ignore[attr-defined]
        allreduce.allreduce_fusion = allreduce_fusion  # type: ignore[attr-defined]
        mnnvl = types.ModuleType("flashinfer.comm.mnnvl")
        mnnvl.TorchDistBackend = TorchDistBackend  # type: ignore[attr-defined]
        mnnvl.SymmDeviceMemory = SymmDeviceMemory  # type: ignore[attr-defined]
        mnnvl.is_mnnvl_fabric_supported = lambda device: False  # type: ignore[attr-defined]
        if _v(self.version) >= (0, 6, 16):
            mnnvl.is_multicast_supported = (  # type: ignore[attr-defined]
                lambda device: fake.multicast(device))
        trtllm_ar = types.ModuleType("flashinfer.comm.trtllm_ar")

        def trtllm_destroy_ipc_workspace_for_all_reduce_fusion(workspace: Any,
                                                               group: Any = None) -> None:
            fake.destroyed_ipc.append((workspace, group))

        trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion = (  # type: ignore[attr-defined]
            trtllm_destroy_ipc_workspace_for_all_reduce_fusion)
        comm = types.ModuleType("flashinfer.comm")
        comm.allreduce, comm.mnnvl, comm.trtllm_ar = allreduce, mnnvl, trtllm_ar  # type: ignore[attr-defined]
        utils = types.ModuleType("flashinfer.utils")
        if _v(self.version) >= (0, 6, 16):
            utils.is_confidential_compute = lambda: False  # type: ignore[attr-defined]
        root = types.ModuleType("flashinfer")
        root.comm, root.utils = comm, utils  # type: ignore[attr-defined]
        root.__version__ = self.version  # type: ignore[attr-defined]
        for name, module in {"flashinfer": root, "flashinfer.comm": comm,
                             "flashinfer.comm.allreduce": allreduce,
                             "flashinfer.comm.mnnvl": mnnvl,
                             "flashinfer.comm.trtllm_ar": trtllm_ar,
                             "flashinfer.utils": utils}.items():
            monkeypatch.setitem(sys.modules, name, module)


def context(world: int = 2) -> GroupContext:
    """One process standing for rank 0 of ``world`` ranks (its channel has no peers)."""
    group = object()  # stands for the caller's process group
    return GroupContext(group=group, rank=0, world_size=world, device="cpu", key="g",
                        channel=Channel(None, "t", 0, 1), settings=Settings())


def group_contexts(world: int, timeout_s: float = 20.0) -> list[GroupContext]:
    """``world`` ranks as threads of this process, sharing an in-memory store."""
    store, group = dist.HashStore(), object()
    return [GroupContext(group=group, rank=r, world_size=world, device="cpu", key="g",
                         channel=Channel(store, "t", r, world),
                         settings=Settings(timeout_s=timeout_s)) for r in range(world)]


def on_ranks(contexts: list[GroupContext], fn: Callable[[GroupContext], Any],
             join_s: float = 30.0) -> list[Any]:
    """``fn`` on every rank at once; each rank's result or exception."""
    results: list[Any] = [None] * len(contexts)

    def run(ctx: GroupContext) -> None:
        try:
            results[ctx.rank] = fn(ctx)
        except BaseException as exc:
            results[ctx.rank] = exc

    threads = [threading.Thread(target=run, args=(ctx,), daemon=True) for ctx in contexts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
        assert not t.is_alive(), "a rank never came back (hang)"
    return results


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFlashInfer:
    f = FakeFlashInfer()
    f.install(monkeypatch)
    return f


# --- creation -----------------------------------------------------------------------------


def test_create_binds_the_given_group_and_passes_the_spec(fake: FakeFlashInfer) -> None:
    ctx = context()
    ws = BACKENDS["mnnvl"]().create(ctx, Spec(max_tokens=64, hidden=256, dtype="bf16"))
    assert ws is not None
    kw = fake.created[0]
    assert kw["backend"] == "mnnvl" and kw["world_size"] == 2 and kw["rank"] == 0
    assert kw["max_token_num"] == 64 and kw["hidden_dim"] == 256
    assert kw["dtype"] == torch.bfloat16
    assert kw["comm_backend"].group is ctx.group  # R9: not WORLD
    assert kw["group"] is ctx.group
    # FlashInfer's own TorchDistBackend (0.6.13 takes the group from its type), run on the
    # group's channel
    assert isinstance(kw["comm_backend"], sys.modules["flashinfer.comm.mnnvl"].TorchDistBackend)
    assert isinstance(kw["comm_backend"], fi_comm.ChannelComm)
    assert kw["comm_backend"].Get_rank() == 0 and kw["comm_backend"].Get_size() == 2


@pytest.mark.parametrize(("backend", "world"), [
    ("trtllm", 1), ("trtllm", 3), ("trtllm", 32), ("mnnvl", 1), ("mnnvl", 6)])
def test_world_sizes_flashinfer_does_not_run_are_refused_before_entering(
        fake: FakeFlashInfer, backend: str, world: int) -> None:
    """trtllm runs at 2, 4, 8, 16 only (world 1 fails in the kernel): never created elsewhere,
    and the local check (gathered before any creation) says so too."""
    with pytest.raises(CreationFailed, match=f"world size {world}"):
        BACKENDS[backend]().create(context(world), Spec(max_tokens=8, hidden=64))
    assert fake.created == []
    descriptor = catalog.get(backend)
    topo = Topology(device="cuda", world_size=world, sm=90, multicast=True,
                    nvlink_all_pairs=True, flashinfer=NEW)
    assert "world size" in descriptor.unmet(topo, Spec(max_tokens=8, hidden=64))


def test_a_raise_on_one_rank_is_a_failed_vote_for_all_within_the_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """0.7.2 raises inside the constructor when this GPU has no multicast, while its peers are
    already in the handle exchange: they block there until told, i.e. until every rank
    arrives or one announces its failure. Every rank ends with the same failed vote at once."""
    fake = FakeFlashInfer(multicast=lambda rank: rank != 1)
    fake.install(monkeypatch)
    contexts = group_contexts(4, timeout_s=20.0)
    spec = Spec(max_tokens=64, hidden=256)

    def attempt(ctx: GroupContext) -> Any:
        ctx.channel.begin("n1/mnnvl")
        return _try(ctx, MnnvlBackend(), spec)

    results = on_ranks(contexts, attempt)  # PeerAborted below: nobody waited the 20 s out
    assert sorted(fake.entered) == [0, 1, 2, 3]
    for attempt_result, workspace in results:
        assert workspace is None and not attempt_result.ok
        assert attempt_result.phase == "create"
        assert "does not support multicasting" in attempt_result.failures[1]
        for r in (0, 2, 3):
            assert "PeerAborted" in attempt_result.failures[r]
            assert "rank 1 failed" in attempt_result.failures[r]


def test_a_workspace_that_fails_after_allocating_is_freed_with_the_groups(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashInfer made the handle, then sizing it raised on rank 1: the creation fails on
    every rank and every rank frees its handle (trtllm's IPC free is collective: one rank
    skipping it would leave the others in its barrier; the handle used to be dropped)."""
    fake = FakeFlashInfer()
    fake.install(monkeypatch)
    made: list[FakeWorkspace] = []
    real = FakeWorkspace.is_buffer_size_sufficient

    def sufficient(self: FakeWorkspace, *args: Any, **kwargs: Any) -> bool:
        made.append(self)
        if self.rank == 1:
            raise RuntimeError("cudaErrorIllegalAddress")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FakeWorkspace, "is_buffer_size_sufficient", sufficient)

    def attempt(ctx: GroupContext) -> Any:
        ctx.channel.begin("n1/trtllm")
        return _try(ctx, TrtllmBackend(), Spec(max_tokens=8, hidden=64))

    results = on_ranks(group_contexts(2), attempt)
    for attempt_result, workspace in results:
        assert workspace is None and attempt_result.phase == "create", attempt_result
        assert "sizing the trtllm workspace failed" in attempt_result.failures[1]
    handles = set(made)
    assert len(handles) == 2 and all(h.destroyed for h in handles)
    assert len(fake.destroyed_ipc) == 2  # on both ranks


def test_a_raise_between_exchanges_releases_the_peers_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after the first exchange (out of memory mapping the peers' buffers): the
    others wait in the next one (bcast) and are released by the announcement."""
    contexts = group_contexts(4)
    exchanged = threading.Barrier(4)
    FakeFlashInfer().install(monkeypatch)
    real_bcast = fi_comm.ChannelComm.bcast

    def bcast(self: fi_comm.ChannelComm, data: Any, root: int) -> Any:
        exchanged.wait(timeout=10)
        if self.Get_rank() == 2:
            raise MemoryError("cuMemMap: out of memory")
        return real_bcast(self, data, root)

    monkeypatch.setattr(fi_comm.ChannelComm, "bcast", bcast)

    def attempt(ctx: GroupContext) -> Any:
        ctx.channel.begin("n1/trtllm")
        return _try(ctx, TrtllmBackend(), Spec(max_tokens=8, hidden=64))

    results = on_ranks(contexts, attempt)
    for attempt_result, workspace in results:
        assert workspace is None and attempt_result.phase == "create"
        assert "MemoryError" in attempt_result.failures[2]
        assert not any("Timeout" in why for why in attempt_result.failures.values())
        assert set(attempt_result.failures) == {0, 1, 2, 3}


def test_ranks_that_would_fail_apart_never_enter(monkeypatch: pytest.MonkeyPatch) -> None:
    """What would make the constructor raise or hang on some ranks only is agreed first: here
    one rank lacks the free memory and two ranks differ in their handle type."""
    fake = FakeFlashInfer()
    fake.install(monkeypatch)

    def facts(self: FlashInferBackend, ctx: Any, spec: Spec,
              version: str | None) -> tuple[dict[str, Any], str]:
        return ({"flashinfer": version, "fabric": ctx.rank == 0},
                "needs 98 MiB of GPU memory, 10 MiB free" if ctx.rank == 2 else "")

    monkeypatch.setattr(FlashInferBackend, "_entry_facts", facts)

    def attempt(ctx: GroupContext) -> Any:
        ctx.channel.begin("n1/mnnvl")
        return _try(ctx, MnnvlBackend(), Spec(max_tokens=8, hidden=64))

    results = on_ranks(group_contexts(4), attempt)
    assert fake.entered == []
    for attempt_result, workspace in results:
        assert workspace is None and attempt_result.phase == "create"
        why = attempt_result.failures[0]
        assert set(attempt_result.failures) == {0, 1, 2, 3}
        assert "not entering FlashInfer's constructor" in why
        assert "rank 2: needs 98 MiB" in why and "ranks differ in fabric" in why


def test_same_host_ranks_must_share_the_temp_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashInfer >= 0.6.16 (and torch's symmetric memory) pass file descriptors over sockets
    in the temp directory: ranks of one host identity that do not see each other's files
    there (one /tmp per container) must not enter."""
    fake = FakeFlashInfer()
    fake.install(monkeypatch)
    real_marker = fi_comm._marker
    local = threading.local()
    made: list[str] = []

    def private_marker() -> tuple[str | None, str]:
        path, why = real_marker()
        if path is not None:
            made.append(path)
            if local.rank == 1:  # rank 1's /tmp is its own: nobody else sees the file
                os.remove(path)
        return path, why

    monkeypatch.setattr(fi_comm, "_marker", private_marker)

    def attempt(ctx: GroupContext) -> Any:
        local.rank = ctx.rank
        return BACKENDS["trtllm"]().create(ctx, Spec(max_tokens=8, hidden=64))

    results = on_ranks(group_contexts(2), attempt)
    assert fake.entered == []
    for result in results:
        assert isinstance(result, CreationFailed), result
        assert "rank 0: the temp directory" in str(result) and "[1]" in str(result)
    assert len(made) == 2 and not any(os.path.exists(p) for p in made)  # markers removed

    def shared(ctx: GroupContext) -> Any:  # one shared temp directory: everyone enters
        local.rank = 0
        return BACKENDS["trtllm"]().create(ctx, Spec(max_tokens=8, hidden=64))

    created = on_ranks(group_contexts(2), shared)
    assert all(ws is not None and not isinstance(ws, BaseException) for ws in created), created


def test_channel_comm_is_flashinfers_comm_backend_on_the_group() -> None:
    contexts = group_contexts(3)

    class TorchDistBackend:
        def __init__(self, group: Any = None):
            self._group = group

    def use(ctx: GroupContext) -> Any:
        comm = fi_comm.channel_comm(ctx, "mnnvl", TorchDistBackend)
        gathered = comm.allgather(b"\x00handle" + bytes([ctx.rank]))
        root = comm.bcast(("mc", ctx.rank), root=1)
        comm.barrier()
        return comm._group is ctx.group, gathered, root

    for same_group, gathered, root in on_ranks(contexts, use):
        assert same_group and root == ("mc", 1)
        assert gathered == [b"\x00handle\x00", b"\x00handle\x01", b"\x00handle\x02"]


def test_channel_comm_exchanges_end_at_the_groups_timeout() -> None:
    """A rank that never arrives (hung in the driver) is named within the group's timeout."""
    contexts = group_contexts(2, timeout_s=0.5)

    class TorchDistBackend:
        def __init__(self, group: Any = None):
            self._group = group

    comm = fi_comm.channel_comm(contexts[0], "mnnvl", TorchDistBackend)
    with pytest.raises(Exception, match=r"timed out after 0.5s .*rank\(s\) 1"):
        comm.allgather("handle")


# --- the local check: multicast agreed before any creation -------------------------------------


def _cuda_context(monkeypatch: pytest.MonkeyPatch, world: int = 2) -> GroupContext:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return replace(context(world), device="cuda")


def test_multicast_check_never_passes_on_a_missing_attribute(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """0.6.13 has no is_multicast_supported: another source answers, or the fact is unknown and
    blocks mnnvl."""
    FakeFlashInfer(version=OLD).install(monkeypatch)
    ctx = _cuda_context(monkeypatch)
    spec = Spec(max_tokens=8, hidden=64)
    monkeypatch.setattr(probe, "_torch_multicast", lambda device: None)
    monkeypatch.setattr(probe, "_driver_multicast", lambda device: None)
    assert "multicast support unknown" in MnnvlBackend().local_check(ctx, spec)
    monkeypatch.setattr(probe, "_driver_multicast", lambda device: False)
    assert "no multicast support (driver)" in MnnvlBackend().local_check(ctx, spec)
    monkeypatch.setattr(probe, "_torch_multicast", lambda device: True)
    assert MnnvlBackend().local_check(ctx, spec) == ""  # torch's allocator is 0.6.13's
    assert TrtllmBackend().local_check(ctx, spec) == ""


def test_multicast_check_asks_flashinfer_itself_where_it_can(
        monkeypatch: pytest.MonkeyPatch) -> None:
    FakeFlashInfer(version=NEW, multicast=lambda device: False).install(monkeypatch)
    ctx = _cuda_context(monkeypatch)
    monkeypatch.setattr(probe, "_driver_multicast", lambda device: True)
    why = MnnvlBackend().local_check(ctx, Spec(max_tokens=8, hidden=64))
    assert "no multicast support (flashinfer)" in why
    silent = (("a", lambda device: None), ("b", lambda device: None))
    assert probe.multicast_support(0, NEW, silent) == (None, "none")


def test_confidential_computing_blocks_mnnvl(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeFlashInfer(version=NEW).install(monkeypatch)
    monkeypatch.setattr(sys.modules["flashinfer.utils"], "is_confidential_compute",
                        lambda: True, raising=False)
    ctx = _cuda_context(monkeypatch)
    assert "Confidential Computing" in MnnvlBackend().local_check(ctx, Spec(max_tokens=8,
                                                                            hidden=64))
    assert TrtllmBackend().local_check(ctx, Spec(max_tokens=8, hidden=64)) == ""


# --- validation ----------------------------------------------------------------------------


def test_null_multicast_pointer_fails_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeFlashInfer(mc_ptr=0, version=OLD)  # 0.6.13 does not check it itself
    fake.install(monkeypatch)
    ws = BACKENDS["mnnvl"]().create(context(), Spec(max_tokens=8, hidden=64))
    assert ws is not None
    with pytest.raises(CreationFailed, match="null multicast pointer"):
        ws.validate()


def test_validation_runs_a_real_call(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeFlashInfer(wire=Wire(2))
    fake.install(monkeypatch)

    def create_and_validate(ctx: GroupContext) -> Any:
        ws = BACKENDS["mnnvl"]().create(ctx, Spec(max_tokens=8, hidden=64))
        assert ws is not None
        ws.validate()  # 1 + 2 == 3 on both ranks
        return ws

    results = on_ranks(group_contexts(2), create_and_validate)
    assert all(not isinstance(r, BaseException) for r in results), results
    assert fake.calls[-1]["pattern"] == 0 and fake.calls[-1]["use_oneshot"] is None


def test_injected_null_fails_validation_on_trtllm(fake: FakeFlashInfer) -> None:
    from arfuse.faults import parse

    ctx = replace(context(), faults=parse("trtllm.create@0=null"))
    ws = BACKENDS["trtllm"]().create(ctx, Spec(max_tokens=8, hidden=64))
    assert ws is not None
    with pytest.raises(CreationFailed):
        ws.validate()


# --- sizes and capacity --------------------------------------------------------------------


def test_capacity_is_flashinfers_own_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM #50877: a buffer that holds fewer tokens than asked for reports what it holds."""
    fake = FakeFlashInfer(buffer_scale=0.5)
    fake.install(monkeypatch)
    spec = Spec(max_tokens=2048, hidden=4096, dtype="bf16")
    ws = BACKENDS["mnnvl"]().create(context(8), spec)
    assert ws is not None
    handle = fake.created and ws.handle
    assert 0 < ws.capacity < 2048
    assert handle.is_buffer_size_sufficient(8, ws.capacity, 4096, torch.bfloat16)
    assert not handle.is_buffer_size_sufficient(8, ws.capacity + 1, 4096, torch.bfloat16)
    full = FakeFlashInfer()
    full.install(monkeypatch)
    ws_full = BACKENDS["mnnvl"]().create(context(8), spec)
    assert ws_full is not None and ws_full.capacity == 2048


@pytest.mark.parametrize(("version", "dtype", "per_wth"), [
    (OLD, "bf16", 8), (NEW, "bf16", 8), (OLD, "fp32", 14), ("0.7.1", "fp32", 14),
    (NEW, "fp32", 16)])
def test_trtllm_predicted_bytes_per_version(version: str, dtype: str, per_wth: int) -> None:
    """``2 + 3*lamport`` bytes per W*T*H element (the buffer 2 bytes before 0.7.2 even in fp32),
    plus each buffer's signal pad and rounding to the 2 MiB granularity: 2 MiB on each of the
    two large buffers and 2 MiB for the flags."""
    world, tokens, hidden = 8, 2048, 4096
    topo = Topology(device="cuda", world_size=world, flashinfer=version)
    fp = catalog.get("trtllm").footprint(world, Spec(tokens, hidden, dtype), topo)
    assert fp.bytes_per_rank == per_wth * world * tokens * hidden + 6 * MIB


@pytest.mark.parametrize("version", [OLD, "0.6.15", "0.6.18", NEW])
def test_mnnvl_predicted_bytes_per_version(version: str) -> None:
    """Three buffers of max(one-shot at the 1 MiB threshold, two-shot) bytes in one
    allocation, with its signal pad, rounded to the granularity."""
    topo = Topology(device="cuda", world_size=8, flashinfer=version)
    fp = catalog.get("mnnvl").footprint(8, Spec(2048, 4096, "bf16"), topo)
    assert fp.bytes_per_rank == 3 * 32 * MIB + 2 * MIB and fp.capacity == 2048
    tiny = Spec(max_tokens=1, hidden=8, dtype="fp32")  # a few hundred bytes: one granule
    topo2 = Topology(device="cuda", world_size=2, flashinfer=version)
    assert catalog.get("mnnvl").footprint(2, tiny, topo2).bytes_per_rank == 2 * MIB


@pytest.mark.parametrize("version", [OLD, NEW])
@pytest.mark.parametrize("backend", ["mnnvl", "trtllm"])
def test_the_stand_ins_allocation_matches_the_prediction(
        monkeypatch: pytest.MonkeyPatch, version: str, backend: str) -> None:
    fake = FakeFlashInfer(version=version)
    fake.install(monkeypatch)
    spec = Spec(max_tokens=777, hidden=4096, dtype="bf16")
    ws = BACKENDS[backend]().create(context(8), spec)
    assert ws is not None
    topo = Topology(device="cuda", world_size=8, flashinfer=version)
    predicted = catalog.get(backend).footprint(8, spec, topo)
    assert ws.nbytes == predicted.bytes_per_rank and ws.capacity == predicted.capacity
    # from 0.6.15 the workspace's own allocation sizes are read, not the formula
    assert (ws.allocated_bytes() is not None) == (version == NEW)  # type: ignore[attr-defined]


def test_runtime_bytes_come_from_the_allocation_where_it_is_real(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver whose multicast granularity is 512 MiB: the prediction (2 MiB assumed) is
    lower; the created workspace reports what was allocated. trtllm's workspace_size_bytes
    reads 0, so 0.6.13's falls back to the formula."""
    fake = FakeFlashInfer(mc_granularity=512 * MIB)
    fake.install(monkeypatch)
    ws = BACKENDS["mnnvl"]().create(context(8), Spec(max_tokens=64, hidden=4096))
    assert ws is not None and ws.nbytes == 512 * MIB
    old = FakeFlashInfer(version=OLD)
    old.install(monkeypatch)
    ws_old = BACKENDS["trtllm"]().create(context(8), Spec(max_tokens=64, hidden=4096))
    assert ws_old is not None and getattr(ws_old.handle, "workspace_size_bytes", 0) == 0
    topo = Topology(device="cuda", world_size=8, flashinfer=OLD)
    assert ws_old.nbytes == catalog.get("trtllm").footprint(
        8, Spec(max_tokens=64, hidden=4096), topo).bytes_per_rank


@pytest.mark.parametrize(("version", "capacity"), [(OLD, 1024), (NEW, 2048)])
def test_trtllm_fp32_at_world_2_before_0_7_2_holds_half(
        monkeypatch: pytest.MonkeyPatch, version: str, capacity: int) -> None:
    """Before 0.7.2 the two-shot buffer is sized for 2-byte elements; fp32 writes 4."""
    FakeFlashInfer(version=version).install(monkeypatch)
    spec = Spec(max_tokens=2048, hidden=64, dtype="fp32")
    ws = BACKENDS["trtllm"]().create(context(2), spec)
    assert ws is not None and ws.capacity == capacity
    topo = Topology(device="cuda", world_size=2, flashinfer=version)
    assert catalog.get("trtllm").footprint(2, spec, topo).capacity == capacity


def test_mnnvl_buffer_beyond_uint32_is_refused_before_creation() -> None:
    topo = Topology(device="cuda", world_size=2, sm=90, multicast=True, nvlink_all_pairs=True,
                    flashinfer=NEW)
    huge = Spec(max_tokens=300_000, hidden=8192, dtype="fp32")
    assert "UINT32_MAX" in catalog.get("mnnvl").unmet(topo, huge)
    assert catalog.get("mnnvl").unmet(topo, Spec(max_tokens=2048, hidden=8192)) == ""


# --- calls ---------------------------------------------------------------------------------


def trtllm_with_inputs(dtype: str) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A trtllm workspace of rank 0 of 2 on the stand-in, and x, residual, weight for 3
    tokens."""
    ws = BACKENDS["trtllm"]().create(context(), Spec(max_tokens=8, hidden=64, dtype=dtype))
    assert ws is not None
    torch_dtype = TORCH_DTYPES[dtype]
    return (ws, torch.randn(3, 64, dtype=torch_dtype), torch.randn(3, 64, dtype=torch_dtype),
            torch.ones(64, dtype=torch_dtype))


def test_patterns_and_quant_arguments(fake: FakeFlashInfer) -> None:
    ws, x, res, w = trtllm_with_inputs("fp16")
    out = ws.run(CallArgs(x, res, w, 1e-5, 1.0, "nvfp4", 2.5, "swizzled_128x4"))
    call = fake.calls[-1]
    assert call["pattern"] == 5 and call["layout_code"] == 0
    assert call["rms_eps"] == 1e-5 and call["weight_bias"] == 1.0 and call["fp32_acc"] is True
    assert float(call["scale_factor"].item()) == 2.5
    assert call["scale_out"].dtype == torch.float8_e4m3fn
    assert out.scale_out is not None and out.scale_out.shape == (128, 4)
    assert out.scale_out.dtype == torch.uint8
    assert torch.equal(out.residual_out, x + res)
    ws.run(CallArgs(x, None, w, 1e-5, 0.0, "fp8", 0.5, "linear"))
    call = fake.calls[-1]
    assert call["pattern"] == 4 and call["quant_out"].dtype == torch.float8_e4m3fn
    assert torch.equal(call["residual_in"], torch.zeros_like(x))


@pytest.mark.parametrize("backend", ["trtllm", "mnnvl"])
@pytest.mark.parametrize(("quant", "scale"), [("fp8", 0.5), ("nvfp4", 2.0), ("fp8_dynamic", None)])
def test_quantisation_without_rmsnorm_is_a_step_of_its_own(
        fake: FakeFlashInfer, backend: str, quant: str, scale: float | None) -> None:
    """FlashInfer has no all-reduce + quantise pattern without RMSNorm: its descriptor does not
    fuse it, so the op runs the plain all-reduce, then arfuse's quantisation of its sum (the
    quantised outputs used to be dropped)."""
    from arfuse.ops import run_on
    from arfuse.pattern import quant_output
    from arfuse.quant import quantize

    ws = BACKENDS[backend]().create(context(), Spec(max_tokens=8, hidden=64))
    assert ws is not None
    x = torch.randn(3, 64).bfloat16()
    call = CallArgs(x, None, None, 1e-6, 0.0, quant, scale, "linear")
    topology = Topology(device="cuda", world_size=2, sm=100, multicast=True,
                        nvlink_all_pairs=True, flashinfer="0.7.2.post1")
    assert not ws.takes(topology, call.pattern)
    assert ws.takes(topology, Pattern("rmsnorm", quant, "linear" if quant == "nvfp4" else None))
    got = run_on(ws, call, lambda pattern: ws.takes(topology, pattern))
    assert fake.calls[-1]["pattern"] == 0
    want = quantize(got.out, quant_output(quant, "linear"), scale)
    assert got.quant_out is not None and torch.equal(got.quant_out.view(torch.uint8),
                                                     want[0].view(torch.uint8))
    assert (got.scale_out is None) == (want[1] is None)
    if want[1] is not None:
        assert got.scale_out is not None and torch.equal(got.scale_out, want[1])


@pytest.mark.parametrize("backend", ["trtllm", "mnnvl"])
def test_fp8_dynamic_goes_through_pattern_11(fake: FakeFlashInfer, backend: str) -> None:
    """Per-token scales: FP8 out [T, H] and float32 scale_out [T, 1] the kernel fills, the norm
    materialised (pattern 11, not 10), no scale_factor."""
    ws = BACKENDS[backend]().create(context(), Spec(max_tokens=8, hidden=64))
    assert ws is not None
    x, res, w = torch.randn(3, 64), torch.randn(3, 64), torch.ones(64)
    x, res, w = x.bfloat16(), res.bfloat16(), w.bfloat16()
    out = ws.run(CallArgs(x, res, w, 1e-6, 0.0, "fp8_dynamic", None, "swizzled_128x4"))
    call = fake.calls[-1]
    assert call["pattern"] == 11 and "scale_factor" not in call and "layout_code" not in call
    assert call["quant_out"].shape == (3, 64) and call["quant_out"].dtype == torch.float8_e4m3fn
    assert call["scale_out"].shape == (3, 1) and call["scale_out"].dtype == torch.float32
    assert call["scale_out"].is_contiguous() and call["norm_out"] is out.out
    assert out.scale_out is call["scale_out"] and out.quant_out is call["quant_out"]


@pytest.mark.parametrize(("version", "fused"), [
    (OLD, False), ("0.6.14", False), ("0.6.15", True), (NEW, True)])
def test_fp8_dynamic_fuses_only_where_flashinfer_has_patterns_10_and_11(
        version: str, fused: bool) -> None:
    spec = Spec(max_tokens=8, hidden=64)
    object.__setattr__(spec, "quant", "fp8_dynamic")  # spec.py learns the name separately
    topo = Topology(device="cuda", world_size=8, sm=90, multicast=True, nvlink_all_pairs=True,
                    flashinfer=version)
    assert flashinfer.FP8_DYNAMIC_FROM == (0, 6, 15)
    for name in ("mnnvl", "trtllm"):
        assert catalog.get(name).fuses(topo, spec, Pattern("rmsnorm", "fp8_dynamic")) is fused


def test_trtllm_world_16_never_hits_the_missing_table_entry() -> None:
    assert trtllm_use_oneshot(8, 100, 4096, 2) is None
    assert trtllm_use_oneshot(16, 8, 4096, 2) is True      # two-shot needs tokens > ranks
    assert trtllm_use_oneshot(16, 4096, 4096, 2) is False  # too much one-shot traffic


def test_given_destinations_are_flashinfers_outputs(fake: FakeFlashInfer) -> None:
    """out= / residual_out= go to the kernel as norm_out / residual_out (in place: the input
    and the residual themselves, as vLLM passes them) and come back as the results."""
    ws, x, res, w = trtllm_with_inputs("bf16")
    expected = (x + res).clone()
    result = ws.run(CallArgs(x, res, w, 1e-5, 0.0, None, None, "linear", out=x,
                             residual_out=res))
    call = fake.calls[-1]
    assert call["norm_out"] is x and call["residual_out"] is res and call["input"] is x
    assert result.out is x and result.residual_out is res
    assert torch.equal(res, expected)
    plain_out = torch.empty_like(x)
    result = ws.run(CallArgs(x, None, None, 1e-5, 0.0, None, None, "linear", out=plain_out))
    assert fake.calls[-1]["output"] is plain_out and result.out is plain_out


# --- checkpoint and destroy ----------------------------------------------------------------


def test_checkpoint_on_the_workspaces_own_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """>= 0.6.15: prepare and restore are collective; restore exchanges handles through a
    comm_backend bound to the workspace's group, in a scope of its own; calls refuse between."""
    fake = FakeFlashInfer(version=NEW)
    fake.install(monkeypatch)
    spec = Spec(max_tokens=8, hidden=64)
    x = torch.ones(1, 64, dtype=torch.bfloat16)

    def cycle(ctx: GroupContext) -> Any:
        ws = BACKENDS["trtllm"]().create(ctx, spec)
        assert ws is not None and ws.supports_checkpoint  # type: ignore[attr-defined]
        ws.checkpoint_prepare()  # type: ignore[attr-defined]
        with pytest.raises(ArfuseError, match="checkpoint_restore"):
            ws.run(CallArgs(x))
        ws.checkpoint_restore()  # type: ignore[attr-defined]
        ws.run(CallArgs(x))
        return ws, ctx

    for ws, ctx in on_ranks(group_contexts(2), cycle):
        handle = ws.handle
        assert handle.events == ["prepare", "restore"]
        assert handle.restored_with.group is ctx.group
        assert isinstance(handle.restored_with, fi_comm.ChannelComm)
        assert ctx.channel.scope.endswith("/checkpoint2")


def test_no_checkpoint_on_0_6_13(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeFlashInfer(version=OLD).install(monkeypatch)
    ws = BACKENDS["mnnvl"]().create(context(), Spec(max_tokens=8, hidden=64))
    assert ws is not None and ws.supports_checkpoint is False  # type: ignore[attr-defined]
    with pytest.raises(NotImplementedError, match=r"0\.6\.15"):
        ws.checkpoint_prepare()  # type: ignore[attr-defined]


def test_destroy_frees_trtllm_ipc_buffers(fake: FakeFlashInfer) -> None:
    ctx = context()
    ws = BACKENDS["trtllm"]().create(ctx, Spec(max_tokens=8, hidden=64))
    assert ws is not None
    handle = ws.handle
    ws.destroy()
    assert fake.destroyed_ipc == [([[1, 2]], ctx.group)] and handle.destroyed
    ws.destroy()  # idempotent
    assert len(fake.destroyed_ipc) == 1


# --- the descriptors ------------------------------------------------------------------------


def test_backends_point_at_the_policys_descriptors() -> None:
    topo = Topology(device="cuda", world_size=8, sm=90, multicast=False, flashinfer="0.6.13")
    spec = Spec(max_tokens=8, hidden=64)
    for name, backend in BACKENDS.items():
        assert backend.name == name and backend.workspace_class.backend == name
        assert catalog.load(name) is backend
    assert "multicast" in catalog.get("mnnvl").unmet(topo, spec)


def test_blocked_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "no CUDA" in BACKENDS["mnnvl"]().local_check(context(), Spec(max_tokens=8, hidden=64))


def test_peer_aborted_is_what_a_waiting_rank_sees() -> None:
    """The announcement a failing rank makes is what ends its peers' wait (errors.PeerAborted)."""
    contexts = group_contexts(2)
    contexts[1].channel.abort("cuMemCreate: out of memory")
    with pytest.raises(PeerAborted, match="out of memory"):
        contexts[0].channel.all_gather("fi/0", "x", 5.0)


def test_an_output_flashinfer_has_no_pattern_for_is_not_claimed_fused() -> None:
    """A name is refused where it is looked up (``pattern.quant_output``); an output of the
    table that FlashInfer has no pattern for is left to the op's quantisation apart, so that
    ``explain`` on a GPU topology lists it instead of failing."""
    spec = Spec(max_tokens=8, hidden=64)
    topo = Topology(device="cuda", world_size=8, sm=100, multicast=True, nvlink_all_pairs=True,
                    flashinfer=NEW)
    with pytest.raises(ValueError, match=r"quant='int4' is not valid; use one of none, fp8"):
        Pattern("rmsnorm", "int4")
    pattern = Pattern("rmsnorm", "fp8")
    object.__setattr__(pattern, "quant", "mxfp8")  # a row FlashInfer has no pattern for
    for name in ("mnnvl", "trtllm"):
        assert not catalog.get(name).fuses(topo, spec, pattern)
    assert catalog.get("mnnvl").fuses(topo, spec, Pattern("rmsnorm", "fp8"))


# --- fp8_group (group_rules) ------------------------------------------------------------------

GROUP_TOPOLOGY = Topology(device="cuda", world_size=2, sm=90, multicast=True,
                          nvlink_all_pairs=True, flashinfer=NEW)


def _group_inputs(tokens: int, hidden: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(tokens * hidden)
    x, res = (torch.randn(2, tokens, hidden, generator=generator) * 3).bfloat16()
    return x, res, torch.ones(hidden, dtype=torch.bfloat16)


@pytest.mark.parametrize(("tokens", "group"), [(1, 128), (3, 32), (6, 64), (5, 128)])
def test_fp8_group_ue8m0_packed_runs_flashinfers_pattern_9(
        fake: FakeFlashInfer, tokens: int, group: int) -> None:
    """trtllm quantises ue8m0_packed in FlashInfer's kernel: pattern 9 (8 writes no norm
    output), ``block_quant_group_size``, e4m3 ``[T, H]``, int32 ``[T, ceil(G/4)]`` with strides
    ``(1, ceil(T/4)*4)`` as the unified API checks them; the kernel's packing (the stand-in
    writes it as FlashInfer's source does) is the reference's byte for byte."""
    from arfuse import quant as q

    hidden = 640  # 20, 10 or 5 groups: packs with padding bytes, tokens with padding rows
    ws = TrtllmBackend().create(context(), Spec(max_tokens=8, hidden=hidden))
    assert ws is not None
    x, res, w = _group_inputs(tokens, hidden)
    call = CallArgs(x, res, w, 1e-6, 0.0, "fp8_group", None, "ue8m0_packed", group_size=group)
    assert ws.takes(GROUP_TOPOLOGY, call.pattern)
    out = ws.run(call)
    kw = fake.calls[-1]
    assert kw["pattern"] == 9 and kw["block_quant_group_size"] == group
    assert "scale_factor" not in kw and "layout_code" not in kw
    assert kw["norm_out"] is out.out and out.quant_out is kw["quant_out"]
    assert out.scale_out is kw["scale_out"]
    codes, scales = q.fp8_group_quantize(out.out, group, "ue8m0_packed")
    assert out.quant_out is not None and out.scale_out is not None
    assert torch.equal(out.quant_out.view(torch.uint8), codes.view(torch.uint8))
    assert out.scale_out.shape == scales.shape and out.scale_out.stride() == scales.stride()
    assert out.scale_out.dtype == torch.int32 and torch.equal(out.scale_out, scales)


@pytest.mark.parametrize(("backend", "layout"), [
    ("trtllm", "fp32"), ("trtllm", "fp32_column_major"), ("mnnvl", "fp32"),
    ("mnnvl", "fp32_column_major"), ("mnnvl", "ue8m0_packed")])
def test_fp8_group_formats_flashinfer_lacks_quantise_in_torch_after_the_fused_norm(
        fake: FakeFlashInfer, backend: str, layout: str) -> None:
    """FlashInfer writes UE8M0 scales only, and on trtllm only: the descriptor does not take
    the other formats (nor any on mnnvl), so the op runs pattern 1 and then arfuse's
    quantisation of its norm output, in the format asked for."""
    from arfuse.ops import run_on
    from arfuse.pattern import quant_output
    from arfuse.quant import quantize

    ws = BACKENDS[backend]().create(context(), Spec(max_tokens=8, hidden=256))
    assert ws is not None
    x, res, w = _group_inputs(5, 256)
    call = CallArgs(x, res, w, 1e-6, 0.0, "fp8_group", None, layout, group_size=64)
    assert not ws.takes(GROUP_TOPOLOGY, call.pattern)
    got = run_on(ws, call, lambda pattern: ws.takes(GROUP_TOPOLOGY, pattern))
    assert fake.calls[-1]["pattern"] == 1 and "block_quant_group_size" not in fake.calls[-1]
    codes, scales = quantize(got.out, quant_output("fp8_group", layout), None, 64)
    assert got.quant_out is not None and got.scale_out is not None and scales is not None
    assert torch.equal(got.quant_out.view(torch.uint8), codes.view(torch.uint8))
    assert got.scale_out.shape == scales.shape and got.scale_out.stride() == scales.stride()
    assert torch.equal(got.scale_out, scales)


def test_fp8_group_block_threads_follow_flashinfers_launcher() -> None:
    """The launcher's block for patterns 8/9 (SM >= 90): clusters of up to 8, blocks of at
    least 128 threads, widened until a block holds whole groups; over 1024 threads it refuses
    (a raise inside the call on a GPU), which arfuse predicts and runs apart."""
    from arfuse.backends.flashinfer import group_rules as g

    assert g.block_threads(7168, 2, 128) == 224    # DeepSeek-V3: 896 threads, clusters of 4
    assert g.block_threads(4096, 2, 128) == 128
    assert g.block_threads(7168, 4, 128) == 224    # fp32: 4 values a thread
    assert g.block_threads(640, 2, 32) == 80       # a token in one small block
    # 65 groups of 128: only a whole row is whole groups, 1040 threads
    assert g.block_threads(8320, 2, 128) == 1040 and g.launch_refusal(8320, 2, 128)
    assert g.block_threads(8320, 2, 64) == 520 and not g.launch_refusal(8320, 2, 64)
    assert not g.launch_refusal(7168, 2, 128) and not g.launch_refusal(4096, 4, 32)


def test_fp8_group_a_group_size_the_launcher_refuses_runs_the_quantisation_apart(
        fake: FakeFlashInfer) -> None:
    from arfuse import quant as q

    hidden = 8320
    ws = TrtllmBackend().create(context(), Spec(max_tokens=8, hidden=hidden))
    assert ws is not None
    x, res, w = _group_inputs(2, hidden)
    for group, pattern in ((128, 1), (64, 9)):
        out = ws.run(CallArgs(x, res, w, 1e-6, 0.0, "fp8_group", None, "ue8m0_packed",
                              group_size=group))
        assert fake.calls[-1]["pattern"] == pattern, group
        codes, scales = q.fp8_group_quantize(out.out, group, "ue8m0_packed")
        assert out.quant_out is not None and out.scale_out is not None
        assert torch.equal(out.quant_out.view(torch.uint8), codes.view(torch.uint8))
        assert out.scale_out.stride() == scales.stride() and torch.equal(out.scale_out, scales)


def test_fp8_group_descriptors_and_explain() -> None:
    """trtllm fuses fp8_group with RMSNorm in ue8m0_packed only, mnnvl none; ``explain`` says
    which format runs where."""
    from arfuse import policy
    from arfuse.backends.flashinfer import group_rules

    spec = Spec(max_tokens=8, hidden=7168, quant="fp8_group")
    trtllm, mnnvl = catalog.get("trtllm"), catalog.get("mnnvl")
    for layout in ("fp32", "fp32_column_major", "ue8m0_packed"):
        for epilogue in ("rmsnorm", "residual_rmsnorm", "none"):
            pattern = Pattern(epilogue, "fp8_group", layout)
            fused = layout == "ue8m0_packed" and epilogue != "none"
            assert trtllm.fuses(GROUP_TOPOLOGY, spec, pattern) is fused, pattern
            assert mnnvl.fuses(GROUP_TOPOLOGY, spec, pattern) is False, pattern
    assert mnnvl.notes(GROUP_TOPOLOGY, spec) == (group_rules.NOT_IN_FLASHINFER,)
    notes = trtllm.notes(GROUP_TOPOLOGY, spec)
    assert "fp8_group fp32, fp32_column_major: norm fused, quantisation in torch" in notes
    assert any("pattern 9" in n and "32, 64, 128" in n for n in notes), notes
    # doctor's and explain's summary: which formats run the quantisation in torch
    lists = {name: policy.pattern_list(policy.resolve(
        Settings(backend=name), GROUP_TOPOLOGY, spec).candidate(name).fuses)
        for name in ("trtllm", "mnnvl")}
    assert "fp8_group (fp32, fp32_column_major): norm fused, quantisation in torch" \
        in lists["trtllm"], lists
    assert "fp8_group (fp32, fp32_column_major, ue8m0_packed): norm fused, quantisation in " \
        "torch" in lists["mnnvl"], lists
    for backend in ("trtllm", "mnnvl"):
        plan = policy.resolve(Settings(backend=backend), GROUP_TOPOLOGY, spec)
        text = plan.explain()
        assert "norm fused, quantisation in torch" in text, text
        assert ("not in FlashInfer" in text) is (backend == "mnnvl"), text
        assert ("quantisation (fp8_group): fused in ue8m0_packed; a separate step after the "
                "fused op in fp32, fp32_column_major" in text) is (backend == "trtllm"), text
