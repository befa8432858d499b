"""FlashInfer's fused all-reduce on CUDA: ``trtllm`` (IPC, one node) and ``mnnvl`` (multicast).

Written against FlashInfer 0.6.13's unified API (``flashinfer.comm.allreduce``); NOT VERIFIED
ON HARDWARE in this repository's CI (no GPU there): the tests drive it through a stand-in of that
API. What it designs out:

* R9: ``comm_backend`` is a ``TorchDistBackend`` bound to the given group (0.6.13 ignores
  ``group=`` for mnnvl and would rendezvous on WORLD).
* R1: capacity is FlashInfer's own ``is_buffer_size_sufficient`` for the mode that will run;
  ``use_oneshot=None`` lets mnnvl pick the mode its workspace was sized for (vLLM #47284).
* R2: a null multicast pointer fails validation (0.6.13 does not check it; vLLM #48071), and a
  functional all-reduce runs with a deadline before the workspace is used.
* R10: trtllm's explicit destroy function frees the IPC buffers ``destroy()`` leaves behind; the
  one-shot table's missing world-size-16 entry (KeyError) is avoided by choosing the mode here.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ...call_checks import CallArgs
from ...epilogue import FusedOutput
from ...errors import CreationFailed, NegotiationTimeout
from ...quant import nvfp4_scale_shape
from ...sizing import largest_fitting
from ...spec import Spec
from ...topology import Topology, flashinfer_version
from ...torch_types import TORCH_DTYPES, device_of
from ..base import Backend, Workspace

# AllReduceFusionPattern (flashinfer/comm/trtllm_ar.py)
K_ALLREDUCE, K_RESIDUAL_RMSNORM = 0, 1
K_OUT_FP8_QUANT, K_OUT_FP4_QUANT = 4, 5
# QuantizationSFLayout
LAYOUT_CODE = {"swizzled_128x4": 0, "linear": 2}
# trtllm's one-shot heuristic covers only these world sizes (MiB of traffic per call)
_TRTLLM_ONESHOT_MIB = {2: 512, 4: 64, 8: 42}


def _import_comm() -> tuple[Any, str]:
    try:
        import flashinfer.comm.allreduce as fi_allreduce
    except Exception as exc:  # ImportError, or CUDA errors raised at import
        return None, f"flashinfer.comm cannot be imported: {type(exc).__name__}: {exc}"
    return fi_allreduce, ""


def trtllm_use_oneshot(world: int, tokens: int, hidden: int, elem: int) -> bool | None:
    """``None`` (FlashInfer decides) where its table has the world size; else a safe choice:
    two-shot needs more tokens than ranks, and one-shot traffic is kept to the table's 42 MiB."""
    if world in _TRTLLM_ONESHOT_MIB:
        return None
    mib = tokens * hidden * 2 * world * elem / 2**20
    return tokens <= world or mib <= _TRTLLM_ONESHOT_MIB[8]


