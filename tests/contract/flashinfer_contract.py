"""arfuse's FlashInfer glue against the REAL flashinfer-python installed here (CPU only).

Run by ``scripts/flashinfer_contract.sh`` in a virtual environment holding one FlashInfer
version (not collected by pytest: the file name does not start with ``test_``). No GPU is
needed: FlashInfer's own Python code runs for real, and only what needs a device is replaced
(the compiled kernel modules, the driver's allocation calls, ``torch.cuda.synchronize``).

1. Constants: the pattern and layout codes arfuse passes, the heuristics tables it mirrors,
   and which features the installed version has (arfuse's version gates).
2. Calls: arfuse's own ``create``/``run``/``destroy``/checkpoint code drives the real unified
   API (``create_allreduce_fusion_workspace`` bound to its real signature, ``allreduce_fusion``
   with its real dispatch and argument checks down to the kernel binding), on both backends
   and every pattern arfuse uses.
   MoE (patterns 6/7 on trtllm): each rule of ``moe_rules`` against the real package, what
   arfuse hands the kernel bindings (index shape, scale dtypes, no routed scaling), what the
   unified API drops or skips, the wrappers' one-shot checks, and the kernel sources' numbers.
   fp8_group (pattern 9 on trtllm, ``group_rules``): the codes, the unified API's checks of
   ``scale_out`` (shape, strides, dtype) passed by arfuse's own run for every dtype, group
   size and token count tried, the formats and backends that run the quantisation in torch,
   and the kernel sources' scale rule, packing and launcher numbers.
3. Bytes: FlashInfer's real workspace constructors run with their allocations recorded, for a
   grid of (world, tokens, hidden, dtype); the sizes asked for, the sizes allocated (its real
   ``SymmDeviceMemory._get_allocation_prop`` at arfuse's assumed granularity) and the buffer
   each mnnvl workspace ends up with must equal arfuse's formulas (``sizes.py``). Where torch's
   symmetric memory allocates (FlashInfer < 0.6.15), torch's C++ rounding cannot run here: it
   is reproduced (``sizes.torch_symm_bytes``) and its signal pad read from torch.

Prints one line per check and ``N passed, M failed``; exits 1 on any failure.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import inspect
import itertools
import os
import sys
import tempfile
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, bool(ok), detail))
    print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""))


def section(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        check(f"{name} ran to the end", False, traceback.format_exc(limit=8))


def load_cudart() -> None:
    """FlashInfer imports need libcudart.so.12 (from nvidia-cuda-runtime-cu12) loaded first."""
    for site in sys.path:
        found = glob.glob(os.path.join(site, "nvidia", "cuda_runtime", "lib", "libcudart.so.12"))
        if found:
            ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
            return
    raise SystemExit("libcudart.so.12 not found: pip install nvidia-cuda-runtime-cu12")


class Stop(Exception):
    """Raised where FlashInfer's constructor would next touch the GPU."""


def _stop(*args: Any, **kwargs: Any) -> Any:
    raise Stop


@contextlib.contextmanager
def patched(target: Any, name: str, value: Any) -> Iterator[None]:
    missing = object()
    old = getattr(target, name, missing)
    setattr(target, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(target, name)
        else:
            setattr(target, name, old)


class Proxy:
    """A module with some attributes replaced (cuda-python's driver is read-only)."""

    def __init__(self, module: Any, **overrides: Any):
        self._module, self._overrides = module, overrides

    def __getattr__(self, name: str) -> Any:
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._module, name)


def main() -> int:
    started = time.monotonic()
    load_cudart()
    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    store_path = os.path.join(tempfile.mkdtemp(prefix="arfuse-contract-"), "store")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0,
                            world_size=1)
    group = dist.new_group([0])  # not WORLD: R9 checks name the group a rendezvous used
    assert group.group_name != dist.group.WORLD.group_name
    # 0.6.15 ... 0.6.18 read the device's SM count at import (gdn kernels): a stand-in GPU
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(  # type: ignore
        multi_processor_count=132, major=9, minor=0, name="CPU stand-in", total_memory=0)
    import flashinfer
    import flashinfer.comm.allreduce as ar
    import flashinfer.comm.mnnvl as mnnvl
    import flashinfer.comm.trtllm_ar as trtllm_ar
    import flashinfer.comm.trtllm_mnnvl_ar as mnnvl_ar

    from arfuse.backends.flashinfer import sizes, workspace

    version = str(flashinfer.__version__)
    v = sizes.version_tuple(version)
    print(f"flashinfer {version}, torch {torch.__version__}, python {sys.version.split()[0]}")
    # what CPU torch cannot do, FlashInfer's Python code only asks for its numbers
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.device_count = lambda: 64  # type: ignore[assignment]
    torch.cuda.synchronize = _stop  # type: ignore[assignment]
    env = types.SimpleNamespace(torch=torch, dist=dist, group=group, flashinfer=flashinfer,
                                ar=ar, mnnvl=mnnvl, trtllm_ar=trtllm_ar, mnnvl_ar=mnnvl_ar,
                                sizes=sizes, workspace=workspace, version=version, v=v)
    section("constants", lambda: constants(env))
    section("calls", lambda: calls(env))
    section("moe", lambda: moe_patterns(env))
    section("fp8_group", lambda: group_patterns(env))
    section("bytes", lambda: bytes_grid(env))
    failed = sum(1 for _, ok, _ in RESULTS if not ok)
    print(f"flashinfer {version}: contract checked in {time.monotonic() - started:.1f} s")
    print(f"{len(RESULTS) - failed} passed, {failed} failed")
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
        os.remove(store_path)
        os.rmdir(os.path.dirname(store_path))
    return 1 if failed else 0


# --- 1. constants -------------------------------------------------------------------------------


