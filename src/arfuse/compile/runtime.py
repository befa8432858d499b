"""The torch operator a compiled graph calls in place of all-reduce + add + RMSNorm.

``torch.ops.arfuse.compiled_fused_allreduce(x, residual, weight, eps, weight_bias, group_name,
capacity, form) -> (out, residual_out)``, both shaped as ``x``. At its first call for a
(group, dtype, hidden size, device) it creates, on every rank (collectively, as every
``FusedAllReduce``), the op that serves every chain of that key, sized to ``capacity``; a
later graph that needs more capacity replaces it (the same on every rank: ranks run the same
graphs in the same order, and ranks that do not disagree in negotiation, which fails on every
rank). When the group's plan is unfused the operator runs the chain the graph had, in eager
torch: the group's all-reduce, the add and the norm in its ``form`` (``match``).

The hot path is a dict look-up and ``FusedAllReduce.__call__`` (the shm kernel's own entry).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from .. import log
from ..ops import FusedAllReduce
from . import match

OP_NAME = "compiled_fused_allreduce"
_SCHEMA = (f"{OP_NAME}(Tensor x, Tensor? residual, Tensor weight, float eps, "
           "float weight_bias, str group_name, int capacity, int form, Tensor? eps_input=None) "
           "-> (Tensor, Tensor)")

_lock = threading.Lock()
_library: list[Any] = []  # the torch.library.Library that holds the operator's definition


class _Chains:
    """What runs every chain of one (group, dtype, hidden, device): a fused op, or the
    graph's own computation when the negotiated plan is unfused."""

    def __init__(self, group_name: str, x: torch.Tensor, capacity: int) -> None:
        from torch.distributed import distributed_c10d

        resolve: Any = getattr(distributed_c10d, "_resolve_process_group")  # noqa: B009
        self.group = resolve(group_name)
        self.capacity = capacity
        self.calls = 0  # chains run (fused or not), for tests and stats
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

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, weight_bias: float, form: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        comm = self.comm
        if comm is None:
            return self._unfused(x, residual, weight, eps, weight_bias, form)
        shape = x.shape
        hidden = shape[-1]
        flat = x.reshape(-1, hidden).contiguous()
        if residual is not None:
            residual = residual.reshape(-1, hidden).contiguous()
        result = comm(flat, residual, weight, eps, weight_bias)
        assert result.residual_out is not None
        return result.out.view(shape), result.residual_out.view(shape)

    def _unfused(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, weight_bias: float, form: int) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x.clone()
        torch.distributed.all_reduce(summed, group=self.group)
        h = summed if residual is None else residual + summed
        return eager_norm(h, weight, eps, weight_bias, form), h

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
            self.comm = None


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


_chains: dict[tuple[str, torch.dtype, int, torch.device], _Chains] = {}


def _run(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
         weight_bias: float, group_name: str, capacity: int, form: int,
         eps_input: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if eps_input is not None:  # a graph input (dynamic shapes), read as the graph did: fp32
        eps = float(eps_input.to(torch.float32))
    key = (group_name, x.dtype, x.shape[-1], x.device)
    chains = _chains.get(key)
    if chains is None or chains.capacity < capacity:
        chains = _open(key, x, capacity)
    return chains(x, residual, weight, eps, weight_bias, form)


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


def _fake(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
          weight_bias: float, group_name: str, capacity: int, form: int,
          eps_input: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def register() -> Any:
    """Define the operator (once per process) and return it."""
    with _lock:
        if not _library:
            library: Any = torch.library.Library  # untyped in torch's stubs
            library = library("arfuse", "FRAGMENT")
            library.define(_SCHEMA)
            library.impl(OP_NAME, _run, "CompositeExplicitAutograd")
            torch.library.register_fake(f"arfuse::{OP_NAME}", _fake, lib=library)
            _library.append(library)
    return getattr(torch.ops.arfuse, OP_NAME).default


def close_all() -> None:
    """Close every op the compiled graphs made (collective, like ``FusedAllReduce.close``);
    the next call of a compiled graph negotiates again."""
    with _lock:
        for chains in _chains.values():
            chains.close()
        _chains.clear()
