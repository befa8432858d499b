"""arfuse's own failures, in one family. Bad arguments stay ``ValueError``/``TypeError``.

* ``NegotiationError``: ranks disagree, or no candidate could be created on every rank.
* ``CreationFailed``: this rank could not create or validate a workspace (negotiation catches it,
  votes, and moves on; a user sees it only inside a ``NegotiationError``).
* ``CollectiveTimeout``: a collective step or a call saw silent ranks; it names the phase, the
  backend and the ranks. ``NegotiationTimeout`` (phases of negotiation) and ``CallTimeout``
  (phase ``call``, raised alike by the Python paths and the C++ kernel) are two of its kinds;
  ``RendezvousTimeout`` (phase ``rendezvous``: the ranks of a CLI job meeting at
  ``MASTER_ADDR:MASTER_PORT``) the third.
* ``MismatchedCall``: the ranks of one call passed different tokens, dtype, hidden size or
  pattern (R11); raised on every rank, naming the ranks and the values.
* ``PeerAborted``: a rank failed locally and said so; nobody waits for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ArfuseError(RuntimeError):
    """Base of every failure of arfuse itself (not of the caller's arguments)."""


class NegotiationError(ArfuseError):
    """Ranks disagree (spec, settings) or no candidate could be created on every rank."""


class CreationFailed(ArfuseError):
    """This rank could not create (or validate) a workspace; negotiation moves on.

    ``workspace``: what the creation had already made, to be destroyed with the other ranks'
    (a collective free, as trtllm's, must run on every rank alike)."""

    def __init__(self, message: str, workspace: Any = None):
        super().__init__(message)
        self.workspace = workspace


class PeerAborted(ArfuseError):
    """A rank failed locally and said so; waiting for it any longer would be pointless."""


class MismatchedCall(ArfuseError):
    """The ranks of one call passed different arguments (R11)."""


class WorkspaceBroken(ArfuseError):
    """A workspace that failed once (timeout, dead peer) refuses every later call.

    A ``MismatchedCall`` does not break it: every rank finds the mismatch before any rank
    reads a peer's data, so the group stays in step."""

    # The ranks may have failed apart (a late rank's call can still succeed), and a new op
    # reuses its group's live workspace without a collective: only a workspace freed on every
    # rank makes the next op negotiate afresh everywhere. The kernel's message (comm.cpp,
    # throw_broken) says the same.
    ADVICE = ("close every FusedAllReduce of this group on every rank (arfuse.destroy_all() "
              "closes all), then create new ones")
    # A collective that timed out on the process group itself (the torch backend, the residual
    # check) stays queued there: every later collective on that group pairs with the wrong one.
    GROUP_ADVICE = ("a collective on the process group timed out and left the group out of "
                    "step: destroy it and make a new one, with new FusedAllReduce ops on it")

    @classmethod
    def after(cls, who: str, why: str, group_out_of_step: bool = False) -> WorkspaceBroken:
        advice = cls.GROUP_ADVICE if group_out_of_step else cls.ADVICE
        return cls(f"{who}: this workspace is unusable after an earlier failure ({why}); "
                   + advice)


class CollectiveTimeout(ArfuseError, TimeoutError):
    """A collective step saw silent ranks; the message names phase, backend and ranks."""

    def __init__(self, phase: str, backend: str, silent: Sequence[int] | None,
                 timeout_s: float, detail: str = ""):
        """``silent=None``: the step never finished and who is late is unknown."""
        self.phase, self.backend, self.timeout_s = phase, backend, timeout_s
        self.silent = None if silent is None else tuple(silent)
        who = ("the collective operation did not complete (which rank is late is unknown)"
               if silent is None else f"rank(s) {', '.join(map(str, silent))} of the group did "
               "not answer (dead, hung, or not calling the same collective)")
        super().__init__(f"arfuse timed out after {timeout_s:g}s in phase {phase!r} "
                         f"(backend {backend}): {who}{detail}; raise ARFUSE_TIMEOUT_S if they "
                         "are only slow")

    def __reduce__(self) -> tuple[object, ...]:  # picklable across processes (tests, launchers)
        return (type(self), (self.phase, self.backend, self.silent, self.timeout_s))


class NegotiationTimeout(CollectiveTimeout):
    """A step of negotiation timed out."""


class CallTimeout(CollectiveTimeout):
    """A call timed out waiting for its peers, or a peer died during it.

    The C++ kernel raises it too, with its own message (``message`` given), so a caller can
    catch one class whatever path ran."""

    def __init__(self, phase: str = "call", backend: str = "-",
                 silent: Sequence[int] | None = None, timeout_s: float = 0.0,
                 detail: str = "", message: str | None = None):
        if message is None:
            super().__init__(phase, backend, silent, timeout_s, detail)
        else:
            self.phase, self.backend, self.timeout_s = phase, backend, timeout_s
            self.silent = None if silent is None else tuple(silent)
            ArfuseError.__init__(self, message)
        self._message = message

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.phase, self.backend, self.silent, self.timeout_s, "",
                             self._message or str(self)))


class RendezvousTimeout(CollectiveTimeout):
    """The ranks of a job did not all meet at its store (``MASTER_ADDR:MASTER_PORT``) in time.

    ``missing``: the ranks that never arrived, or ``None`` when this rank could not reach the
    store at all (then who arrived is unknown)."""

    def __init__(self, address: str, world_size: int, missing: Sequence[int] | None,
                 timeout_s: float, backend: str = "-"):
        self.phase, self.backend, self.timeout_s = "rendezvous", backend, timeout_s
        self.address, self.world_size = address, world_size
        self.silent = None if missing is None else tuple(missing)
        if missing is None:
            who = (f"no store answered there, so how many of the {world_size} ranks arrived "
                   "is unknown (rank 0 or the launcher hosts it)")
        else:
            who = (f"{world_size - len(missing)} of {world_size} ranks arrived, rank(s) "
                   f"{', '.join(map(str, missing))} missing")
        ArfuseError.__init__(
            self, f"arfuse timed out after {timeout_s:g}s in phase 'rendezvous' at {address} "
            f"(backend {backend}): {who}; start every rank of WORLD_SIZE={world_size} with this "
            "MASTER_ADDR and MASTER_PORT, or raise ARFUSE_TIMEOUT_S if they are only slow")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.address, self.world_size, self.silent, self.timeout_s,
                             self.backend))
