"""The unfused reference backend: ``torch.distributed`` on the given group, then the epilogue.

Runs on gloo and NCCL, any world size (1 included), across nodes. Ranks exchange their inputs
with ``all_gather`` rather than ``all_reduce`` so the sum is taken in fp32 and in rank order
on every rank: bit-identical results whatever the collective's internal order. It is also the
path every other backend takes for a call over its capacity.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from ..epilogue import FusedOutput, apply, deliver, rank_order_sum
from ..rendezvous import NegotiationTimeout
from ..spec import Spec
from ..torch_types import device_of
from .base import Backend, CreationFailed, GroupContext, Workspace

_UNLIMITED = sys.maxsize
# torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single; same semantics
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchWorkspace(Workspace):
    backend = "torch"

    def __init__(self, ctx: GroupContext, spec: Spec):
        super().__init__(ctx, spec, nbytes=0, capacity=_UNLIMITED)
        self._poisoned = False

    def poison(self) -> None:
        self._poisoned = True

    def gather(self, x: torch.Tensor, deadline: float | None = None) -> torch.Tensor:
        """``[world, T, H]`` of every rank's ``x``; with a deadline the wait cannot hang."""
        world = self.ctx.world_size
        contribution = torch.zeros_like(x) if self._poisoned else x
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        if deadline is None:
            _all_gather(out, contribution, group=self.ctx.group)
            return out.view(world, *x.shape)
        work = _all_gather(out, contribution, group=self.ctx.group, async_op=True)
        assert work is not None
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise NegotiationTimeout("validate", self.backend, None,
                                         self.ctx.settings.timeout_s)
            time.sleep(0.0005)
        work.wait()
        return out.view(world, *x.shape)

    def validate(self) -> None:
        # Every rank contributes rank+1 in a known pattern; everyone checks the same sum.
        self.ctx.channel.barrier("validate", self.backend)
        world, rank = self.ctx.world_size, self.ctx.rank
        x = torch.full((1, 8), float(rank + 1), dtype=torch.float32,
                       device=device_of(self.ctx.device))
        if world == 1:
            got = x.clone()
        else:
            deadline = time.monotonic() + self.ctx.settings.timeout_s
            got = rank_order_sum(self.gather(x, deadline))
        expected = world * (world + 1) / 2
        if not torch.all(got == expected):
            raise CreationFailed(
                f"functional check failed: all-reduce gave {got.flatten()[0].item():g}, "
                f"expected {expected:g}")

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
            eps: float, weight_bias: float, quant: str | None, scale: float | None,
            layout: str, out: torch.Tensor | None = None,
            residual_out: torch.Tensor | None = None) -> FusedOutput:
        if self.ctx.world_size == 1:
            source = torch.zeros_like(x) if self._poisoned else x
            acc = source.to(torch.float32, copy=True)
        else:
            acc = rank_order_sum(self.gather(x))
        return deliver(apply(acc, x.dtype, residual, weight, eps, weight_bias, quant, scale,
                             layout), out, residual_out)

    def _free(self) -> None:
        """Nothing allocated beyond per-call tensors."""


class TorchBackend(Backend):
    name = "torch"

    def create(self, ctx: GroupContext, spec: Spec) -> Workspace | None:
        if ctx.fault(self.name, "create") == "none":
            return None
        return TorchWorkspace(ctx, spec)
