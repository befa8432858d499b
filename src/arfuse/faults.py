"""Fault injection (``ARFUSE_FAULTS``, DESIGN 3.8): make field failures happen on demand.

``BACKEND.PHASE@RANKS=MODE;...`` e.g. ``shm.create@1=raise;mnnvl.validate@*=null``. Ranks are
ranks of the all-reduce group. Parsing is strict: a bad clause is a ``ValueError`` naming it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from . import catalog
from .errors import ArfuseError

PHASES = ("probe", "create", "validate", "call")
MODES = ("raise", "none", "null", "hang", "exit", "oom")
_PHASE_MODES: dict[str, tuple[str, ...]] = {
    "probe": ("raise", "none", "hang", "exit", "oom"),
    "create": MODES,
    "validate": MODES,
    "call": ("raise", "hang", "exit", "oom"),
}
EXIT_CODE = 86


class InjectedFault(ArfuseError):
    """Raised by ``raise`` mode; carries where it was injected."""


@dataclass(frozen=True)
class Fault:
    backend: str
    phase: str
    ranks: frozenset[int] | None  # None = every rank
    mode: str

    def applies(self, backend: str, phase: str, rank: int) -> bool:
        return (self.backend == backend and self.phase == phase
                and (self.ranks is None or rank in self.ranks))


def parse(text: str | None) -> tuple[Fault, ...]:
    """Parse an ``ARFUSE_FAULTS`` value; empty or ``None`` means no faults."""
    if not text or not text.strip():
        return ()
    faults: list[Fault] = []
    for raw in text.split(";"):
        clause = raw.strip()
        if not clause:
            continue
        faults.append(_parse_clause(clause))
    return tuple(faults)


def _parse_clause(clause: str) -> Fault:
    form = "BACKEND.PHASE@RANKS=MODE"
    try:
        target, mode = clause.split("=")
        where, ranks_text = target.split("@")
        backend, phase = where.split(".")
    except ValueError:
        raise ValueError(f"ARFUSE_FAULTS clause {clause!r} is not of the form {form}") from None
    backend, phase, mode, ranks_text = (backend.strip(), phase.strip(), mode.strip(),
                                        ranks_text.strip())
    if backend not in catalog.names():
        raise ValueError(f"ARFUSE_FAULTS clause {clause!r}: backend {backend!r} is not one of "
                         f"{', '.join(catalog.names())}")
    if phase not in PHASES:
        raise ValueError(f"ARFUSE_FAULTS clause {clause!r}: phase {phase!r} is not one of "
                         f"{', '.join(PHASES)}")
    if mode not in _PHASE_MODES[phase]:
        raise ValueError(f"ARFUSE_FAULTS clause {clause!r}: mode {mode!r} is not valid for phase "
                         f"{phase}; use one of {', '.join(_PHASE_MODES[phase])}")
    ranks: frozenset[int] | None = None
    if ranks_text != "*":
        try:
            values = [int(r) for r in ranks_text.split(",")]
        except ValueError:
            raise ValueError(f"ARFUSE_FAULTS clause {clause!r}: ranks {ranks_text!r} must be "
                             "'*' or a comma list of integers") from None
        if any(r < 0 for r in values):
            raise ValueError(f"ARFUSE_FAULTS clause {clause!r}: ranks must be >= 0")
        ranks = frozenset(values)
    return Fault(backend, phase, ranks, mode)


def mode_for(faults: tuple[Fault, ...], backend: str, phase: str, rank: int) -> str | None:
    """The injected mode at this point, or ``None``; the first matching clause wins."""
    for fault in faults:
        if fault.applies(backend, phase, rank):
            return fault.mode
    return None


def trigger(mode: str, backend: str, phase: str, rank: int) -> str:
    """Carry out an active mode; ``none``/``null`` are returned for the caller to act on."""
    where = f"{backend}.{phase} on rank {rank}"
    if mode == "raise":
        raise InjectedFault(f"injected fault: {where} raised (ARFUSE_FAULTS)")
    if mode == "oom":
        raise MemoryError(f"injected fault: {where} ran out of memory (ARFUSE_FAULTS)")
    if mode == "exit":
        os._exit(EXIT_CODE)
    if mode == "hang":
        while True:  # until the process is killed: negotiation on the other ranks must time out
            time.sleep(3600)
    return mode


def inject(faults: tuple[Fault, ...], backend: str, phase: str, rank: int) -> str | None:
    """``mode_for`` then ``trigger``: returns ``None``, ``"none"`` or ``"null"``."""
    mode = mode_for(faults, backend, phase, rank)
    return None if mode is None else trigger(mode, backend, phase, rank)
