"""The FlashInfer glue, driven through a stand-in of FlashInfer 0.6.13's unified API (this
machine has no GPU): what it passes, what it checks, what it frees. Not a hardware test."""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import pytest
import torch

from arfuse import catalog
from arfuse.backends.flashinfer.workspace import MnnvlBackend, TrtllmBackend, trtllm_use_oneshot
from arfuse.call_checks import CallArgs
from arfuse.errors import CreationFailed
from arfuse.negotiate import GroupContext
from arfuse.rendezvous import Channel
from arfuse.settings import Settings
from arfuse.spec import Spec
from arfuse.torch_types import TORCH_DTYPES

MIB = 1 << 20
BACKENDS = {"mnnvl": MnnvlBackend, "trtllm": TrtllmBackend}


class FakeWorkspace:
    """Sizing and sufficiency as FlashInfer 0.6.13 computes them (independently written)."""

    def __init__(self, backend: str, world_size: int, max_token_num: int, hidden_dim: int,
                 dtype: torch.dtype, mc_ptr: int):
        self.backend, self.world_size = backend, world_size
        self.elem = torch.tensor([], dtype=dtype).element_size()
        self.max_token_num, self.hidden_dim = max_token_num, hidden_dim
        self.mc_ptr = mc_ptr
        self.ipc_handles = [[1, 2]] if backend == "trtllm" else None
        self.destroyed = False
        if backend == "mnnvl":
            oneshot_tokens = min(MIB // (world_size * self.elem * hidden_dim), max_token_num)
            self.buffer_size_bytes = max(
                oneshot_tokens * hidden_dim * world_size * self.elem,
                2 * math.ceil(max_token_num / world_size) * world_size * hidden_dim * self.elem)
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


class FakeFlashInfer:
    def __init__(self, mc_ptr: int = 0xABC, buffer_scale: float = 1.0):
        self.mc_ptr, self.buffer_scale = mc_ptr, buffer_scale
        self.created: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []
        self.destroyed_ipc: list[Any] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fake = self

        class TorchDistBackend:
            def __init__(self, group: Any = None):
                self.group = group

        allreduce = types.ModuleType("flashinfer.comm.allreduce")

        def create_allreduce_fusion_workspace(**kw: Any) -> FakeWorkspace:
            fake.created.append(kw)
            ws = FakeWorkspace(kw["backend"], kw["world_size"], kw["max_token_num"],
                               kw["hidden_dim"], kw["dtype"], fake.mc_ptr)
            if kw["backend"] == "mnnvl" and fake.buffer_scale != 1.0:
                ws.buffer_size_bytes = int(ws.buffer_size_bytes * fake.buffer_scale)
            return ws

        def allreduce_fusion(**kw: Any) -> torch.Tensor:
            fake.calls.append(kw)
            x = kw["input"]
            if kw["pattern"] == 0:  # one rank: the sum is the input
                kw["output"].copy_(x)
                return kw["output"]
            kw["residual_out"].copy_(x + kw["residual_in"])
            kw["norm_out"].copy_(kw["residual_out"])
            return kw["norm_out"]

        allreduce.create_allreduce_fusion_workspace = create_allreduce_fusion_workspace  # type: ignore[attr-defined]
        allreduce.allreduce_fusion = allreduce_fusion  # type: ignore[attr-defined]
        mnnvl = types.ModuleType("flashinfer.comm.mnnvl")
        mnnvl.TorchDistBackend = TorchDistBackend  # type: ignore[attr-defined]
        trtllm_ar = types.ModuleType("flashinfer.comm.trtllm_ar")

        def trtllm_destroy_ipc_workspace_for_all_reduce_fusion(workspace: Any,
                                                               group: Any = None) -> None:
            fake.destroyed_ipc.append((workspace, group))

        trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion = (  # type: ignore[attr-defined]
            trtllm_destroy_ipc_workspace_for_all_reduce_fusion)
        comm = types.ModuleType("flashinfer.comm")
        comm.allreduce, comm.mnnvl, comm.trtllm_ar = allreduce, mnnvl, trtllm_ar  # type: ignore[attr-defined]
        root = types.ModuleType("flashinfer")
        root.comm = comm  # type: ignore[attr-defined]
        for name, module in {"flashinfer": root, "flashinfer.comm": comm,
                             "flashinfer.comm.allreduce": allreduce,
                             "flashinfer.comm.mnnvl": mnnvl,
                             "flashinfer.comm.trtllm_ar": trtllm_ar}.items():
            monkeypatch.setitem(sys.modules, name, module)


def context(world: int = 1) -> GroupContext:
    group = object()  # stands for the caller's process group
    return GroupContext(group=group, rank=0, world_size=world, device="cpu", key="g",
                        channel=Channel(None, "t", 0, 1), settings=Settings())


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFlashInfer:
    f = FakeFlashInfer()
    f.install(monkeypatch)
    return f


def test_create_binds_the_given_group_and_passes_the_spec(fake: FakeFlashInfer) -> None:
    ctx = context()
    ws = BACKENDS["mnnvl"]().create(ctx, Spec(max_tokens=64, hidden=256, dtype="bf16"))
    assert ws is not None
    kw = fake.created[0]
    assert kw["backend"] == "mnnvl" and kw["world_size"] == 1 and kw["rank"] == 0
    assert kw["max_token_num"] == 64 and kw["hidden_dim"] == 256
    assert kw["dtype"] == torch.bfloat16
    assert kw["comm_backend"].group is ctx.group  # R9: not WORLD
    assert kw["group"] is ctx.group


def test_null_multicast_pointer_fails_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeFlashInfer(mc_ptr=0)
    fake.install(monkeypatch)
    ws = BACKENDS["mnnvl"]().create(context(), Spec(max_tokens=8, hidden=64))
    assert ws is not None
    with pytest.raises(CreationFailed, match="null multicast pointer"):
        ws.validate()


def test_validation_runs_a_real_call(fake: FakeFlashInfer) -> None:
    ws = BACKENDS["mnnvl"]().create(context(), Spec(max_tokens=8, hidden=64))
    assert ws is not None
    ws.validate()
    assert fake.calls[-1]["pattern"] == 0 and fake.calls[-1]["use_oneshot"] is None


def test_capacity_is_flashinfers_own_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM #50877: a buffer that holds fewer tokens than asked for reports what it holds."""
    fake = FakeFlashInfer(buffer_scale=0.5)
    fake.install(monkeypatch)
    spec = Spec(max_tokens=2048, hidden=4096, dtype="bf16")
    ws = BACKENDS["mnnvl"]().create(context(8), spec)
    assert ws is not None
    handle = fake.created and ws._handle  # type: ignore[attr-defined]
    assert 0 < ws.capacity < 2048
    assert handle.is_buffer_size_sufficient(8, ws.capacity, 4096, torch.bfloat16)
    assert not handle.is_buffer_size_sufficient(8, ws.capacity + 1, 4096, torch.bfloat16)
    full = FakeFlashInfer()
    full.install(monkeypatch)
    ws_full = BACKENDS["mnnvl"]().create(context(8), spec)
    assert ws_full is not None and ws_full.capacity == 2048


def trtllm_with_inputs(dtype: str) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-rank trtllm workspace on the stand-in, and x, residual, weight for 3 tokens."""
    ws = BACKENDS["trtllm"]().create(context(), Spec(max_tokens=8, hidden=64,
                                                           dtype=dtype))
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


def test_trtllm_world_16_never_hits_the_missing_table_entry() -> None:
    assert trtllm_use_oneshot(8, 100, 4096, 2) is None
    assert trtllm_use_oneshot(16, 8, 4096, 2) is True      # two-shot needs tokens > ranks
    assert trtllm_use_oneshot(16, 4096, 4096, 2) is False  # too much one-shot traffic


def test_destroy_frees_trtllm_ipc_buffers(fake: FakeFlashInfer) -> None:
    ctx = context()
    ws = BACKENDS["trtllm"]().create(ctx, Spec(max_tokens=8, hidden=64))
    assert ws is not None
    handle = ws._handle  # type: ignore[attr-defined]
    ws.destroy()
    assert fake.destroyed_ipc == [([[1, 2]], ctx.group)] and handle.destroyed
    ws.destroy()  # idempotent
    assert len(fake.destroyed_ipc) == 1


def test_injected_null_fails_validation_on_trtllm(fake: FakeFlashInfer) -> None:
    from dataclasses import replace

    from arfuse.faults import parse

    ctx = replace(context(), faults=parse("trtllm.create@0=null"))
    ws = BACKENDS["trtllm"]().create(ctx, Spec(max_tokens=8, hidden=64))
    assert ws is not None
    with pytest.raises(CreationFailed):
        ws.validate()


def test_backends_point_at_the_policys_descriptors() -> None:
    from arfuse.topology import Topology

    topo = Topology(device="cuda", world_size=8, sm=90, multicast=False, flashinfer="0.6.13")
    spec = Spec(max_tokens=8, hidden=64)
    for name, backend in BACKENDS.items():
        assert backend.name == name and backend.workspace_class.backend == name
        assert catalog.load(name) is backend
    assert "multicast" in catalog.get("mnnvl").blocker(topo, spec)


def test_blocked_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "no CUDA" in BACKENDS["mnnvl"]().blocker(context(), Spec(max_tokens=8, hidden=64))


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
