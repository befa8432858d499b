"""The torch operator a compiled graph calls in place of all-reduce + add + RMSNorm.

``torch.ops.arfuse.compiled_fused_allreduce(x, residual, weight, eps, weight_bias, group_name,
capacity, form) -> (out, residual_out)``, both shaped as ``x``, and
``compiled_fused_allreduce_fp8(..., scale) -> (out, residual_out, quant_out)`` for a chain that
ends in static FP8 quantisation, and ``compiled_fused_allreduce_fp8_group(..., group_size) ->
(out, residual_out, quant_out, scale_out)`` for one that ends in per-token-group FP8 (codes
shaped as ``x``, fp32 scales ``[..., H / group_size]``). At its first call for a
(group, dtype, hidden size, device) it creates, on every rank (collectively, as every
``FusedAllReduce``), the op that serves every chain of that key, sized to ``capacity``; a
later graph that needs more capacity replaces it (the same on every rank: ranks run the same
graphs in the same order, and ranks that do not disagree in negotiation, which fails on every
rank). When the group's plan is unfused the operator runs the chain the graph had, in eager
torch: the graph's own all-reduce op, the add, the norm in its ``form`` (``match``) and the
quantisation.

On CPU with the shm kernel the operators' CPU kernels are the kernel's own (operators.cpp): once
the op of a key exists they run the calls straight from the graph, as the hand-written graph's
``shm_fused_allreduce_functional`` does, and hand everything else to the Python
implementation here. Elsewhere the hot path is a dict look-up and ``FusedAllReduce.__call__``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from .. import log
from ..arg_checks import fp32_number
from ..ops import FusedAllReduce
from ..quant import FP8_GROUP_EPS, FP8_MAX
from . import match

OP_NAME = "compiled_fused_allreduce"
FP8 = "compiled_fused_allreduce_fp8"
FP8_GROUP = "compiled_fused_allreduce_fp8_group"
_ARGS = ("Tensor x, Tensor? residual, Tensor weight, float eps, float weight_bias, "
         "str group_name, int capacity, int form")
_SCHEMAS = {
    OP_NAME: f"{OP_NAME}({_ARGS}, Tensor? eps_input=None) -> (Tensor, Tensor)",
    # static FP8 after the norm: also the e4m3 codes of out / scale (scale: one fp32 element)
    FP8: f"{FP8}({_ARGS}, Tensor scale, Tensor? eps_input=None) -> (Tensor, Tensor, Tensor)",
    # per-token-group FP8 after the norm (DeepSeek's act_quant): codes and fp32 group scales
    FP8_GROUP: f"{FP8_GROUP}({_ARGS}, int group_size, Tensor? eps_input=None) -> "
               "(Tensor, Tensor, Tensor, Tensor)",
}

_lock = threading.Lock()
_library: list[Any] = []  # the torch.library.Library that holds the operator's definition


class _Chains:
    """What runs every chain of one (group, dtype, hidden, device): a fused op, or the
    graph's own computation when the negotiated plan is unfused."""

    def __init__(self, group_name: str, x: torch.Tensor, capacity: int) -> None:
        from torch.distributed import distributed_c10d

        resolve: Any = getattr(distributed_c10d, "_resolve_process_group")  # noqa: B009
        self.group = resolve(group_name)
        self.group_name = group_name
        self.capacity = capacity
        self._unfused_calls = 0  # the chains Python ran as the graph had them
        # (kernel, handle, dtype, hidden) once the kernel routes this op's calls: _enter_route
        self._route: tuple[Any, int, torch.dtype, int] | None = None
        device = "cpu" if x.device.type == "cpu" else str(x.device)
        self.comm: FusedAllReduce | None = FusedAllReduce(
            self.group, max_token_num=capacity, hidden_dim=int(x.shape[-1]), dtype=x.dtype,
            device=device)
        self.fused = self.comm.workspace.descriptor.fused
        log.once(logging.INFO, ("compiled", group_name, x.dtype, int(x.shape[-1]), capacity),
                 "arfuse compile: chains on group %s (%s, hidden %d, up to %d tokens) run on "
                 "%s%s", group_name, x.dtype, int(x.shape[-1]), capacity, self.comm.backend,
                 "" if self.fused else " (unfused: the graph's own all-reduce and norm)")
        if not self.fused:
            self.comm.close()
            self.comm = None
        elif x.device.type == "cpu":
            self._enter_route(x)

    def _enter_route(self, x: torch.Tensor) -> None:
        """Let the operators' CPU kernels (the shm kernel's, operators.cpp) run this op's calls
        without Python: it takes the calls this op's fast path takes and hands the rest to
        ``_run``. Nothing where the op has no such entry (another backend, call faults)."""
        assert self.comm is not None
        entry = self.comm.kernel_entry()
        if entry is None:
            return
        kernel, handle, op = entry
        kernel.register_compiled_ops(_run, _run_fp8)
        hidden = int(x.shape[-1])
        kernel.set_compiled_route(self.group_name, x.dtype, hidden, handle, op, self.capacity)
        self._route = (kernel, handle, x.dtype, hidden)
        self.comm.count_calls_from(lambda: self.routed)

    def stats(self) -> dict[str, Any]:
        """The backend and the chains run: ``calls``, ``fused`` (the op's, the kernel's route
        included) and ``unfused`` (over capacity, an unfused plan, a refused eps)."""
        counted = self.comm.stats() if self.comm is not None else {"calls": 0, "fused": 0,
                                                                    "unfused": 0}
        own = self._unfused_calls
        return {"backend": self.comm.backend if self.comm is not None else "unfused",
                "calls": counted["calls"] + own, "fused": counted["fused"],
                "unfused": counted["unfused"] + own}

    @property
    def calls(self) -> int:
        """Chains run (fused or not), by Python or by the kernel's route."""
        return int(self.stats()["calls"])

    @property
    def routed(self) -> int:
        """Of ``calls``, those the kernel's route ran (without Python)."""
        if self._route is None:
            return 0
        kernel, _, dtype, hidden = self._route
        return int(kernel.compiled_route_calls(self.group_name, dtype, hidden))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, weight_bias: float, form: int,
                 scale: torch.Tensor | None = None,
                 group_size: int = 0) -> tuple[torch.Tensor, ...]:
        comm = self.comm
        if comm is None or not _eps_valid(eps):
            return self._unfused(x, residual, weight, eps, weight_bias, form, scale, group_size)
        shape = x.shape
        rows = len(shape) == 2
        if not rows:  # [batch, sequence, hidden] and the like: the op takes [tokens, hidden]
            x = x.reshape(-1, shape[-1])
            residual = None if residual is None else residual.reshape(-1, shape[-1])
        # the op reads its inputs in place: they must be contiguous (a no-op when they are)
        x, residual = x.contiguous(), None if residual is None else residual.contiguous()
        if group_size:
            result = comm(x, residual, weight, eps, weight_bias, "fp8_group", None, "fp32",
                          group_size=group_size)
        else:
            result = comm(x, residual, weight, eps, weight_bias,
                          None if scale is None else "fp8", scale)
        assert result.residual_out is not None
        found: tuple[torch.Tensor, ...] = (result.out, result.residual_out)
        if group_size:
            assert result.quant_out is not None and result.scale_out is not None
            found += nan_groups_as_torch(result.out, result.quant_out, result.scale_out,
                                         group_size)
        elif scale is not None:
            assert result.quant_out is not None
            found += (result.quant_out,)
        if rows:
            return found
        lead = shape[:-1]
        return tuple(t.view(*lead, t.shape[-1]) for t in found)

    def _unfused(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, weight_bias: float, form: int,
                 scale: torch.Tensor | None, group_size: int = 0) -> tuple[torch.Tensor, ...]:
        """The chain as the graph had it, op for op in eager aten: the same functional
        collective, the add, the norm in its form, the quantisation."""
        self._unfused_calls += 1
        c10d = torch.ops._c10d_functional
        summed = c10d.wait_tensor(c10d.all_reduce(x, "sum", self.group.group_name))
        h = summed if residual is None else summed + residual
        out = eager_norm(h, weight, eps, weight_bias, form)
        if group_size:
            return (out, h, *act_quant(out, group_size))
        if scale is None:
            return out, h
        codes = (out.float() * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX)
        return out, h, codes.to(torch.float8_e4m3fn)

    def close(self) -> None:
        if self._route is not None:
            kernel, handle, dtype, hidden = self._route
            kernel.drop_compiled_route(self.group_name, dtype, hidden, handle)
            self._route = None
        if self.comm is not None:
            self.comm.close()
            self.comm = None


