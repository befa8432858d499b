"""``FusedAllReduce``: the user-facing op (DESIGN 3.6): validation, capacity gate, dispatch.

Construction is collective (every rank of the group, same arguments, same order). A call is
collective too: every rank calls with the same number of tokens. Bad input is an error that
names the argument; a call over the workspace's capacity is not an error: it runs unfused
(R1) and is counted in ``stats()``.
"""

from __future__ import annotations

from typing import Any

import torch

from . import faults
from . import settings as settings_mod
from .backends.base import Workspace
from .backends.torch_dist import TorchWorkspace
from .epilogue import FusedOutput, quantize
from .policy import Plan, quant_fusion
from .quant import LAYOUTS, scale_value
from .registry import REGISTRY, Lease
from .spec import Spec, parse_dtype, parse_quant
from .torch_types import TORCH_DTYPES


class FusedAllReduce:
    """all-reduce(x) [+ residual -> RMSNorm [-> FP8 | NVFP4]] on the negotiated backend."""

    def __init__(self, group: Any = None, max_token_num: int = 2048, hidden_dim: int = 4096,
                 dtype: Any = torch.bfloat16, backend: str | None = None,
                 quant: str | None = None, *, strict: bool | None = None,
                 timeout_s: float | None = None, device: str | None = None) -> None:
        conf = settings_mod.load(backend=backend, strict=strict, timeout_s=timeout_s)
        from . import log

        log.configure(conf.log_level)
        spec = Spec(max_tokens=max_token_num, hidden=hidden_dim, dtype=parse_dtype(dtype),
                    quant=parse_quant(quant))
        self.spec = spec
        self._dtype = TORCH_DTYPES[spec.dtype]
        self._lease: Lease | None = REGISTRY.acquire(group, spec, conf, device)
        ws = self._lease.entry.workspace
        self._ws: Workspace | None = ws
        self._device_type = self._lease.ctx.device
        outcome = self._lease.entry.outcome
        self._fuses_quant = ws.fuses_quant and quant_fusion(ws.backend, outcome.topology,
                                                            spec)
        self._unfused: TorchWorkspace | None = None
        self._calls = self._fused_calls = self._over_capacity = self._fast_calls = 0
        # the kernel's own checked entry, unless faults must fire on calls or quantisation
        # must run as a separate step
        self._fast = ws.fast_call if not ws.call_fault and (
            self._fuses_quant or spec.quant is None) else None

    # --- what was decided --------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """The backend every rank of the group negotiated (may differ from ``plan.backend``
        when the first candidate failed to create on some rank)."""
        return self._lease.entry.workspace.backend if self._lease else "closed"

    @property
    def plan(self) -> Plan:
        assert self._lease is not None, "closed"
        return self._lease.plan

    @property
    def attempts(self) -> tuple[Any, ...]:
        assert self._lease is not None, "closed"
        return self._lease.entry.outcome.attempts

    @property
    def workspace(self) -> Workspace:
        if self._ws is None:
            raise RuntimeError("this FusedAllReduce is closed")
        return self._ws

    @property
    def capacity(self) -> int:
        """Tokens per call that run fused; larger calls run unfused."""
        return self.workspace.capacity

    def input_buffer(self, tokens: int) -> torch.Tensor:
        """A ``[tokens, hidden]`` tensor to compute the next call's ``x`` into (for example
        ``torch.matmul(a, w.t(), out=comm.input_buffer(n))``). On shm it is this rank's
        shared-memory slot, which saves a copy per call; elsewhere a plain tensor. Valid for
        the next call only. On shm the same tensor object comes back for the same slot and
        size (it is cached: making a view costs ~10 us), so do not change its shape in place."""
        ws = self._ws
        if ws is None:
            raise RuntimeError("this FusedAllReduce is closed")
        if tokens > ws.capacity:
            return self._unfused_workspace().input_buffer(tokens)
        return ws.input_buffer(tokens)

    def stats(self) -> dict[str, int]:
        """Calls so far: fused, and unfused (over capacity, or an unfused backend)."""
        fast = self._fast_calls
        return {"calls": self._calls + fast, "fused": self._fused_calls + fast,
                "unfused_over_capacity": self._over_capacity,
                "unfused": self._calls - self._fused_calls}

    # --- the hot path -------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None, eps: float = 1e-6,
                 weight_bias: float = 0.0, quant: str | None = None,
                 scale: float | torch.Tensor | None = None,
                 layout: str = "swizzled_128x4", *, out: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None) -> FusedOutput:
        """See DESIGN 3.6. ``layout`` is the NVFP4 scale layout (``swizzled_128x4``, ``linear``).

        ``out`` / ``residual_out``: where to write those results instead of new tensors. Each
        may be its own input, ``out=x`` and ``residual_out=residual``: the op then works in
        place, as vLLM's ``fused_add_rms_norm`` does, which saves memory traffic on CPUs.
        Otherwise each must be memory of its own (no overlap with another argument, nor
        with ``input_buffer()``)."""
        fast = self._fast
        if fast is not None:
            result: FusedOutput | None = fast(x, residual, weight, eps, weight_bias, quant,
                                              scale, layout, out, residual_out)
            if result is not None:
                self._fast_calls += 1
                return result
        return self._call(x, residual, weight, eps, weight_bias, quant, scale, layout, out,
                          residual_out)

    def _call(self, x: Any, residual: Any, weight: Any, eps: Any, weight_bias: Any,
              quant: Any, scale: Any, layout: str, out: Any = None,
              residual_out: Any = None) -> FusedOutput:
        """Checked Python path: every error names its argument; over capacity runs unfused."""
        ws = self._ws
        if ws is None or ws.destroyed:
            raise RuntimeError("this FusedAllReduce is closed (close() or destroy_all())")
        self._check(x, residual, weight, eps, weight_bias)
        self._check_destinations(x, residual, weight, out, residual_out)
        scale_f: float | None = None
        if quant is not None:
            quant = parse_quant(quant)
            if quant is not None:
                scale_f = self._check_quant(quant, scale, layout)
        if ws.call_fault:
            faults.trigger(ws.call_fault, ws.backend, "call", ws.ctx.rank)
        self._calls += 1
        if x.shape[0] > ws.capacity:
            self._over_capacity += 1
            ws = self._unfused_workspace()
        elif ws.backend != "torch":
            self._fused_calls += 1
        if quant is not None and not (self._fuses_quant and ws.fuses_quant):
            result = ws.run(x, residual, weight, eps, weight_bias, None, None, layout, out,
                            residual_out)
            q_out, s_out = quantize(result.out, quant, scale_f, layout)
            return FusedOutput(result.out, result.residual_out, q_out, s_out)
        return ws.run(x, residual, weight, eps, weight_bias, quant, scale_f, layout, out,
                      residual_out)

    def _unfused_workspace(self) -> TorchWorkspace:
        if self._unfused is None:
            ws = self.workspace
            self._unfused = TorchWorkspace(ws.ctx, ws.spec)
        return self._unfused

    def _check(self, x: Any, residual: Any, weight: Any, eps: Any, weight_bias: Any) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        spec = self.spec
        if x.dim() != 2:
            raise ValueError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
        if x.dtype != self._dtype:
            raise ValueError(f"x has dtype {x.dtype}; this op was built for {self._dtype}")
        if x.shape[1] != spec.hidden:
            raise ValueError(f"x has hidden size {x.shape[1]}; this op was built for "
                             f"hidden_dim={spec.hidden}")
        if x.device.type != self._device_type:
            raise ValueError(f"x is on {x.device}; this op runs on {self._device_type}")
        if not x.is_contiguous():
            raise ValueError("x must be contiguous (call .contiguous() first)")
        if residual is not None:
            if weight is None:
                raise ValueError("residual needs weight: the residual pattern is all-reduce + "
                                 "residual + RMSNorm")
            _check_like(residual, x, "residual")
        if weight is not None:
            if not isinstance(weight, torch.Tensor):
                raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
            if weight.shape != (spec.hidden,):
                raise ValueError(f"weight must have shape ({spec.hidden},), got "
                                 f"{tuple(weight.shape)}")
            if weight.dtype != x.dtype:
                raise ValueError(f"weight has dtype {weight.dtype}; it must match x ({x.dtype})")
            if weight.device != x.device:
                raise ValueError(f"weight is on {weight.device}; x is on {x.device}")
            if not weight.is_contiguous():
                raise ValueError("weight must be contiguous")
            if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
                raise ValueError(f"eps={eps!r} is not valid; it must be a number > 0")
            if isinstance(weight_bias, bool) or not isinstance(weight_bias, (int, float)):
                raise TypeError(f"weight_bias must be a number, got {type(weight_bias).__name__}")

    def _check_destinations(self, x: torch.Tensor, residual: torch.Tensor | None,
                            weight: torch.Tensor | None, out: Any, residual_out: Any) -> None:
        """``out`` is ``x`` or memory of its own; ``residual_out`` is ``residual`` (``x``
        without one) or memory of its own; neither is in the shared segment the peers read."""
        if out is None and residual_out is None:
            return
        if residual_out is not None and weight is None:
            raise ValueError("residual_out needs weight: without RMSNorm there is no "
                             "residual_out")
        segment = self.workspace.shared_span()
        wanted = [("out", out, x, "x"),
                  ("residual_out", residual_out, residual if residual is not None else x,
                   "residual" if residual is not None else "x")]
        for name, dest, own, own_name in wanted:
            if dest is None:
                continue
            _check_like(dest, x, name)
            span = _span(dest)
            if segment is not None and _overlap(span, segment):
                raise ValueError(f"{name} is in the shared input slot (input_buffer()); the "
                                 "other ranks read it during the call, so it cannot take an "
                                 "output")
            if _overlap(span, _span(own)) and span != _span(own):
                raise ValueError(f"{name} overlaps {own_name} only partly; pass {own_name} "
                                 "itself (in place) or memory of its own")
            others = [("x", x), ("residual", residual), ("weight", weight)]
            for other_name, other in others:
                if other is None or other_name == own_name or _span(other) == _span(own):
                    continue
                if _overlap(span, _span(other)):
                    raise ValueError(f"{name} overlaps {other_name}; it may only be "
                                     f"{own_name} itself (in place) or memory of its own")
        if out is not None and residual_out is not None and _overlap(_span(out),
                                                                     _span(residual_out)):
            raise ValueError("out and residual_out overlap; they must be different memory")

    def _check_quant(self, quant: str, scale: Any, layout: str) -> float:
        if scale is None:
            raise ValueError(f"quant={quant!r} needs scale (fp8: the dequantisation scale; "
                             "nvfp4: the global encode scale)")
        value = scale_value(scale)
        if quant == "nvfp4":
            if self._dtype == torch.float32:
                raise ValueError("quant='nvfp4' needs bf16 or fp16 input, not float32")
            if self.spec.hidden % 16:
                raise ValueError(f"quant='nvfp4' needs hidden_dim a multiple of 16, got "
                                 f"{self.spec.hidden}")
            if layout not in LAYOUTS:
                raise ValueError(f"layout={layout!r} is not valid; use one of "
                                 f"{', '.join(LAYOUTS)}")
        return value

    # --- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Release this op's hold on its workspace (freed with its last user). Idempotent."""
        if self._lease is not None:
            REGISTRY.release(self._lease)
        self._ws = None
        self._fast = None

    def __enter__(self) -> FusedAllReduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._ws is None else self.workspace.describe()
        return f"FusedAllReduce({state})"


def _check_like(tensor: Any, x: torch.Tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.shape != x.shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; x has {tuple(x.shape)}")
    if tensor.dtype != x.dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype}; x has {x.dtype}")
    if tensor.device != x.device:
        raise ValueError(f"{name} is on {tensor.device}; x is on {x.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]
