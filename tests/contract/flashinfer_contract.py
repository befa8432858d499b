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

    trt = types.SimpleNamespace(trtllm_allreduce_fusion=recorder("trtllm_allreduce_fusion"))
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


def calls(env: Any) -> None:
    ar, ws_mod = env.ar, env.workspace
    from arfuse.backends.flashinfer import comm as fi_comm
    from arfuse.call_checks import CallArgs
    from arfuse.spec import Spec

    real_create = ar.create_allreduce_fusion_workspace
    created: list[dict[str, Any]] = []
    kernels: list[tuple[str, dict[str, Any]]] = []
    world, hidden = 2, 256

    def create(**kw: Any) -> Any:
        bind(real_create, **kw)
        created.append(kw)
        if kw["backend"] == "trtllm":
            return real_trtllm_workspace(env, kw)
        return mnnvl_workspace(env, kw, sizes_g(env), sizes_g(env))[0]

    destroyed: list[tuple[Any, ...]] = []
    real_destroy = env.trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion

    def destroy(*args: Any, **kwargs: Any) -> None:
        bind(real_destroy, *args, **kwargs)
        destroyed.append(args)
        real_destroy(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        for p in (patched(ar, "create_allreduce_fusion_workspace", create),
                  patched(env.trtllm_ar, "trtllm_destroy_ipc_workspace_for_all_reduce_fusion",
                          destroy), *fake_kernels(env, kernels)):
            stack.enter_context(p)
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