class FlashInferWorkspace(Workspace):
    fuses_quant = True  # the descriptor still decides per topology (NVFP4 needs SM >= 100)

    def __init__(self, ctx: Any, spec: Spec, handle: Any, comm: Any):
        self._handle, self._comm = handle, comm
        self._dtype = TORCH_DTYPES[spec.dtype]
        self._poisoned = False
        super().__init__(ctx, spec, nbytes=0, capacity=0)
        topology = Topology(device="cuda", world_size=ctx.world_size,
                            flashinfer=flashinfer_version())
        self.nbytes = int(getattr(handle, "workspace_size_bytes", 0)) or \
            self.descriptor.footprint(ctx.world_size, spec, topology).bytes_per_rank
        # R1: the largest token count FlashInfer itself accepts for this workspace
        self.capacity = largest_fitting(spec.max_tokens, lambda tokens: bool(
            handle.is_buffer_size_sufficient(ctx.world_size, tokens, spec.hidden, self._dtype)))

    @property
    def handle(self) -> Any:
        """FlashInfer's own workspace object (``allreduce_fusion`` dispatches on its type), or
        ``None`` once destroyed."""
        return self._handle

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
        x, weight, out, residual_out = call.x, call.weight, call.out, call.residual_out
        tokens, hidden = x.shape
        kwargs: dict[str, Any] = {"launch_with_pdl": False}
        if self.backend == "trtllm":
            kwargs.update(trigger_completion_at_end=True, fp32_acc=True,
                          use_oneshot=trtllm_use_oneshot(self.ctx.world_size, tokens, hidden,
                                                         x.element_size()))
        else:
            kwargs["use_oneshot"] = None  # R1: the mode the workspace was sized for
        if weight is None:
            summed = out if out is not None else torch.empty_like(x)
            self._comm.allreduce_fusion(input=x, workspace=self._handle, pattern=K_ALLREDUCE,
                                        output=summed, **kwargs)
            return FusedOutput(summed)
        residual_in = call.residual if call.residual is not None else torch.zeros_like(x)
        norm_out = out if out is not None else torch.empty_like(x)
        if residual_out is None:
            residual_out = torch.empty_like(x)
        quant_out = scale_out = scale_bytes = None
        pattern = K_RESIDUAL_RMSNORM
        if call.quant is not None:
            assert call.scale is not None
            kwargs["scale_factor"] = torch.tensor([call.scale], dtype=torch.float32,
                                                  device=x.device)
            if call.quant == "fp8":
                pattern = K_OUT_FP8_QUANT
                quant_out = torch.empty((tokens, hidden), dtype=torch.float8_e4m3fn,
                                        device=x.device)
            else:
                pattern = K_OUT_FP4_QUANT
                kwargs["layout_code"] = LAYOUT_CODE[call.layout]
                quant_out = torch.empty((tokens, hidden // 2), dtype=torch.uint8, device=x.device)
                rows, cols = nvfp4_scale_shape(tokens, hidden, call.layout)
                # zeroed: FlashInfer never writes the swizzle padding
                scale_out = torch.zeros(rows * cols, dtype=torch.float8_e4m3fn, device=x.device)
                scale_bytes = scale_out.view(torch.uint8).view(rows, cols)
        self._comm.allreduce_fusion(
            input=x, workspace=self._handle, pattern=pattern, residual_in=residual_in,
            residual_out=residual_out, norm_out=norm_out, quant_out=quant_out,
            scale_out=scale_out, rms_gamma=weight, rms_eps=call.eps,
            weight_bias=call.weight_bias,
            **kwargs)
        return FusedOutput(norm_out, residual_out, quant_out, scale_bytes)

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


class FlashInferBackend(Backend):
    """Creates ``workspace_class`` through ``flashinfer.comm``; one subclass per backend."""

    workspace_class: type[FlashInferWorkspace] = FlashInferWorkspace

    def blocker(self, ctx: Any, spec: Spec) -> str:
        if not torch.cuda.is_available():
            return "no CUDA device in this process"
        if ctx.device != "cuda":
            return f"the group's tensors are on {ctx.device}"
        why = _import_comm()[1]
        if why or self.name != "mnnvl":
            return why
        try:
            from flashinfer.comm import mnnvl
        except Exception as exc:
            return f"flashinfer.comm.mnnvl: {type(exc).__name__}: {exc}"
        supported = getattr(mnnvl, "is_multicast_supported", None)  # FlashInfer >= 0.6.16
        if supported is not None and not supported(torch.cuda.current_device()):
            return "this GPU reports no multicast support"
        return ""

    def create(self, ctx: Any, spec: Spec) -> Workspace | None:
        comm, why = _import_comm()
        if comm is None:
            raise CreationFailed(why)
        mode = ctx.fault(self.name, "create")
        if mode == "none":
            return None
        from flashinfer.comm.mnnvl import TorchDistBackend

        handle = comm.create_allreduce_fusion_workspace(
            backend=self.name, world_size=ctx.world_size, rank=ctx.rank,
            max_token_num=spec.max_tokens, hidden_dim=spec.hidden,
            dtype=TORCH_DTYPES[spec.dtype], comm_backend=TorchDistBackend(ctx.group),
            group=ctx.group)
        if handle is None:
            return None
        workspace = self.workspace_class(ctx, spec, handle, comm)
        if mode == "null":
            workspace.poison()
        return workspace


class MnnvlBackend(FlashInferBackend):
    name = "mnnvl"
    workspace_class = MnnvlWorkspace


class TrtllmBackend(FlashInferBackend):
    name = "trtllm"
    workspace_class = TrtllmWorkspace