def _eps_valid(eps: float) -> bool:
    """Whether the fused call takes ``eps`` (its call check's rule). A graph input's eps
    (dynamic shapes) is known only here, the same on every rank: a refused one runs the
    chain as the graph wrote it."""
    try:
        fp32_number(eps, "eps", positive=True)
    except ValueError as e:
        log.once(logging.INFO, ("compiled eps", eps),
                 "arfuse compile: a chain runs unfused: %s", e)
        return False
    return True


def eager_norm(h: torch.Tensor, weight: torch.Tensor, eps: float, weight_bias: float,
               form: int) -> torch.Tensor:
    """RMSNorm of ``h`` as the graph wrote it (``form``: ``match.WEIGHT_FP32`` or
    ``match.WEIGHT_IN_T``)."""
    c = h.float()
    n = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)
    if form == match.WEIGHT_IN_T:
        return weight * n.to(h.dtype)
    factor = weight.float() if weight_bias == 0.0 else weight.float() + weight_bias
    return (n * factor).to(h.dtype)


def act_quant(out: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 of ``out`` as the graph wrote it (``match.find_fp8_group``):
    codes shaped as ``out``, fp32 scales ``[..., H / group_size]``."""
    grouped = out.float().reshape(*out.shape[:-1], out.shape[-1] // group_size, group_size)
    scale = grouped.abs().amax(-1, keepdim=True).clamp_min(FP8_GROUP_EPS) / FP8_MAX
    codes = (grouped / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(out.shape), scale.squeeze(-1)


def nan_groups_as_torch(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                        group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused call's codes and fp32 scales, with the rows whose norm output holds a NaN
    quantised as the graph does (torch's ``amax`` is NaN there; arfuse's leaves NaN out), so
    the operator's bytes are the graph's for every input. A NaN in ``out`` always gives a NaN
    code (its quotient is NaN), so the codes say which rows to look at."""
    nan_rows = (codes.view(torch.uint8) & 0x7F).eq(0x7F).any(-1)
    if not bool(nan_rows.any()):
        return codes, scales
    rows = nan_rows.nonzero().squeeze(-1)
    again, scale = act_quant(out.index_select(0, rows), group_size)
    codes, scales = codes.clone(), scales.clone()
    codes.view(torch.uint8).index_copy_(0, rows, again.view(torch.uint8))
    scales.index_copy_(0, rows, scale)
    return codes, scales


_chains: dict[tuple[str, torch.dtype, int, torch.device], _Chains] = {}


def _run(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
         weight_bias: float, group_name: str, capacity: int, form: int,
         eps_input: torch.Tensor | None = None,
         scale: torch.Tensor | None = None, group_size: int = 0) -> tuple[torch.Tensor, ...]:
    if eps_input is not None:  # a graph input (dynamic shapes), read as the graph did: fp32
        eps = float(eps_input.to(torch.float32))
    key = (group_name, x.dtype, x.shape[-1], x.device)
    chains = _chains.get(key)
    if chains is None or chains.capacity < capacity:
        chains = _open(key, x, capacity)
    return chains(x, residual, weight, eps, weight_bias, form, scale, group_size)


def _run_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float, weight_bias: float, group_name: str, capacity: int, form: int,
             scale: torch.Tensor,
             eps_input: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    return _run(x, residual, weight, eps, weight_bias, group_name, capacity, form, eps_input,
                scale)


def _run_fp8_group(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   eps: float, weight_bias: float, group_name: str, capacity: int, form: int,
                   group_size: int,
                   eps_input: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    return _run(x, residual, weight, eps, weight_bias, group_name, capacity, form, eps_input,
                None, group_size)


def _open(key: tuple[str, torch.dtype, int, torch.device], x: torch.Tensor,
          capacity: int) -> _Chains:
    """Collective: the chains of ``key``, sized to the larger of ``capacity`` and what an
    earlier graph needed."""
    with _lock:
        old = _chains.get(key)
        if old is not None and old.capacity >= capacity:
            return old
        chains = _Chains(key[0], x, capacity if old is None else max(capacity, old.capacity))
        _chains[key] = chains
        if old is not None:
            old.close()
        return chains


def _fake(x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _fake_fp8(x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    return (torch.empty_like(x), torch.empty_like(x),
            torch.empty_like(x, dtype=torch.float8_e4m3fn))


def _fake_fp8_group(x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    group_size = kwargs["group_size"] if "group_size" in kwargs else args[7]
    groups = x.shape[-1] // group_size
    return (torch.empty_like(x), torch.empty_like(x),
            torch.empty_like(x, dtype=torch.float8_e4m3fn),
            x.new_empty((*x.shape[:-1], groups), dtype=torch.float32))


def register(name: str = OP_NAME) -> Any:
    """Define the operators (once per process) and return ``name``'s."""
    with _lock:
        if not _library:
            library: Any = torch.library.Library  # untyped in torch's stubs
            library = library("arfuse", "FRAGMENT")
            for op, run, fake in ((OP_NAME, _run, _fake), (FP8, _run_fp8, _fake_fp8),
                                  (FP8_GROUP, _run_fp8_group, _fake_fp8_group)):
                library.define(_SCHEMAS[op])
                library.impl(op, run, "CompositeExplicitAutograd")
                torch.library.register_fake(f"arfuse::{op}", fake, lib=library)
            _library.append(library)
    return getattr(torch.ops.arfuse, name).default


def stats() -> dict[str, dict[str, Any]]:
    """``_Chains.stats`` of every op the compiled graphs made, by group, dtype and hidden."""
    with _lock:
        chains = list(_chains.items())
    return {f"group {name}, {str(dtype).removeprefix('torch.')}, hidden {hidden}": c.stats()
            for (name, dtype, hidden, _), c in chains}


def close_all() -> None:
    """Close every op the compiled graphs made (collective, like ``FusedAllReduce.close``);
    the next call of a compiled graph negotiates again."""
    with _lock:
        for chains in _chains.values():
            chains.close()
        _chains.clear()