def constants(env: Any) -> None:
    ws, sizes, v = env.workspace, env.sizes, env.v
    pattern = env.trtllm_ar.AllReduceFusionPattern
    layout = env.trtllm_ar.QuantizationSFLayout
    ours = {"kAllReduce": ws.K_ALLREDUCE, "kARResidualRMSNorm": ws.K_RESIDUAL_RMSNORM,
            "kARResidualRMSNormFP8Quant": ws.K_FP8_QUANT,
            "kARResidualRMSNormFP4Quant": ws.K_FP4_QUANT,
            "kARResidualRMSNormOutFP8Quant": ws.K_OUT_FP8_QUANT,
            "kARResidualRMSNormOutFP4Quant": ws.K_OUT_FP4_QUANT}
    dynamic = {"kARResidualRMSNormDynamicFP8Quant": ws.K_DYNAMIC_FP8_QUANT,
               "kARResidualRMSNormOutDynamicFP8Quant": ws.K_OUT_DYNAMIC_FP8_QUANT}
    for name, code in ours.items():
        check(f"AllReduceFusionPattern.{name} == {code}", getattr(pattern, name, None) == code,
              f"flashinfer has {getattr(pattern, name, None)}")
    has_dynamic = v >= (0, 6, 15)
    from arfuse.backends.flashinfer import FP8_DYNAMIC_FROM

    check("fp8_dynamic gate matches the patterns' presence",
          (v >= FP8_DYNAMIC_FROM) == all(hasattr(pattern, n) for n in dynamic))
    for name, code in dynamic.items():
        if has_dynamic:
            check(f"AllReduceFusionPattern.{name} == {code}", getattr(pattern, name) == code)
    check("QuantizationSFLayout codes", {"swizzled_128x4": layout.SWIZZLED_128x4,
                                        "linear": layout.LINEAR} == ws.LAYOUT_CODE)
    check("trtllm one-shot table", env.trtllm_ar._use_oneshot_heuristics
          == ws._TRTLLM_ONESHOT_MIB, str(env.trtllm_ar._use_oneshot_heuristics))
    check("MNNVL_ONE_SHOT_THRESHOLD", env.mnnvl_ar.MNNVL_ONE_SHOT_THRESHOLD
          == sizes.MNNVL_ONE_SHOT_THRESHOLD)
    check("NUM_LAMPORT_BUFFERS", env.mnnvl_ar.MNNVLAllReduceFusionWorkspace.NUM_LAMPORT_BUFFERS
          == sizes.NUM_LAMPORT_BUFFERS)
    check("BarrierFlagCount", env.trtllm_ar.BarrierFlagCount == sizes.BARRIER_FLAG_COUNT)
    check("MAX_COMM_SIZE", env.trtllm_ar.MAX_COMM_SIZE == sizes.MAX_COMM_SIZE)
    check("SIGNAL_PAD_SIZE", env.mnnvl.SIGNAL_PAD_SIZE == sizes.FLASHINFER_SIGNAL_PAD)
    import torch.distributed._symmetric_memory as symm_mem

    check("torch's symmetric-memory signal pad", symm_mem.get_signal_pad_size()
          == sizes.TORCH_SIGNAL_PAD, str(symm_mem.get_signal_pad_size()))
    check("is_multicast_supported exists from 0.6.16 only",
          hasattr(env.mnnvl, "is_multicast_supported") == (v >= (0, 6, 16)))
    mnnvl_cls, trtllm_cls = env.ar.MNNVLAllReduceFusionWorkspace, \
        env.ar.TRTLLMAllReduceFusionWorkspace
    for cls in (mnnvl_cls, trtllm_cls):
        has = callable(getattr(cls, "checkpoint_prepare", None)) and callable(
            getattr(cls, "checkpoint_restore", None))
        check(f"{cls.__name__} checkpoint methods exist from 0.6.15 only",
              has == (v >= sizes.SYMM_DEVICE_MEMORY_FROM))
    from flashinfer import utils

    check("is_confidential_compute exists from 0.6.16 only",
          hasattr(utils, "is_confidential_compute") == (v >= (0, 6, 16)))


# --- 2. calls -----------------------------------------------------------------------------------


def bind(fn: Any, *args: Any, **kwargs: Any) -> None:
    """Raise TypeError unless the call fits ``fn``'s real signature."""
    inspect.signature(fn).bind(*args, **kwargs)


def context(env: Any, world: int) -> Any:
    from arfuse.group import GroupContext
    from arfuse.rendezvous import Channel
    from arfuse.settings import Settings

    return GroupContext(group=env.group, rank=0, world_size=world, device="cuda", key="c",
                        channel=Channel(None, "c", 0, 1), settings=Settings())


