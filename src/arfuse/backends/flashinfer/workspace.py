"""FlashInfer's fused all-reduce on CUDA: ``trtllm`` (IPC, one node) and ``mnnvl`` (multicast).

Written against FlashInfer's unified API (``flashinfer.comm.allreduce``), 0.6.13 through
0.7.2.post1 (the primary version); NOT VERIFIED ON HARDWARE in this repository's CI (no GPU
there): the tests drive it through a stand-in of that API, and
``tests/contract/flashinfer_contract.py`` binds every call to the real packages' signatures.
What it designs out:

* R9: ``comm_backend`` is FlashInfer's ``TorchDistBackend`` bound to the given group (0.6.13
  ignores ``group=`` for mnnvl and would rendezvous on WORLD), its exchanges run on the group's
  channel (``comm``): a constructor that raises on one rank is a failed vote on every rank,
  never a hang in a peer's handle exchange; ``comm.agree_to_enter`` first settles what would
  make it raise on some ranks only.
* R1: capacity is FlashInfer's own ``is_buffer_size_sufficient`` for the mode that will run;
  ``use_oneshot=None`` lets mnnvl pick the mode its workspace was sized for (vLLM #47284).
* R2: multicast is agreed before creation (``local_check``: the installed FlashInfer's own check,
  else the driver's attribute, else torch's; unknown blocks); a null multicast pointer fails
  validation (0.6.13 does not check it; vLLM #48071), and a functional all-reduce runs with a
  deadline before the workspace is used.
* R10: trtllm's explicit destroy function frees the IPC buffers ``destroy()`` leaves behind; the
  one-shot table's missing world-size-16 entry (KeyError) is avoided by choosing the mode here.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from ... import catalog, log, moe
from ...call_checks import CallArgs
from ...errors import ArfuseError, CreationFailed, NegotiationTimeout
from ...pattern import quant_output
from ...quant import quantize
from ...result import FusedOutput
from ...sizing import largest_fitting
from ...spec import Spec
from ...topology import Topology, flashinfer_version
from ...torch_types import TORCH_DTYPES, device_of
from ..base import Backend, Workspace
from . import MNNVL_WORLD_SIZES, TRTLLM_WORLD_SIZES, group_rules, moe_rules
from .comm import agree_to_enter, channel_comm
from .probe import confidential_compute, fabric_handles, multicast_support
from .sizes import SYMM_DEVICE_MEMORY_FROM, sizing_version, trtllm_capacity, version_tuple

# AllReduceFusionPattern (flashinfer/comm/trtllm_ar.py)
K_ALLREDUCE, K_RESIDUAL_RMSNORM = 0, 1
K_FP8_QUANT, K_FP4_QUANT = 2, 3
K_OUT_FP8_QUANT, K_OUT_FP4_QUANT = 4, 5
K_DYNAMIC_FP8_QUANT, K_OUT_DYNAMIC_FP8_QUANT = 10, 11   # FlashInfer >= 0.6.15
K_OUT_GROUP_FP8_QUANT = group_rules.K_OUT_GROUP_FP8      # trtllm, ue8m0_packed scales
# QuantizationSFLayout
LAYOUT_CODE = {"swizzled_128x4": 0, "linear": 2}
# trtllm's one-shot heuristic covers only these world sizes (MiB of traffic per call)
_TRTLLM_ONESHOT_MIB = {2: 512, 4: 64, 8: 42}
WORLD_SIZES = {"mnnvl": MNNVL_WORLD_SIZES, "trtllm": TRTLLM_WORLD_SIZES}


def _import_comm() -> tuple[Any, str]:
    try:
        import flashinfer.comm.allreduce as fi_allreduce
    except Exception as exc:  # ImportError, or CUDA errors raised at import
        return None, f"flashinfer.comm cannot be imported: {type(exc).__name__}: {exc}"
    return fi_allreduce, ""


def installed_version() -> str | None:
    """The imported FlashInfer's ``__version__`` (the code that runs), else its metadata."""
    module = sys.modules.get("flashinfer")
    version = getattr(module, "__version__", None)
    return str(version) if version else flashinfer_version()


