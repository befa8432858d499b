"""What a backend implementation is: a local check, a collective create, and workspaces that
validate, run the fused op on checked arguments (``CallArgs``) and free everything (R10).

What the policy knows about a backend (requirements, bytes, capacity, order) is its descriptor
in ``arfuse.catalog``; the class here points at it by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from .. import catalog, faults
from ..call_checks import CallArgs
from ..catalog import BackendDescriptor
from ..group import GroupContext
from ..pattern import Pattern
from ..result import FusedOutput
from ..spec import Spec


class Workspace(ABC):
    """A created backend instance for one group and one spec."""

    backend: ClassVar[str] = ""

    def __init__(self, ctx: GroupContext, spec: Spec, nbytes: int, capacity: int):
        self.ctx, self.spec = ctx, spec
        self.nbytes, self.capacity = nbytes, capacity
        self.destroyed = False
        self.call_fault = faults.mode_for(ctx.faults, self.backend, "call", ctx.rank)

    @property
    def descriptor(self) -> BackendDescriptor:
        return catalog.get(self.backend)

    def takes(self, topology: Any, pattern: Pattern) -> bool:
        """Whether ``run`` takes a call of ``pattern`` whole (its backend fuses it here);
        otherwise the op runs it without its quantisation and quantises after."""
        return self.descriptor.fuses(topology, self.spec, pattern)

    @property
    def fast_call(self) -> Any:
        """An optional entry that checks and runs a call in one step (no Python on the hot
        path); it returns ``None`` whenever the checked Python path must take over."""
        return None

    @property
    def fast_moe_call(self) -> Any:
        """The same for the MoE calls: ``(rows, index, scales, add, routed, residual, weight,
        eps, weight_bias, quant, scale, layout, out, residual_out, op)``, ``index`` None for
        ``moe_reduce`` (``add``: its token input; a finalize's shared expert or None)."""
        return None

    @property
    def kernel_entry(self) -> tuple[Any, int] | None:
        """``(kernel module, handle)`` when a compiled kernel runs this workspace's calls, so
        that native code (the compiled graphs' operator) may call it without Python; else
        ``None``."""
        return None

    def input_buffer(self, tokens: int) -> torch.Tensor:
        """Where the caller may write the next call's input (a backend with a shared input
        slot returns a view of it and skips a copy); by default a fresh tensor."""
        from ..torch_types import TORCH_DTYPES, device_of

        return torch.empty((tokens, self.spec.hidden), dtype=TORCH_DTYPES[self.spec.dtype],
                           device=device_of(self.ctx.device))

    def shared_span(self) -> tuple[int, int] | None:
        """[start, end) addresses of memory the peers read during a call (no argument of a
        call may lie there, except ``x`` exactly at ``input_buffer()``); ``None`` when the
        backend has none in this process."""
        return None

    def input_slot_start(self) -> int | None:
        """Address where ``input_buffer()`` of the next call starts, when it is shared memory:
        the one place inside ``shared_span()`` where ``x`` may lie."""
        return None

    def announce(self, call: CallArgs) -> None:
        """Tell the group that this rank runs ``call`` on the unfused path (over capacity), so
        peers whose call is not over it fail alike instead of waiting (R11). A backend whose
        calls cannot tell (FlashInfer, like NCCL) does nothing; the torch path exchanges its
        own descriptor."""
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
    def run(self, call: CallArgs) -> FusedOutput:
        """The fused op on arguments already checked (``arfuse.call_checks``); ``call.out``
        and ``call.residual_out``, when given, receive those results (they may be ``x`` and
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
        capacity = ("unlimited" if self.capacity >= catalog.UNLIMITED
                    else f"{self.capacity} tokens")
        return (f"{self.backend}: {self.nbytes / 2**20:.2f} MiB per rank, capacity "
                f"{capacity}, hidden {self.spec.hidden}, {self.spec.dtype}")


class Backend(ABC):
    """A factory of workspaces; stateless apart from one-time setup (a compiled kernel)."""

    name: ClassVar[str] = ""

    def local_check(self, ctx: GroupContext, spec: Spec) -> str:
        """Why this rank cannot create the backend ("" when it can): what this installation
        lacks, or a local check before any allocation. Gathered from every rank."""
        return ""

    @abstractmethod
    def create(self, ctx: GroupContext, spec: Spec) -> Workspace | None:
        """Collective: every rank calls it; a rank that fails returns ``None`` or raises."""