def fake_kernels(env: Any, record: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """The compiled modules' entry points, recording their arguments."""
    def recorder(name: str) -> Callable[..., None]:
        def call(*args: Any, **kwargs: Any) -> None:
            record.append((name, {"args": args, **kwargs}))
        return call

    trt = types.SimpleNamespace(**{name: recorder(name) for name in (
        "trtllm_allreduce_fusion", "trtllm_moe_allreduce_fusion",
        "trtllm_moe_finalize_allreduce_fusion")})
    mn = types.SimpleNamespace(
        trtllm_mnnvl_allreduce_fusion=recorder("trtllm_mnnvl_allreduce_fusion"))
    return [patched(env.trtllm_ar, "get_trtllm_comm_module", lambda: trt),
            patched(env.mnnvl_ar, "get_trtllm_mnnvl_comm_module", lambda: mn)]


def real_trtllm_workspace(env: Any, kw: dict[str, Any]) -> Any:
    """A real ``TRTLLMAllReduceFusionWorkspace`` whose buffers are host numbers."""
    torch = env.torch
    cls = env.ar.TRTLLMAllReduceFusionWorkspace
    obj = cls.__new__(cls)
    env.ar.AllReduceFusionWorkspace.__init__(obj, kw["world_size"], kw["rank"])
    world = kw["world_size"]
    ipc = [[0x1000 * (i + 1) + r for r in range(world)] for i in range(3)]
    metadata = {"tp_rank": kw["rank"], "tp_size": world, "max_token_num": kw["max_token_num"],
                "hidden_dim": kw["hidden_dim"], "use_fp32_lamport": kw["dtype"] == torch.float32,
                "buffer_size": 0, "flag_size": 0, "lamport_comm_size": 0,
                "lamport_buffer_size": 0}
    obj._internal_workspace = (ipc, torch.zeros(3 * world + 1, dtype=torch.int64), [], metadata)
    obj.ipc_handles, obj.workspace_tensor = ipc, obj._internal_workspace[1]
    obj.mem_handles, obj.metadata = [], metadata
    env.trtllm_ar._symm_workspace_refs[id(ipc)] = []
    return obj


def mnnvl_workspace(env: Any, kw: dict[str, Any], granularity: int,
                    mc_granularity: int) -> tuple[Any, list[int]]:
    """A real ``MNNVLAllReduceFusionWorkspace`` built by its own ``__init__`` up to its first
    GPU step, its allocation recorded; the requested sizes come back too."""
    torch = env.torch
    requested: list[int] = []
    requested_group: list[str] = []
    world = kw["world_size"]

    def alloc_torch(size_bytes: int, world_size: int, dtype: Any, device: Any,
                    group_name: str) -> Any:
        requested.append(size_bytes)
        requested_group.append(group_name)
        handle = types.SimpleNamespace(buffer_size=size_bytes, multicast_ptr=0xABC,
                                       buffer_ptrs_dev=0x2000, buffer_ptrs=[0x3000] * world)
        return [0x3000] * world, torch.empty(0), handle

    class McastGPUBuffer:
        def __init__(self, buf_size: int, group_size: int, group_rank: int, device: Any,
                     comm_backend_for_handle_transfer: Any = None):
            requested.append(buf_size)
            allocation, usable = real_allocation(env, buf_size, True, granularity,
                                                 mc_granularity)
            self.buf_size = usable
            self.allocation_size = allocation
            self.mcast_device_memory = types.SimpleNamespace(
                get_buffer_ptrs_host=lambda: [0x3000] * world, mapped=True)

        def lamport_initialize(self, rank: int, dtype: Any) -> None:
            return None

        def get_buffer_ptrs_dev(self) -> int:
            return 0x2000

        def get_unicast_ptr(self, rank: int) -> int:
            return 0x3000

        def get_multicast_ptr(self) -> int:
            return 0xABC

    cls = env.mnnvl_ar.MNNVLAllReduceFusionWorkspace
    obj = cls.__new__(cls)
    mapping = env.ar.Mapping(world_size=world, rank=kw["rank"], gpus_per_node=world,
                             tp_size=world)
    patches = [patched(env.mnnvl_ar, "McastGPUBuffer", McastGPUBuffer)]
    if hasattr(env.mnnvl_ar, "_alloc_symm_buffer_bytes"):
        patches.append(patched(env.mnnvl_ar, "_alloc_symm_buffer_bytes", alloc_torch))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        with contextlib.suppress(Stop):
            cls.__init__(obj, mapping=mapping, max_num_tokens=kw["max_token_num"],
                         hidden_dim=kw["hidden_dim"], dtype=kw["dtype"],
                         comm_backend=kw["comm_backend"])
    obj.mnnvl_group_names = requested_group
    # what the rest of __init__ would have set, for calls on it
    obj.buffer_flags = torch.zeros(9, dtype=torch.int32)
    obj.uc_ptrs_dev, obj.uc_ptr_local, obj.mc_ptr = 0x2000, 0x3000, 0xABC
    return obj, requested


def real_allocation(env: Any, size: int, multicast: bool, granularity: int,
                    mc_granularity: int) -> tuple[int, int]:
    """FlashInfer's own ``SymmDeviceMemory._get_allocation_prop`` with the driver's
    granularities given: (allocation bytes, usable bytes)."""
    mnnvl = env.mnnvl
    cuda = mnnvl.cuda
    ok = cuda.CUresult.CUDA_SUCCESS

    class Sizing(mnnvl.SymmDeviceMemory):  # type: ignore[name-defined]
        def __del__(self) -> None:  # nothing was allocated
            return None

    stub = Sizing.__new__(Sizing)
    stub.buf_size, stub.group_size, stub.group_rank, stub.device_idx = size, 8, 0, 0
    stub._enable_multicast = multicast
    stub.SIGNAL_PAD_SIZE = mnnvl.SIGNAL_PAD_SIZE
    stub.SIGNAL_PAD_ALIGNMENT = 16
    stub._exchanger = types.SimpleNamespace(
        handle_type=cuda.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    proxy = Proxy(cuda, cuMemGetAllocationGranularity=lambda *a: (ok, granularity),
                  cuMulticastGetGranularity=lambda *a: (ok, mc_granularity))
    with patched(mnnvl, "cuda", proxy):
        stub._get_allocation_prop(size)
    return int(stub.allocation_size), int(stub.get_usable_buffer_size())


@contextlib.contextmanager
def recorded(env: Any) -> Iterator[Any]:
    """arfuse's create and destroy reach the real functions' signatures (bound), the real
    workspaces are built without a GPU, and FlashInfer's kernel entry points are recorded."""
    ar = env.ar
    real_create = ar.create_allreduce_fusion_workspace
    rec = types.SimpleNamespace(created=[], kernels=[], destroyed=[])

    def create(**kw: Any) -> Any:
        bind(real_create, **kw)
        rec.created.append(kw)
        if kw["backend"] == "trtllm":
            return real_trtllm_workspace(env, kw)
        return mnnvl_workspace(env, kw, sizes_g(env), sizes_g(env))[0]

    real_destroy = env.trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion

    def destroy(*args: Any, **kwargs: Any) -> None:
        bind(real_destroy, *args, **kwargs)
        rec.destroyed.append(args)
        real_destroy(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        for p in (patched(ar, "create_allreduce_fusion_workspace", create),
                  patched(env.trtllm_ar, "trtllm_destroy_ipc_workspace_for_all_reduce_fusion",
                          destroy), *fake_kernels(env, rec.kernels)):
            stack.enter_context(p)
        yield rec


def calls(env: Any) -> None:
    ws_mod = env.workspace
    from arfuse.backends.flashinfer import comm as fi_comm
    from arfuse.call_checks import CallArgs
    from arfuse.spec import Spec

    world, hidden = 2, 256
    with recorded(env) as rec:
        created, kernels, destroyed = rec.created, rec.kernels, rec.destroyed
        for backend_name, backend in (("trtllm", ws_mod.TrtllmBackend()),
                                      ("mnnvl", ws_mod.MnnvlBackend())):
            for dtype in ("bf16", "fp16", "fp32"):
                spec = Spec(max_tokens=64, hidden=hidden, dtype=dtype)
                ws = backend.create(context(env, world), spec)
                kw = created[-1]
                check(f"{backend_name} {dtype}: create_allreduce_fusion_workspace binds",
                      ws is not None)
                comm = kw["comm_backend"]
                check(f"{backend_name} {dtype}: comm_backend is FlashInfer's TorchDistBackend "
                      "on the group's channel", isinstance(comm, env.mnnvl.TorchDistBackend)
                      and isinstance(comm, fi_comm.ChannelComm) and comm._group is env.group)
                bind(env.mnnvl.TorchDistBackend, group=env.group)
                check(f"{backend_name} {dtype}: capacity from the real "
                      "is_buffer_size_sufficient", ws.capacity > 0, str(ws.capacity))
                if backend_name == "mnnvl":
                    check(f"mnnvl {dtype}: 0.6.13's symmetric memory gets the group's name",
                          all(n == env.group.group_name
                              for n in getattr(ws.handle, "mnnvl_group_names", [])))
                run_patterns(env, ws, backend_name, dtype, kernels, CallArgs)
                check_checkpoint(env, ws, backend_name)
                ws.destroy()
            check(f"{backend_name}: destroy binds", backend_name == "mnnvl" or destroyed)


def sizes_g(env: Any) -> int:
    return int(env.sizes.ALLOC_GRANULARITY)


def run_patterns(env: Any, ws: Any, backend: str, dtype: str,
                 kernels: list[tuple[str, dict[str, Any]]], call_args: Any) -> None:
    """Every pattern arfuse uses, through the real ``allreduce_fusion`` to the kernel."""
    torch = env.torch
    from arfuse.torch_types import TORCH_DTYPES

    t = TORCH_DTYPES[dtype]
    tokens, hidden = 3, ws.spec.hidden
    x, res, w = (torch.randn(tokens, hidden).to(t), torch.randn(tokens, hidden).to(t),
                 torch.ones(hidden).to(t))
    cases: list[tuple[str, Any]] = [
        ("allreduce", call_args(x)),
        ("residual+rmsnorm", call_args(x, res, w, 1e-6, 0.0)),
        ("in place", call_args(x.clone(), res.clone(), w, 1e-6, 1.0, None, None, "linear",
                               out=None, residual_out=None)),
        ("fp8", call_args(x, res, w, 1e-6, 0.0, "fp8", 0.5, "linear")),
    ]
    if dtype != "fp32":
        cases += [("nvfp4 swizzled", call_args(x, res, w, 1e-6, 0.0, "nvfp4", 2.0,
                                               "swizzled_128x4")),
                  ("nvfp4 linear", call_args(x, res, w, 1e-6, 0.0, "nvfp4", 2.0, "linear"))]
    if env.v >= (0, 6, 15):
        cases.append(("fp8_dynamic", call_args(x, res, w, 1e-6, 0.0, "fp8_dynamic", None,
                                               "swizzled_128x4")))
    for name, call in cases:
        before = len(kernels)
        try:
            out = ws.run(call)
            ok = len(kernels) == before + 1
            detail = "no kernel call"
            if ok and call.quant == "fp8_dynamic":
                ok = out.scale_out is not None and tuple(out.scale_out.shape) == (tokens, 1)
                detail = "scale_out is not [T, 1]"
        except Exception as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        check(f"{backend} {dtype} {name}: allreduce_fusion accepts arfuse's arguments", ok,
              detail)


def check_checkpoint(env: Any, ws: Any, backend: str) -> None:
    cls = type(ws.handle)
    prepare = getattr(cls, "checkpoint_prepare", None)
    restore = getattr(cls, "checkpoint_restore", None)
    if env.v >= env.sizes.SYMM_DEVICE_MEMORY_FROM:
        try:
            bind(prepare, ws.handle)
            bind(restore, ws.handle, ws._comm_backend)
            ok, detail = True, ""
        except TypeError as exc:
            ok, detail = False, str(exc)
        check(f"{backend}: checkpoint_prepare() / checkpoint_restore(comm_backend) bind", ok,
              detail)
    # recorded allocations are not FlashInfer's SymmDeviceMemory: arfuse must say "no"
    check(f"{backend}: supports_checkpoint only on FlashInfer's own allocations",
          ws.supports_checkpoint is False)


# --- 2b. the MoE patterns (moe_rules) ----------------------------------------------------------


def kernel_source(env: Any, *parts: str) -> str:
    """A file of the kernel sources the wheel ships (``flashinfer/data``)."""
    path = os.path.join(os.path.dirname(env.flashinfer.__file__), "data", *parts)
    with open(path, encoding="utf-8") as f:
        return f.read()


def moe_patterns(env: Any) -> None:
    moe_constants(env)
    moe_drops(env)
    moe_oneshot_checks(env)
    with recorded(env) as rec:
        moe_runs(env, rec.kernels)


def moe_constants(env: Any) -> None:
    """The numbers and facts ``moe_rules`` states, in the installed package and its kernels."""
    import re

    from arfuse.backends.flashinfer import moe_rules as r

    pattern = env.trtllm_ar.AllReduceFusionPattern
    check("kMoEReductionARResidualRMSNorm, kMoEFinalizeARResidualRMSNorm == 6, 7",
          (pattern.kMoEReductionARResidualRMSNorm, pattern.kMoEFinalizeARResidualRMSNorm)
          == (r.K_MOE_REDUCTION, r.K_MOE_FINALIZE))
    params = inspect.signature(env.ar.allreduce_fusion).parameters
    moe_args = {"moe_reduction_device_num_experts", "moe_reduction_scale_input",
                "moe_reduction_active_experts_token_input", "moe_reduction_token_input",
                "expanded_idx_to_permuted_idx", "expert_scale_factor", "shared_expert_output"}
    check("the unified allreduce_fusion takes 6/7's arguments (no dedicated call needed)",
          moe_args <= set(params), str(sorted(moe_args - set(params))))
    check("the unified allreduce_fusion has no routed_scaling_factor (moe_rules.ROUTED)",
          "routed_scaling_factor" not in params)
    header = kernel_source(env, "include", "flashinfer", "comm",
                           "trtllm_moe_allreduce_fusion.cuh")
    binding = kernel_source(env, "csrc", "trtllm_moe_allreduce_fusion.cu")
    found = {name: re.findall(rf"\b{name} = (\d+);", header)
             for name in ("kOneShotMaxToken", "kBytesPerAccess")}
    check("kOneShotMaxToken, kBytesPerAccess", found == {
        "kOneShotMaxToken": [str(r.ONESHOT_MAX_TOKENS)],
        "kBytesPerAccess": [str(r.BYTES_PER_ACCESS)]}, str(found))
    clusters = re.findall(r"int cluster_size = (?:std::min\()?(\d+)", header)
    limits = re.findall(r"FLASHINFER_CHECK\(block_size <= (\d+) && cluster_size > 0", header)
    check("both launchers: a first cluster of 8, at most 1024 threads a block",
          clusters == [str(r.MAX_CLUSTER)] * 2 and limits == [str(r.MAX_BLOCK_THREADS)] * 2,
          f"{clusters} {limits}")
    dispatch = binding.split("#define DISPATCH_FLOATING_TYPES_FOR_ALLREDUCE")[1].split(
        "}()")[0]
    codes = re.findall(r"case (\w+)_code:", dispatch)
    check("the MoE bindings dispatch fp16 and bf16 only (moe_rules.MOE_DTYPES)",
          codes == ["float16", "bfloat16"], str(codes))
    check("pattern 7's top_k is the index's last dimension (a flat index reads past it)",
          "int top_k = expanded_idx_to_permuted_idx.size(-1);" in binding)
    check("pattern 7 reads its scales in the activation dtype (ScaleType = T)",
          "typename ScaleType = T>" in header and
          "moefinalize_allreduce_fusion_kernel_launcher<T, N_RANKS, RES, RMS, QUANT>(" in header)
    check("pattern 6 reads float scales",
          "reinterpret_cast<float*>(moe_reduction_scale_input.data_ptr())" in binding)


def moe_inputs(env: Any, dtype: Any, tokens: int, hidden: int,
               device: str = "cpu") -> dict[str, Any]:
    """residual_in, rms_gamma and the outputs of a call of ``tokens`` (meta: sizes only)."""
    torch = env.torch
    t = torch.empty if device == "meta" else torch.zeros
    return {"residual_in": t(tokens, hidden, dtype=dtype, device=device),
            "rms_gamma": torch.ones(hidden, dtype=dtype),
            "residual_out": t(tokens, hidden, dtype=dtype, device=device),
            "norm_out": t(tokens, hidden, dtype=dtype, device=device)}


def moe_drops(env: Any) -> None:
    """What the unified API drops or skips for 6/7, called as a user would."""
    torch = env.torch
    from arfuse.backends.flashinfer import moe_rules as r

    tokens, hidden, world, experts = 16, 256, 2, 3
    kw = {"backend": "trtllm", "world_size": world, "rank": 0, "max_token_num": 8,
          "hidden_dim": hidden, "dtype": torch.bfloat16}
    ws = real_trtllm_workspace(env, kw)
    kernels: list[tuple[str, dict[str, Any]]] = []
    common = moe_inputs(env, torch.bfloat16, tokens, hidden)
    reduction = {
        "moe_reduction_device_num_experts": experts,
        "moe_reduction_scale_input": torch.ones(experts, tokens),
        "moe_reduction_active_experts_token_input": torch.zeros(experts, tokens, hidden,
                                                                dtype=torch.bfloat16),
        "moe_reduction_token_input": torch.zeros(tokens, hidden, dtype=torch.bfloat16)}
    finalize = {"expanded_idx_to_permuted_idx": torch.zeros(tokens, 2, dtype=torch.int32),
                "expert_scale_factor": torch.ones(tokens, 2, dtype=torch.bfloat16)}
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    with contextlib.ExitStack() as stack:
        for p in fake_kernels(env, kernels):
            stack.enter_context(p)
        env.ar.allreduce_fusion(input=x, workspace=ws, pattern=r.K_MOE_REDUCTION,
                                scale_factor=torch.tensor([0.5]), **common, **reduction)
        check("pattern 6 turns a tensor scale_factor into 1.0 (moe_rules.QUANT_APART)",
              kernels[-1][1].get("scale_factor") == 1.0, str(kernels[-1][1].get("scale_factor")))
        check("pattern 6 skips the workspace's capacity check (16 tokens, max 8; ONESHOT)",
              kernels[-1][1].get("token_num") == tokens)
        env.ar.allreduce_fusion(input=x, workspace=ws, pattern=r.K_MOE_FINALIZE, **common,
                                **finalize)
        check("pattern 7 passes routed_scaling_factor=None and skips the capacity check",
              kernels[-1][0] == "trtllm_moe_finalize_allreduce_fusion"
              and kernels[-1][1].get("routed_scaling_factor", "absent") is None)
        try:
            env.ar.allreduce_fusion(input=x, workspace=ws, pattern=1, **common)
            raised = False
        except ValueError as exc:
            raised = "exceeds workspace max_token_num" in str(exc)
        check("pattern 1 does check the capacity (so 6/7 are the exception)", raised)


def moe_oneshot_checks(env: Any) -> None:
    """The wrappers' one-shot checks (ValueError past MAX_COMM_SIZE) at arfuse's boundary:
    meta tensors carry the sizes, nothing is allocated."""
    torch = env.torch
    from arfuse.backends.flashinfer import moe_rules as r

    world, hidden = 16, 7168
    bf16 = torch.bfloat16
    edge_tokens = env.sizes.MAX_COMM_SIZE // (world * hidden * 2)
    wrong: list[str] = []
    kernels: list[tuple[str, dict[str, Any]]] = []
    with contextlib.ExitStack() as stack:
        for p in fake_kernels(env, kernels):
            stack.enter_context(p)
        for finalize, tokens, rows in ((True, 4, edge_tokens), (True, 4, edge_tokens + 1),
                                       (True, edge_tokens, 4), (True, edge_tokens + 1, 4),
                                       (False, edge_tokens, 0), (False, edge_tokens + 1, 0)):
            common = moe_inputs(env, bf16, tokens, hidden, "meta")
            try:
                if finalize:
                    env.trtllm_ar.trtllm_moe_finalize_allreduce_fusion(
                        allreduce_in=torch.empty(rows, hidden, dtype=bf16, device="meta"),
                        residual_in=common["residual_in"], norm_weight=common["rms_gamma"],
                        expanded_idx_to_permuted_idx=torch.empty(tokens, 2, dtype=torch.int32,
                                                                 device="meta"),
                        norm_out=common["norm_out"], residual_out=common["residual_out"],
                        quant_out=None, scale_out=None, workspace_ptrs=torch.zeros(1),
                        launch_with_pdl=False, world_rank=0, world_size=world, eps=1e-6,
                        shared_expert_output=None, expert_scale_factor=None,
                        routed_scaling_factor=None)
                else:
                    env.trtllm_ar.trtllm_moe_allreduce_fusion(
                        world_size=world, world_rank=0, token_num=tokens, hidden_dim=hidden,
                        workspace_ptrs=torch.zeros(1), launch_with_pdl=False,
                        residual_in=common["residual_in"], rms_gamma=common["rms_gamma"],
                        rms_eps=1e-6, scale_factor=1.0, moe_reduction_device_num_experts=2,
                        moe_reduction_scale_input=torch.empty(2, tokens, device="meta"),
                        moe_reduction_active_experts_token_input=torch.empty(
                            2, tokens, hidden, dtype=bf16, device="meta"),
                        moe_reduction_token_input=common["residual_in"], layout_code=None,
                        moe_allreduce_out=None, residual_out=common["residual_out"],
                        norm_out=common["norm_out"], quant_out=None, scale_out=None)
                raised = False
            except ValueError:
                raised = True
            checked = r.oneshot_bytes(env.v, world, tokens, rows, hidden, 2, finalize)[1]
            if raised != (checked > env.sizes.MAX_COMM_SIZE):
                wrong.append(f"{'finalize' if finalize else 'reduce'} T={tokens} P={rows}: "
                             f"flashinfer raised={raised}, arfuse counts {checked}")
    check("the wrappers' one-shot checks are moe_rules.oneshot_bytes'", not wrong,
          "; ".join(wrong))


def moe_runs(env: Any, kernels: list[tuple[str, dict[str, Any]]]) -> None:
    """arfuse's own run of MoE calls, through the real unified API to the kernel bindings."""
    torch = env.torch
    from arfuse import moe
    from arfuse.arg_checks import OpShape
    from arfuse.backends.flashinfer import moe_rules as r
    from arfuse.call_checks import CallArgs
    from arfuse.spec import Spec
    from arfuse.torch_types import TORCH_DTYPES

    tokens, top_k, rows, experts, hidden = 3, 4, 9, 5, 256
    for dtype in ("bf16", "fp16", "fp32"):
        t = TORCH_DTYPES[dtype]
        ws = env.workspace.TrtllmBackend().create(context(env, 2),
                                                  Spec(max_tokens=64, hidden=hidden, dtype=dtype))
        shape = OpShape(hidden, t, dtype, torch.device("cpu"))
        index = torch.arange(tokens * top_k, dtype=torch.int32).view(tokens, top_k) % rows
        final = moe.check_finalize(shape, torch.randn(rows, hidden).to(t), index,
                                   torch.rand(tokens, top_k).to(t),
                                   torch.randn(tokens, hidden).to(t), 1.0)
        reduce = moe.check_reduce(shape, torch.randn(experts, tokens, hidden).to(t),
                                  torch.rand(experts, tokens).to(t),
                                  torch.randn(tokens, hidden).to(t))
        res, w = torch.randn(tokens, hidden).to(t), torch.ones(hidden).to(t)
        for name, step in (("finalize", final), ("reduce", reduce)):
            before = len(kernels)
            call = CallArgs(torch.empty(tokens, hidden, dtype=t), res, w, 1e-6, 0.0, moe=step)
            ws.run(call)
            got = [k for k, _ in kernels[before:]]
            if dtype == "fp32":
                check(f"fp32 {name}: refused (moe_rules.NOT_BF16), the plain kernel runs",
                      ws.moe_refusal(call) == r.NOT_BF16 and got == ["trtllm_allreduce_fusion"])
                continue
            args = kernels[-1][1]
            if name == "finalize":
                index_in = args.get("expanded_idx_to_permuted_idx")
                ok = (got == ["trtllm_moe_finalize_allreduce_fusion"]
                      and args["allreduce_in"] is step.rows and index_in is step.index
                      and tuple(index_in.shape) == (tokens, top_k) and index_in.size(-1) == top_k
                      and index_in.dtype == torch.int32
                      and args["expert_scale_factor"].dtype == t
                      and args["routed_scaling_factor"] is None
                      and args["shared_expert_output"] is step.add
                      and tuple(args["residual_in"].shape) == (tokens, hidden))
            else:
                ok = (got == ["trtllm_moe_allreduce_fusion"]
                      and args["moe_reduction_device_num_experts"] == experts
                      and args["moe_reduction_scale_input"].dtype == torch.float32
                      and args["moe_reduction_active_experts_token_input"] is step.rows
                      and args["moe_reduction_token_input"] is step.add
                      and args["token_num"] == tokens and args["hidden_dim"] == hidden
                      and args["quant_out"] is None)
            check(f"{dtype} {name}: arfuse's run reaches the kernel binding with the kernel's "
                  "shapes and dtypes", ok, f"{got} {sorted(args)}")
        if dtype != "fp32":
            routed = moe.check_finalize(shape, final.rows, final.index, final.scales, None, 2.5)
            before = len(kernels)
            ws.run(CallArgs(torch.empty(tokens, hidden, dtype=t), res, w, 1e-6, 0.0,
                            moe=routed))
            check(f"{dtype} finalize with routed_scaling_factor 2.5: expert step apart, then "
                  "the plain kernel (moe_rules.ROUTED)",
                  [k for k, _ in kernels[before:]] == ["trtllm_allreduce_fusion"])
        ws.destroy()


# --- 2c. fp8_group (group_rules) ----------------------------------------------------------------


def group_patterns(env: Any) -> None:
    group_constants(env)
    group_api_checks(env)
    with recorded(env) as rec:
        group_runs(env, rec.kernels)


def group_constants(env: Any) -> None:
    """The codes, arguments and kernel facts ``group_rules`` states, in the installed package
    and the kernel sources it ships."""
    import re

    from arfuse import quant
    from arfuse.backends.flashinfer import group_rules as g
    from arfuse.backends.flashinfer import moe_rules

    pattern = env.trtllm_ar.AllReduceFusionPattern
    check("kARResidualRMSNorm(Out)PerTokenGroupFP8PackedQuant == 8, 9",
          (pattern.kARResidualRMSNormPerTokenGroupFP8PackedQuant,
           pattern.kARResidualRMSNormOutPerTokenGroupFP8PackedQuant)
          == (g.K_GROUP_FP8, g.K_OUT_GROUP_FP8))
    for name, fn in (("allreduce_fusion", env.ar.allreduce_fusion),
                     ("trtllm_allreduce_fusion", env.trtllm_ar.trtllm_allreduce_fusion)):
        check(f"{name} takes block_quant_group_size",
              "block_quant_group_size" in inspect.signature(fn).parameters)
    header = kernel_source(env, "include", "flashinfer", "comm", "trtllm_allreduce_fusion.cuh")
    flat = " ".join(header.replace("\\\n", "\n").split())  # macros' line ends too
    facts = {
        "the scale: max(amax / 448, 1e-10) in fp32": "float y_s = fmaxf(group_absmax / "
        "FP8_E4M3_MAX, 1e-10f);" in flat and "constexpr float FP8_E4M3_MAX = 448.0f;" in flat,
        "rounded up to a power of two by its bits": "if (y_s_bits & 0x7fffff) { y_s_bits = "
        "(y_s_bits + 0x800000) & 0x7f800000; }" in flat,
        "q = clamp(y / s, +-448) to e4m3": "float q = static_cast<float>(reinterpret_cast<T*>"
        "(&val)[i]) / y_s; q = fminf(fmaxf(q, -FP8_E4M3_MAX), FP8_E4M3_MAX);" in flat,
        "y is the norm output in the activation dtype": bool(re.search(
            r"vec_t<T, VEC_SIZE> rms_norm\(vec_t<T, VEC_SIZE> const& residual", flat))
        and "val = rms_norm(val, m_gamma_val);" in flat,
        "group j's exponent byte at j % 4 of int32 (j / 4) * ceil(T/4)*4 + t":
        "int elem_idx = pack_idx * m_params.tma_aligned_mn + token_id;" in flat
        and "reinterpret_cast<uint8_t*>(m_params.scale_out)[elem_idx * 4 + pos] = exponent;"
        in flat and "int pack_idx = group_idx_in_row / 4; int pos = group_idx_in_row % 4;"
        in flat,
        "blocks widened until they hold whole groups": "while (cluster_size > 1 && "
        "(threads_per_block * VEC_SIZE) % params.block_quant_group_size != 0) { "
        "threads_per_block *= 2; cluster_size /= 2; }" in flat,
        "at most 1024 threads a block": f"FLASHINFER_CHECK(block_size <= "
        f"{moe_rules.MAX_BLOCK_THREADS} && cluster_size > 0," in flat,
        f"blocks of at least {g.MIN_BLOCK_THREADS} threads": f"while (threads_per_block < "
        f"{g.MIN_BLOCK_THREADS} && cluster_size >= 2)" in flat,
        "patterns 8/9 dispatched for every dtype (fp32 included)": bool(re.search(
            r"case AllReduceFusionPattern::kARResidualRMSNormOutPerTokenGroupFP8PackedQuant: "
            r"DISPATCH_ACC_TYPE\(", flat)),
    }
    for fact, ok in facts.items():
        check(f"pattern 9's kernel: {fact}", ok)
    eps = env.torch.tensor(1e-10, dtype=env.torch.float32).item()
    check("arfuse's fp8_group eps is the kernel's 1e-10f", eps == quant.FP8_GROUP_EPS,
          str(quant.FP8_GROUP_EPS))


def group_api_checks(env: Any) -> None:
    """What the unified API checks before pattern 9's kernel (ValueError), on a real trtllm
    workspace: arfuse's scale_out passes, the contiguous one of the same shape does not."""
    torch = env.torch
    ws = real_trtllm_workspace(env, {"world_size": 2, "rank": 0, "max_token_num": 8,
                                     "hidden_dim": 640, "dtype": torch.bfloat16})
    tokens, hidden, group = 3, 640, 128
    base = {"input": torch.zeros(tokens, hidden, dtype=torch.bfloat16), "workspace": ws,
            "pattern": 9, "launch_with_pdl": False, "residual_in": torch.zeros(
                tokens, hidden, dtype=torch.bfloat16),
            "residual_out": torch.empty(tokens, hidden, dtype=torch.bfloat16),
            "norm_out": torch.empty(tokens, hidden, dtype=torch.bfloat16),
            "quant_out": torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn),
            "rms_gamma": torch.ones(hidden, dtype=torch.bfloat16)}
    good = torch.zeros(7, dtype=torch.int32).as_strided((tokens, 2), (1, 4))
    cases = {"arfuse's strides (1, ceil(T/4)*4)": ({"scale_out": good,
                                                    "block_quant_group_size": group}, True),
             "a contiguous scale_out": ({"scale_out": torch.zeros(tokens, 2, dtype=torch.int32),
                                         "block_quant_group_size": group}, False),
             "a float32 scale_out": ({"scale_out": torch.zeros(7).as_strided((tokens, 2), (1, 4)),
                                      "block_quant_group_size": group}, False),
             "no block_quant_group_size": ({"scale_out": good}, False),
             "a group not dividing hidden": ({"scale_out": good,
                                              "block_quant_group_size": 96}, False)}
    kernels: list[tuple[str, dict[str, Any]]] = []
    with contextlib.ExitStack() as stack:
        for p in fake_kernels(env, kernels):
            stack.enter_context(p)
        for name, (extra, accepted) in cases.items():
            try:
                env.ar.allreduce_fusion(**base, **extra)
                ok, detail = accepted, "accepted"
            except ValueError as exc:
                ok, detail = not accepted, f"ValueError: {exc}"
            check(f"pattern 9, {name}: {'accepted' if accepted else 'ValueError'}", ok, detail)
    mnnvl = mnnvl_workspace(env, {"world_size": 2, "rank": 0, "max_token_num": 8,
                                  "hidden_dim": hidden, "dtype": torch.bfloat16,
                                  "comm_backend": fake_comm(env, 2)},
                            sizes_g(env), sizes_g(env))[0]
    try:
        env.ar.allreduce_fusion(**{**base, "workspace": mnnvl, "scale_out": good,
                                   "block_quant_group_size": group})
        refused = False
    except ValueError:
        refused = True
    check("mnnvl has no pattern 9 (group_rules.NOT_IN_FLASHINFER)", refused)


def group_runs(env: Any, kernels: list[tuple[str, dict[str, Any]]]) -> None:
    """arfuse's own fp8_group calls through the real unified API to the kernel bindings."""
    torch = env.torch
    from arfuse.backends.flashinfer import group_rules as g
    from arfuse.call_checks import CallArgs
    from arfuse.ops import run_on
    from arfuse.spec import Spec
    from arfuse.topology import Topology
    from arfuse.torch_types import TORCH_DTYPES

    topology = Topology(device="cuda", world_size=2, sm=90, multicast=True,
                        nvlink_all_pairs=True, flashinfer=env.version)
    hidden = 640
    wrong: list[str] = []
    for backend_name, backend in (("trtllm", env.workspace.TrtllmBackend()),
                                  ("mnnvl", env.workspace.MnnvlBackend())):
        for dtype in ("bf16", "fp16", "fp32"):
            t = TORCH_DTYPES[dtype]
            ws = backend.create(context(env, 2), Spec(max_tokens=8, hidden=hidden, dtype=dtype))
            for tokens, group, layout in itertools.product(
                    (1, 3, 8), g.GROUP_SIZES, ("ue8m0_packed", "fp32", "fp32_column_major")):
                x, res = torch.randn(tokens, hidden).to(t), torch.randn(tokens, hidden).to(t)
                call = CallArgs(x, res, torch.ones(hidden).to(t), 1e-6, 0.0, "fp8_group",
                                None, layout, group_size=group)
                label = f"{backend_name} {dtype} T={tokens} g={group} {layout}"
                before = len(kernels)
                try:
                    out = run_on(ws, call, functools.partial(ws.takes, topology))
                except Exception as exc:
                    wrong.append(f"{label}: {type(exc).__name__}: {exc}")
                    continue
                if len(kernels) != before + 1:
                    wrong.append(f"{label}: {len(kernels) - before} kernel calls")
                    continue
                name, args = kernels[-1]
                if backend_name == "mnnvl" or layout != g.FUSED_LAYOUT:
                    # the norm fused (pattern 1), the quantisation in torch
                    plain = (name == "trtllm_mnnvl_allreduce_fusion" if backend_name == "mnnvl"
                             else args.get("pattern_code") == 1)
                    if not plain or out.scale_out is None:
                        wrong.append(f"{label}: {name} {args.get('pattern_code')}")
                    continue
                scale = args.get("scale_out")
                packs, aligned = -(-hidden // group // 4), -(-tokens // 4) * 4
                ok = (args.get("pattern_code") == g.K_OUT_GROUP_FP8
                      and args.get("block_quant_group_size") == group
                      and scale is out.scale_out and scale.dtype == torch.int32
                      and tuple(scale.shape) == (tokens, packs)
                      and scale.stride() == (1, aligned)
                      and args["quant_out"].data_ptr() == out.quant_out.data_ptr()
                      and args["norm_out"].data_ptr() == out.out.data_ptr())
                if not ok:
                    wrong.append(f"{label}: {sorted(args)}")
            ws.destroy()
    check("fp8_group: arfuse's calls reach the kernel bindings (trtllm ue8m0_packed: pattern 9 "
          "with FlashInfer's shapes and strides; the rest pattern 1, then torch)", not wrong,
          "; ".join(wrong[:5]))


# --- 3. bytes -----------------------------------------------------------------------------------


def bytes_grid(env: Any) -> None:
    torch, sizes, v = env.torch, env.sizes, env.v
    from arfuse import catalog
    from arfuse.spec import Spec
    from arfuse.topology import Topology

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    grid = list(itertools.product((2, 4, 8, 16), (1, 7, 128, 777, 4096),
                                  (128, 4096, 7168), dtypes))
    own = v >= sizes.SYMM_DEVICE_MEMORY_FROM
    check("trtllm allocates through FlashInfer's SymmDeviceMemory from 0.6.15 only",
          ("SymmDeviceMemory(" in inspect.getsource(
              env.trtllm_ar.trtllm_create_ipc_workspace_for_all_reduce_fusion)) == own)
    bad: dict[str, list[str]] = {"trtllm requested": [], "trtllm allocated": [],
                                 "mnnvl requested": [], "mnnvl allocated": [],
                                 "mnnvl buffer": [], "mnnvl capacity": [], "R9 group": []}
    g = sizes.ALLOC_GRANULARITY
    for world, tokens, hidden, dtype in grid:
        spec = Spec(max_tokens=tokens, hidden=hidden, dtype=dtype)
        topo = Topology(device="cuda", world_size=world, flashinfer=env.version)
        label = f"W={world} T={tokens} H={hidden} {dtype}"
        comm = fake_comm(env, world)
        kw = {"backend": "trtllm", "world_size": world, "rank": 0, "max_token_num": tokens,
              "hidden_dim": hidden, "dtype": dtypes[dtype], "comm_backend": comm,
              "group": env.group}
        # trtllm through the real unified API
        asked, groups = trtllm_requested(env, kw)
        want = [-(-s // 16) * 16 for s in sizes.trtllm_buffer_sizes(
            v, world, tokens, hidden, spec.elem_size)]
        if asked != want:
            bad["trtllm requested"].append(f"{label}: flashinfer {asked}, arfuse {want}")
        allocated = sum(real_allocation(env, s, False, g, g)[0] if own
                        else sizes.torch_symm_bytes(s) for s in asked)
        predicted = catalog.get("trtllm").footprint(world, spec, topo).bytes_per_rank
        if allocated != predicted:
            bad["trtllm allocated"].append(f"{label}: {allocated} vs arfuse {predicted}")
        if groups and any(name != env.group.group_name for name in groups):
            bad["R9 group"].append(f"{label}: trtllm rendezvous on {groups}")
        # mnnvl through its real constructor
        if spec.row_bytes % 16 or sizes.mnnvl_requested_buffer(
                v, world, tokens, spec.row_bytes) > sizes.UINT32_MAX:
            continue
        kw["backend"] = "mnnvl"
        obj, requested = mnnvl_workspace(env, kw, g, g)
        want_requested = 3 * sizes.mnnvl_requested_buffer(v, world, tokens, spec.row_bytes)
        if requested != [want_requested]:
            bad["mnnvl requested"].append(f"{label}: {requested} vs arfuse {want_requested}")
        allocated = (real_allocation(env, requested[0], True, g, g)[0] if own
                     else sizes.torch_symm_bytes(requested[0]))
        fp = catalog.get("mnnvl").footprint(world, spec, topo)
        if allocated != fp.bytes_per_rank:
            bad["mnnvl allocated"].append(f"{label}: {allocated} vs arfuse {fp.bytes_per_rank}")
        buffer = sizes.mnnvl_usable_buffer(v, world, tokens, spec.row_bytes)
        if obj.buffer_size_bytes != buffer:
            bad["mnnvl buffer"].append(f"{label}: {obj.buffer_size_bytes} vs arfuse {buffer}")
        real_capacity = max([t for t in range(tokens + 1) if t == 0 or
                             obj.is_buffer_size_sufficient(world, t, hidden, dtypes[dtype])])
        if real_capacity != fp.capacity:
            bad["mnnvl capacity"].append(f"{label}: {real_capacity} vs arfuse {fp.capacity}")
        names = getattr(obj, "mnnvl_group_names", [])
        if any(name != env.group.group_name for name in names):
            bad["R9 group"].append(f"{label}: mnnvl rendezvous on {names}")
    for what, wrong in bad.items():
        check(f"{what} over {len(grid)} cases equals arfuse's", not wrong, "; ".join(wrong[:5]))


def fake_comm(env: Any, world: int) -> Any:
    from arfuse.backends.flashinfer import comm as fi_comm

    return fi_comm.channel_comm(context(env, world), "contract", env.mnnvl.TorchDistBackend)


def trtllm_requested(env: Any, kw: dict[str, Any]) -> tuple[list[int], list[str]]:
    """The sizes the real unified API asks its allocator for, for trtllm (stopped at its first
    GPU step after the three allocations)."""
    torch = env.torch
    asked: list[int] = []
    groups: list[str] = []
    world = kw["world_size"]

    def alloc_torch(size_bytes: int, world_size: int, dtype: Any, device: Any,
                    group_name: str) -> Any:
        asked.append(size_bytes)
        groups.append(group_name)
        return [0x1000] * world, torch.empty(0), object()

    class SymmDeviceMemory:
        def __init__(self, buf_size: int, group_size: int, group_rank: int, device_idx: int,
                     comm_backend_for_handle_transfer: Any = None,
                     enable_multicast: bool = True, allocate_signal_pads: bool = True):
            assert not enable_multicast and not allocate_signal_pads
            asked.append(buf_size)

        def get_buffer_ptrs_host(self) -> list[int]:
            return [0x1000] * world

    stops = [patched(env.trtllm_ar, "_alloc_symm_buffer_bytes", alloc_torch),
             patched(env.trtllm_ar, "trtllm_lamport_initialize", _stop),
             patched(env.trtllm_ar, "cudart", types.SimpleNamespace(
                 cudaMemset=_stop, cudaMalloc=_stop, cudaMemcpy=_stop))]
    if hasattr(env.trtllm_ar, "SymmDeviceMemory"):
        stops.append(patched(env.trtllm_ar, "SymmDeviceMemory", SymmDeviceMemory))
    with contextlib.ExitStack() as stack:
        for p in stops:
            stack.enter_context(p)
        with contextlib.suppress(Stop):
            env.ar.create_allreduce_fusion_workspace(**kw)
    return asked, groups


if __name__ == "__main__":
    sys.exit(main())
