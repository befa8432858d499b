"""The unfused reference backend: ``torch.distributed`` on the given group, then the epilogue.

Runs on gloo and NCCL, any world size (1 included), across nodes. Ranks exchange their inputs
with ``all_gather`` rather than ``all_reduce`` so the sum is taken in fp32 and in rank order
on every rank: bit-identical results whatever the collective's internal order. It is also the
path every other backend takes for a call over its capacity.

Every call first exchanges its signature (tokens, hidden, dtype, pattern, op), so a
call whose ranks disagree fails on every rank (R11) instead of reaching a collective of
mismatched sizes. Every wait has the group's deadline (R8); a rank that times out posts that in
the group's store, so the ranks that did call can name the ones that did not.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import collective, moe, signature
from ...call_checks import CallArgs
from ...catalog import UNLIMITED
from ...dtypes import DTYPES
from ...errors import (
    CallTimeout,
    CreationFailed,
    MismatchedCall,
    NegotiationTimeout,
    WorkspaceBroken,
)
from ...pattern import Pattern
from ...result import FusedOutput
from ...spec import Spec
from ...torch_types import device_of
from ..base import Backend, Workspace
from .epilogue import apply, rank_order_sum


class TorchWorkspace(Workspace):
    backend = "torch"

    def __init__(self, ctx: Any, spec: Spec):
        super().__init__(ctx, spec, nbytes=0, capacity=UNLIMITED)
        self._poisoned = False
        self._calls = 0
        self._broken = ""

    def poison(self) -> None:
        self._poisoned = True

    def takes(self, topology: Any, pattern: Pattern) -> bool:
        """Always: the reference epilogue quantises, and the call's signature must carry the
        quantisation and its layout so ranks that differ in them fail together (R11)."""
        return True

    def _gather(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        """``[world, T, H]`` of every rank's ``x``, within the deadline; a timeout leaves the
        group out of step, so this workspace refuses every later call."""
        contribution = torch.zeros_like(x) if self._poisoned else x
        try:
            return collective.gather(contribution, self.ctx, phase, self.backend, self._calls)
        except CallTimeout as error:
            self._broken = str(error)
            raise

    def _check_agreement(self, call: CallArgs) -> None:
        """R11: every rank's call signature (``arfuse.signature``: tokens, dtype, hidden,
        pattern, op) must be the same; the op too, since all ops of a process group share its
        collectives."""
        words = signature.words(call.tokens, DTYPES[self.spec.dtype].code, call.x.shape[1],
                                call.pattern.code, op=call.op, moe=call.moe_word,
                                group_size=call.group_size)
        mine = torch.tensor([words], dtype=torch.int64, device=call.x.device)
        every = self._gather(mine, "call-signature").view(self.ctx.world_size, 2).tolist()
        if any(row != every[0] for row in every):
            raise MismatchedCall(signature.mismatch_message(
                "torch", self._calls, [(int(a), int(b)) for a, b in every]))

    def validate(self) -> None:
        # Every rank contributes rank+1 in a known pattern; everyone checks the same sum.
        self.ctx.barrier("validate", self.backend)
        world, rank = self.ctx.world_size, self.ctx.rank
        x = torch.full((1, 8), float(rank + 1), dtype=torch.float32,
                       device=device_of(self.ctx.device))
        if world == 1:
            got = x.clone()
        else:
            try:
                got = rank_order_sum(self._gather(x, "validate"))
            except CallTimeout as exc:  # the ranks are out of step: negotiation ends
                self._broken = ""
                raise NegotiationTimeout("validate", self.backend, exc.silent,
                                         self.ctx.timeout_s) from None
        expected = world * (world + 1) / 2
        if not torch.all(got == expected):
            raise CreationFailed(
                f"functional check failed: all-reduce gave {got.flatten()[0].item():g}, "
                f"expected {expected:g}")

    def announce(self, call: CallArgs) -> None:
        """Exchange this call's signature alone (a MoE call this rank refused): the peers,
        which exchange theirs at the start of the same call, raise ``MismatchedCall`` too."""
        if self._broken:
            raise WorkspaceBroken.after("arfuse torch", self._broken, group_out_of_step=True)
        self._calls += 1
        if self.ctx.world_size > 1:
            self._check_agreement(call)

    def run(self, call: CallArgs) -> FusedOutput:
        if self._broken:
            raise WorkspaceBroken.after("arfuse torch", self._broken, group_out_of_step=True)
        if call.moe is not None:
            moe.local_rows(call.moe, call.x)  # the expert step: the reference (moe.py)
        self._calls += 1
        x = call.x
        if self.ctx.world_size == 1:
            source = torch.zeros_like(x) if self._poisoned else x
            acc = source.to(torch.float32, copy=True)
        else:
            self._check_agreement(call)
            acc = rank_order_sum(self._gather(x, "call"))
        return apply(acc, call)

    def _free(self) -> None:
        """Nothing allocated beyond per-call tensors."""


class TorchBackend(Backend):
    name = "torch"

    def create(self, ctx: Any, spec: Spec) -> Workspace | None:
        mode = ctx.fault(self.name, "create")
        if mode == "none":
            return None
        workspace = TorchWorkspace(ctx, spec)
        if mode == "null":  # succeeds broken: validation must catch it
            workspace.poison()
        return workspace
