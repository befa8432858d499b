"""Exchanges among the ranks of one group that cannot hang (R8) and use only that group (R9).

Each exchange is keyed by a per-channel sequence number, so every rank must make the same
exchanges in the same order (they do: negotiation is collective). Values travel through the
group's own c10d store as JSON; waiting polls with a deadline, so a timeout names exactly the
ranks that never answered, on every rank that waited.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, Protocol


class NegotiationTimeout(TimeoutError):
    """A collective step saw silent ranks; the message names phase, backend and ranks."""

    def __init__(self, phase: str, backend: str, silent: Sequence[int] | None,
                 timeout_s: float):
        """``silent=None``: a collective operation never finished and cannot tell who is late."""
        self.phase, self.backend = phase, backend
        self.silent = None if silent is None else tuple(silent)
        who = ("the collective operation did not complete (which rank is late is unknown)"
               if silent is None else f"rank(s) {', '.join(map(str, silent))} of the group did "
               "not answer (dead, hung, or not calling the same collective)")
        super().__init__(f"arfuse timed out after {timeout_s:g}s in phase {phase!r} "
                         f"(backend {backend}): {who}; raise ARFUSE_TIMEOUT_S if they are only "
                         "slow")


class PeerAborted(RuntimeError):
    """A rank failed locally and said so; waiting for it any longer would be pointless."""


class _Store(Protocol):
    def set(self, key: str, value: bytes | str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...


class Channel:
    """All-gather of small JSON values among ``world_size`` ranks over a key-value store.

    Keys are ``prefix/scope/phase/rank``: a scope is one negotiation (or one candidate of it),
    and phase names are unique within a scope, so a rank that fails early and skips steps never
    shifts the keys of the others. A rank that fails announces it with ``abort``; the others
    stop waiting for it at once instead of running into the timeout.
    """

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int,
                 timeout_s: float):
        if world_size > 1 and store is None:
            raise ValueError("a channel among several ranks needs a store")
        self.store, self.prefix = store, prefix
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.scope = "-"
        self._used: set[str] = set()
        self._epoch = 0

    def next_epoch(self) -> int:
        """A new negotiation: every rank counts the same collective calls, so the same epoch."""
        self._epoch += 1
        self.begin(f"n{self._epoch}")
        return self._epoch

    def begin(self, scope: str) -> None:
        self.scope = scope
        self._used = set()

    def _key(self, phase: str, rank: int | str) -> str:
        return f"{self.prefix}/{self.scope}/{phase}/{rank}"

    def abort(self, reason: str) -> None:
        """Tell the group this rank failed in the current scope (no-op alone)."""
        if self.world_size > 1:
            self.store.set(self._key("abort", self.rank), reason)

    def all_gather(self, phase: str, value: Any, backend: str = "-",
                   abortable: bool = True) -> list[Any]:
        """Every rank's ``value`` in rank order.

        Raises ``NegotiationTimeout`` naming the ranks that never arrived, or (``abortable``)
        ``PeerAborted`` as soon as a rank still awaited has announced a failure.
        """
        if phase in self._used:
            raise ValueError(f"phase {phase!r} used twice in scope {self.scope!r}")
        self._used.add(phase)
        if self.world_size == 1:
            return [value]
        store: _Store = self.store
        store.set(self._key(phase, self.rank), json.dumps(value))
        pending = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0002
        while pending:
            pending = [r for r in pending if not store.check([self._key(phase, r)])]
            if not pending:
                break
            if abortable:
                for r in pending:
                    if store.check([self._key("abort", r)]):
                        reason = store.get(self._key("abort", r)).decode(errors="replace")
                        raise PeerAborted(f"rank {r} failed: {reason}")
            if time.monotonic() > deadline:
                raise NegotiationTimeout(phase, backend, pending, self.timeout_s)
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        out: list[Any] = []
        for r in range(self.world_size):
            out.append(value if r == self.rank else json.loads(store.get(self._key(phase, r))))
        return out

    def barrier(self, phase: str, backend: str = "-") -> None:
        self.all_gather(phase, None, backend)
