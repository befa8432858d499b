"""What a backend is: requirements, a collective create, a functional validation, capacity in
tokens for the mode it really runs (R1), bytes, the fused op, and a destroy that frees all (R10).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .. import faults, policy
from ..spec import Spec
from ..topology import Topology

if TYPE_CHECKING:
    from ..epilogue import FusedOutput
    from ..rendezvous import Channel
    from ..settings import Settings


class CreationFailed(RuntimeError):
    """This rank could not create (or validate) a workspace; negotiation moves on."""


@dataclass
class GroupContext:
    """One all-reduce group as this rank sees it; shared by every workspace of the group."""

    group: Any  # torch.distributed.ProcessGroup, or None for a single process
    rank: int
    world_size: int
    device: str
    key: str
    channel: Channel
    settings: Settings
    fault_table: tuple[faults.Fault, ...] = field(default=())

    def fault(self, backend: str, phase: str) -> str | None:
        """Run the injected fault for this point, if any (``None``, ``"none"`` or ``"null"``)."""
        if not self.fault_table:
            return None
        return faults.inject(self.fault_table, backend, phase, self.rank)


class Workspace(ABC):
    """A created backend instance for one group and one spec."""

    backend: str = ""
    fuses_quant: bool = False

    def __init__(self, ctx: GroupContext, spec: Spec, nbytes: int, capacity: int):
        self.ctx, self.spec = ctx, spec
        self.nbytes, self.capacity = nbytes, capacity
        self.destroyed = False
        self.call_fault = faults.mode_for(ctx.fault_table, self.backend, "call", ctx.rank)

    @property
    def fast_call(self) -> Any:
        """An optional entry that checks and runs a call in one step (no Python on the hot
        path); it returns ``None`` whenever the checked Python path must take over."""
        return None

    def input_buffer(self, tokens: int) -> torch.Tensor:
        """Where the caller may write the next call's input (a backend with a shared input
        slot returns a view of it and skips a copy); by default a fresh tensor."""
        from ..torch_types import TORCH_DTYPES, device_of

        return torch.empty((tokens, self.spec.hidden), dtype=TORCH_DTYPES[self.spec.dtype],
                           device=device_of(self.ctx.device))

    def shared_span(self) -> tuple[int, int] | None:
        """[start, end) addresses of memory the peers read during a call (no output may be
        written there); ``None`` when the backend has none in this process."""
        return None

    @abstractmethod
    def validate(self) -> None:
        """Functional check after creation (R2); raises ``CreationFailed`` if broken.

        Must not hang when a peer is broken: collective steps go through the channel.
        """

    @abstractmethod
    def poison(self) -> None:
        """Break this rank's workspace the way a null handle would (fault mode ``null``)."""

    @abstractmethod
    def run(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
            eps: float, weight_bias: float, quant: str | None, scale: float | None,
            layout: str, out: torch.Tensor | None = None,
            residual_out: torch.Tensor | None = None) -> FusedOutput:
        """The fused op on inputs already checked by ``FusedAllReduce``; ``out`` and
        ``residual_out``, when given, receive those results (they may be ``x`` and
        ``residual`` themselves: in place)."""

    @abstractmethod
    def _free(self) -> None:
        """Release everything this workspace holds."""

    def destroy(self) -> None:
        """Idempotent; frees every resource (R10)."""
        if not self.destroyed:
            self.destroyed = True
            self._free()

    def describe(self) -> str:
        capacity = "unlimited" if self.capacity >= 2**62 else f"{self.capacity} tokens"
        return (f"{self.backend}: {self.nbytes / 2**20:.2f} MiB per rank, capacity "
                f"{capacity}, hidden {self.spec.hidden}, {self.spec.dtype}")


class Backend(ABC):
    """A factory of workspaces; stateless apart from one-time setup (a compiled kernel)."""

    name: str = ""

    def requirements(self, topology: Topology, spec: Spec) -> str:
        """Hard requirements are the policy's table (pure); "" when met."""
        return policy.requirement(self.name, topology, spec)

    def unavailable(self) -> str:
        """Why this installation cannot run the backend at all ("" when it can)."""
        return ""

    def probe(self, ctx: GroupContext, spec: Spec) -> str:
        """Local check on this rank before any allocation; "" when fine."""
        return ""

    @abstractmethod
    def create(self, ctx: GroupContext, spec: Spec) -> Workspace | None:
        """Collective: every rank calls it; a rank that fails returns ``None`` or raises."""