def trtllm_use_oneshot(world: int, tokens: int, hidden: int, elem: int) -> bool | None:
    """``None`` (FlashInfer decides) where its table has the world size; else a safe choice:
    two-shot needs more tokens than ranks, and one-shot traffic is kept to the table's 42 MiB."""
    if world in _TRTLLM_ONESHOT_MIB:
        return None
    mib = tokens * hidden * 2 * world * elem / 2**20
    return tokens <= world or mib <= _TRTLLM_ONESHOT_MIB[8]


def _symm_device_memory() -> type | None:
    """FlashInfer's own allocation class (the one that can checkpoint), if importable."""
    try:
        from flashinfer.comm.mnnvl import SymmDeviceMemory
    except Exception:
        return None
    return SymmDeviceMemory if isinstance(SymmDeviceMemory, type) else None


class FlashInferWorkspace(Workspace):

    def __init__(self, ctx: Any, spec: Spec, handle: Any, comm: Any,
                 comm_backend: Any = None, version: str | None = None):
        self._handle, self._comm, self._comm_backend = handle, comm, comm_backend
        self._version = version
        self._dtype = TORCH_DTYPES[spec.dtype]
        self._poisoned = self._detached = False
        self._scope = str(getattr(ctx.channel, "scope", "-"))
        self._checkpoints = 0
        self._apart: set[str] = set()  # why calls ran a step apart (logged once each)
        super().__init__(ctx, spec, nbytes=0, capacity=0)
        try:
            self._measure(ctx, spec, version)
        except Exception as exc:  # the handle is FlashInfer's memory: freed with the group's
            raise CreationFailed(f"sizing the {self.backend} workspace failed: "
                                 f"{type(exc).__name__}: {exc}", workspace=self) from exc

    def _measure(self, ctx: Any, spec: Spec, version: str | None) -> None:
        handle = self._handle
        topology = Topology(device="cuda", world_size=ctx.world_size, flashinfer=version)
        predicted = self.descriptor.footprint(ctx.world_size, spec, topology)
        self.nbytes = self.allocated_bytes() or predicted.bytes_per_rank
        # R1: the largest token count FlashInfer itself accepts for this workspace
        self.capacity = largest_fitting(spec.max_tokens, lambda tokens: bool(
            handle.is_buffer_size_sufficient(ctx.world_size, tokens, spec.hidden, self._dtype)))
        if self.backend == "trtllm":  # fp32 before 0.7.2: its two-shot buffer is half the size
            self.capacity = min(self.capacity, trtllm_capacity(
                sizing_version(version), ctx.world_size, spec.max_tokens, spec.elem_size))

    @property
    def handle(self) -> Any:
        """FlashInfer's own workspace object (``allreduce_fusion`` dispatches on its type), or
        ``None`` once destroyed."""
        return self._handle

    def _symm_memories(self) -> list[Any] | None:
        """The ``SymmDeviceMemory`` objects holding this workspace (FlashInfer >= 0.6.15), or
        ``None`` where torch's symmetric memory holds it (older, or Confidential Computing)."""
        handle = self._handle
        if handle is None:
            return None
        if self.backend == "mnnvl":
            memories = [getattr(getattr(handle, "handle", None), "mcast_device_memory", None)]
        else:
            memories = list(vars(handle).get("mem_handles") or [])
        symm = _symm_device_memory()
        if not memories or symm is None or not all(isinstance(m, symm) for m in memories):
            return None
        return memories

    def allocated_bytes(self) -> int | None:
        """Bytes this rank's buffers really hold, where FlashInfer exposes them (its own
        allocations, >= 0.6.15); ``None`` otherwise (the descriptor's formula then stands:
        trtllm's ``workspace_size_bytes`` reads 0, mnnvl's counts usable bytes only)."""
        memories = self._symm_memories()
        if memories is None:
            return None
        sizes = [getattr(m, "allocation_size", None) for m in memories]
        if not all(isinstance(size, int) and size > 0 for size in sizes):
            return None
        return sum(int(size) for size in sizes if size is not None)

    # --- checkpoint (FlashInfer >= 0.6.15, its own allocations only) -----------------------

    @property
    def supports_checkpoint(self) -> bool:
        """True where FlashInfer can release and restore this workspace's memory at the same
        virtual addresses (graphs stay valid): >= 0.6.15, not torch-backed."""
        handle = self._handle
        return (handle is not None and callable(getattr(type(handle), "checkpoint_prepare", None))
                and version_tuple(self._version) >= SYMM_DEVICE_MEMORY_FROM
                and self._comm_backend is not None and self._symm_memories() is not None)

    def _checkpoint_scope(self) -> None:
        if not self.supports_checkpoint:
            raise NotImplementedError(
                f"{self.backend} workspace of FlashInfer {self._version} cannot checkpoint "
                "(needs FlashInfer >= 0.6.15 and its own allocations; supports_checkpoint is "
                "False)")
        self._checkpoints += 1
        self._comm_backend.rescope(f"{self._scope}/checkpoint{self._checkpoints}")

    def checkpoint_prepare(self) -> None:
        """Collective: release the physical memory, keep the addresses; calls refuse until
        ``checkpoint_restore``."""
        self._checkpoint_scope()
        self._handle.checkpoint_prepare()
        self._detached = True

    def checkpoint_restore(self) -> None:
        """Collective: map fresh memory at the same addresses, exchanging handles within this
        workspace's own group."""
        self._checkpoint_scope()
        self._handle.checkpoint_restore(self._comm_backend)
        self._detached = False

    # --- use ---------------------------------------------------------------------------------

    def poison(self) -> None:
        self._poisoned = True

    def validate(self) -> None:
        if self.backend == "mnnvl":
            mc_ptr = getattr(self._handle, "mc_ptr", None)
            if self._poisoned or not mc_ptr:
                raise CreationFailed("mnnvl workspace has a null multicast pointer: no NVSwitch "
                                     "multicast on this rank (vLLM #48071)")
        elif self._poisoned:
            raise CreationFailed("trtllm workspace has no IPC buffers (injected null)")
        self.ctx.barrier("validate", self.backend)
        x = torch.full((1, self.spec.hidden), float(self.ctx.rank + 1), dtype=self._dtype,
                       device=device_of(self.ctx.device))
        out = self.run(CallArgs(x)).out
        if out.is_cuda:
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
            deadline = time.monotonic() + self.ctx.timeout_s
            # a broken peer mapping hangs the kernel: never wait forever
            while not done.query():  # type: ignore[no-untyped-call]
                if time.monotonic() > deadline:
                    raise NegotiationTimeout("validate", self.backend, None,
                                             self.ctx.timeout_s)
                time.sleep(0.0005)
        world = self.ctx.world_size
        if not bool(torch.all(out == world * (world + 1) / 2)):
            expected = world * (world + 1) / 2
            raise CreationFailed("functional check failed: the fused all-reduce returned "
                                 f"{out.flatten()[0].item():g}, expected {expected:g}")

    def run(self, call: CallArgs) -> FusedOutput:
        """Caller-given destinations go to the kernel as its outputs (``norm_out = input``
        and ``residual_out = residual_in`` in place, as vLLM passes them)."""
        if self._detached:
            raise ArfuseError(f"{self.backend} workspace is checkpointed: call "
                              "checkpoint_restore() on every rank before the next call")
        if call.moe is not None:
            return self._run_moe(call)
        return self._run_all_reduce(call)

    def _kwargs(self, call: CallArgs) -> dict[str, Any]:
        """The mode arguments of a call of patterns 0-5, 9-11."""
        kwargs: dict[str, Any] = {"launch_with_pdl": False}
        if self.backend == "trtllm":
            tokens, hidden = call.x.shape
            kwargs.update(trigger_completion_at_end=True, fp32_acc=True,
                          use_oneshot=trtllm_use_oneshot(self.ctx.world_size, tokens, hidden,
                                                         call.x.element_size()))
        else:
            kwargs["use_oneshot"] = None  # R1: the mode the workspace was sized for
        return kwargs

    @staticmethod
    def _norm_tensors(call: CallArgs) -> dict[str, Any]:
        """``residual_in`` (zeros without a residual: FlashInfer always adds one),
        ``norm_out`` and ``residual_out`` (the caller's, else new), the norm's arguments."""
        x = call.x
        return {"residual_in": call.residual if call.residual is not None
                else torch.zeros_like(x),
                "norm_out": call.out if call.out is not None else torch.empty_like(x),
                "residual_out": call.residual_out if call.residual_out is not None
                else torch.empty_like(x),
                "rms_gamma": call.weight, "rms_eps": call.eps, "weight_bias": call.weight_bias}

    def _run_all_reduce(self, call: CallArgs) -> FusedOutput:
        x = call.x
        tokens, hidden = x.shape
        kwargs = self._kwargs(call)
        if call.weight is None:
            summed = call.out if call.out is not None else torch.empty_like(x)
            # a quantised call without RMSNorm comes without its quantisation (the descriptor
            # does not fuse it: FlashInfer quantises only after its RMSNorm)
            self._comm.allreduce_fusion(input=x, workspace=self._handle, pattern=K_ALLREDUCE,
                                        output=summed, **kwargs)
            return FusedOutput(summed)
        norm = self._norm_tensors(call)
        quant_out = scale_out = scale_result = None
        pattern = K_RESIDUAL_RMSNORM
        if call.quant == group_rules.QUANT:
            why = group_rules.call_refusal(self.backend, call.layout, hidden,
                                           x.element_size(), call.group_size)
            if why:  # the kernel would not take it (a group size its launcher refuses)
                return self._quantised_apart(call, why)
            # pattern 9 (8 writes no norm output); UE8M0 exponents, four groups per int32, in
            # the strides FlashInfer checks; zeroed so that padding reads zero
            pattern = K_OUT_GROUP_FP8_QUANT
            kwargs["block_quant_group_size"] = call.group_size
            quant_out = torch.empty((tokens, hidden), dtype=torch.float8_e4m3fn,
                                    device=x.device)
            packed, strides, storage = quant_output(call.quant, call.layout).scale_geometry(
                tokens, hidden, call.group_size)
            scale_out = scale_result = torch.zeros(storage, dtype=torch.int32,
                                                   device=x.device).as_strided(packed, strides)
        elif call.quant == "fp8_dynamic":
            # per-token scales [T, 1] fp32, computed by the kernel: no scale_factor
            pattern = K_OUT_DYNAMIC_FP8_QUANT
            quant_out = torch.empty((tokens, hidden), dtype=torch.float8_e4m3fn,
                                    device=x.device)
            scale_out = scale_result = torch.empty((tokens, 1), dtype=torch.float32,
                                                   device=x.device)
        elif call.quant is not None:
            assert call.scale is not None
            kwargs["scale_factor"] = torch.tensor([call.scale], dtype=torch.float32,
                                                  device=x.device)
            if call.quant == "fp8":
                pattern = K_OUT_FP8_QUANT
                quant_out = torch.empty((tokens, hidden), dtype=torch.float8_e4m3fn,
                                        device=x.device)
            else:
                pattern = K_OUT_FP4_QUANT
                kwargs["layout_code"] = LAYOUT_CODE[str(call.layout)]
                quant_out = torch.empty((tokens, hidden // 2), dtype=torch.uint8, device=x.device)
                shape = quant_output("nvfp4", call.layout).scale_shape(tokens, hidden)
                assert shape is not None
                rows, cols = shape
                # zeroed: FlashInfer never writes the swizzle padding
                scale_out = torch.zeros(rows * cols, dtype=torch.float8_e4m3fn, device=x.device)
                scale_result = scale_out.view(torch.uint8).view(rows, cols)
        self._comm.allreduce_fusion(input=x, workspace=self._handle, pattern=pattern,
                                    quant_out=quant_out, scale_out=scale_out, **norm, **kwargs)
        return FusedOutput(norm["norm_out"], norm["residual_out"], quant_out, scale_result)

    def _quantised_apart(self, call: CallArgs, why: str) -> FusedOutput:
        """The call without its quantisation in the kernel, then the quantisation in torch
        (the same bytes as the reference's for the kernel's norm output)."""
        self._log_apart(why)
        result = self._run_all_reduce(call.without_quant())
        quant_out, scale_out = quantize(result.out, call.output, call.scale, call.group_size)
        return FusedOutput(result.out, result.residual_out, quant_out, scale_out)

    def _log_apart(self, why: str) -> None:
        if why not in self._apart:  # once per workspace and reason
            self._apart.add(why)
            log.logger.info("arfuse group %s: %s runs a step of a call apart: %s",
                            self.ctx.key, self.backend, why)

    def moe_refusal(self, call: CallArgs) -> str:
        """Why this MoE call runs its expert step apart ("" when FlashInfer's kernel takes it):
        ``moe_rules``, the one home of these rules."""
        step = call.moe
        assert step is not None
        if self.backend != "trtllm":
            return moe_rules.TRTLLM_ONLY
        return moe_rules.pattern_refusal(self.spec, call.pattern) or moe_rules.call_refusal(
            sizing_version(self._version), self.ctx.world_size, self.spec,
            step.index is not None, call.tokens, int(step.rows.shape[0]), step.routed,
            step.scales.dtype == self._dtype)

    def _run_moe(self, call: CallArgs) -> FusedOutput:
        """Pattern 7 (finalize) or 6 (reduction) in FlashInfer's kernel where ``moe_refusal``
        lets it take the call; else the expert step here (the torch reference), then the
        fused all-reduce of the rows it made. The kernel reads every index unchecked, so the
        index is checked first (a ``RefusedStep`` names a bad entry)."""
        step = call.moe
        assert step is not None
        why = self.moe_refusal(call)
        if why:
            self._log_apart(f"a MoE call's expert step, then the fused all-reduce: {why}")
            moe.local_rows(step, call.x)
            return self._run_all_reduce(call.without_moe())
        problem = moe.index_problem(step)
        if problem:
            raise moe.RefusedStep(problem)
        norm = self._norm_tensors(call)
        common = {"workspace": self._handle, "launch_with_pdl": False, **norm}
        if step.index is not None:
            # the index as [T, top_k] (the kernel's top_k is its last dimension), the scales
            # in the activation dtype (its ScaleType)
            self._comm.allreduce_fusion(
                input=step.rows, pattern=moe_rules.K_MOE_FINALIZE,
                expanded_idx_to_permuted_idx=step.index, expert_scale_factor=step.scales,
                shared_expert_output=step.add, **common)
        else:
            # expert-major [E, T, H] and [E, T] as the kernel indexes them; fp32 scales (it
            # reads floats: activation-dtype scales widen exactly)
            self._comm.allreduce_fusion(
                input=call.x, pattern=moe_rules.K_MOE_REDUCTION,
                moe_reduction_device_num_experts=step.fan_in,
                moe_reduction_scale_input=step.scales.float(),
                moe_reduction_active_experts_token_input=step.rows,
                moe_reduction_token_input=step.add, **common)
        return FusedOutput(norm["norm_out"], norm["residual_out"])

    def _free(self) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        if self.backend == "trtllm" and getattr(handle, "ipc_handles", None) is not None:
            import flashinfer.comm.trtllm_ar as trtllm_ar

            # destroy() alone leaves the IPC buffers referenced in a module dict (R10)
            trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(handle.ipc_handles,
                                                                         self.ctx.group)
        handle.destroy()


class MnnvlWorkspace(FlashInferWorkspace):
    backend = "mnnvl"


class TrtllmWorkspace(FlashInferWorkspace):
    backend = "trtllm"


def _cuda_here(ctx: Any) -> bool:
    return bool(ctx.device == "cuda" and torch.cuda.is_available())


class FlashInferBackend(Backend):
    """Creates ``workspace_class`` through ``flashinfer.comm``; one subclass per backend."""

    workspace_class: type[FlashInferWorkspace] = FlashInferWorkspace

    def local_check(self, ctx: Any, spec: Spec) -> str:
        if not torch.cuda.is_available():
            return "no CUDA device in this process"
        if ctx.device != "cuda":
            return f"the group's tensors are on {ctx.device}"
        why = _import_comm()[1]
        if why:
            return why
        sizes = WORLD_SIZES[self.name]
        if ctx.world_size not in sizes:
            return f"world size {ctx.world_size} not in {sorted(sizes)}"
        if self.name != "mnnvl":
            return ""
        if confidential_compute():
            return ("NVIDIA Confidential Computing is on: FlashInfer's mnnvl refuses it (no "
                    "multicast)")
        device = torch.cuda.current_device()
        supported, source = multicast_support(device, installed_version())
        if supported is None:
            return ("multicast support unknown on this rank (no FlashInfer, driver or torch "
                    "answer): treated as absent")
        if not supported:
            return f"this GPU reports no multicast support ({source})"
        return ""

    def _entry_facts(self, ctx: Any, spec: Spec,
                     version: str | None) -> tuple[dict[str, Any], str]:
        """What every rank must share to enter the constructor together, and this rank's own
        reason not to (free memory below the predicted bytes)."""
        if not _cuda_here(ctx):
            return {"flashinfer": version}, ""
        device = torch.cuda.current_device()
        facts = {"flashinfer": version, "fabric": fabric_handles(device),
                 "confidential_compute": confidential_compute()}
        topology = Topology(device="cuda", world_size=ctx.world_size, flashinfer=version)
        need = catalog.get(self.name).footprint(ctx.world_size, spec, topology).bytes_per_rank
        free, _ = torch.cuda.mem_get_info(device)
        if free < need:
            return facts, (f"needs {need / 2**20:.0f} MiB of GPU memory, "
                           f"{free / 2**20:.0f} MiB free")
        return facts, ""

    def create(self, ctx: Any, spec: Spec) -> Workspace | None:
        comm, why = _import_comm()
        if comm is None:
            raise CreationFailed(why)
        sizes = WORLD_SIZES[self.name]
        if ctx.world_size not in sizes:  # the same on every rank: nobody enters
            raise CreationFailed(f"{self.name} does not run at world size {ctx.world_size} "
                                 f"(FlashInfer supports {sorted(sizes)})")
        mode = ctx.fault(self.name, "create")
        if mode == "none":
            return None
        from flashinfer.comm.mnnvl import TorchDistBackend

        version = installed_version()
        facts, problem = self._entry_facts(ctx, spec, version)
        agree_to_enter(ctx, self.name, facts, problem)
        comm_backend = channel_comm(ctx, self.name, TorchDistBackend)
        handle = comm.create_allreduce_fusion_workspace(
            backend=self.name, world_size=ctx.world_size, rank=ctx.rank,
            max_token_num=spec.max_tokens, hidden_dim=spec.hidden,
            dtype=TORCH_DTYPES[spec.dtype], comm_backend=comm_backend, group=ctx.group)
        if handle is None:
            return None
        workspace = self.workspace_class(ctx, spec, handle, comm, comm_backend, version)
        if mode == "null":
            workspace.poison()
        return workspace


class MnnvlBackend(FlashInferBackend):
    name = "mnnvl"
    workspace_class = MnnvlWorkspace


class TrtllmBackend(FlashInferBackend):
    name = "trtllm"
    workspace_class = TrtllmWorkspace
