"""Exchanges among the ranks of one group that cannot hang (R8) and use only that group (R9).

Each exchange is keyed by a per-channel sequence number, so every rank must make the same
exchanges in the same order (they do: negotiation is collective). Values travel through the
group's own c10d store as JSON; waiting polls with a deadline, so a timeout names exactly the
ranks that never answered, on every rank that waited.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Protocol

from .errors import NegotiationError, NegotiationTimeout, PeerAborted


class _Store(Protocol):
    def set(self, key: str, value: bytes | str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def delete_key(self, key: str) -> bool: ...


class Channel:
    """All-gather of small JSON values among ``world_size`` ranks over a key-value store.

    Keys are ``prefix/scope/phase/rank``: a scope is one negotiation (or one candidate of it),
    and phase names are unique within a scope, so a rank that fails early and skips steps never
    shifts the keys of the others. A rank that fails announces it with ``abort``; the others
    stop waiting for it at once instead of running into the timeout.

    Keys do not pile up in the store: once the first exchange of negotiation ``n + 1`` is
    complete, every rank has read everything of negotiation ``n``, and each rank deletes the
    keys it wrote there.
    """

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int):
        if world_size > 1 and store is None:
            raise ValueError("a channel among several ranks needs a store")
        self.store, self.prefix = store, prefix
        self.rank, self.world_size = rank, world_size
        self.scope = "-"
        self._used: set[str] = set()
        self._epoch = 0
        self._written: list[str] = []      # keys this rank set in the current negotiation
        self._stale: list[str] = []        # ... and in the one before, deleted when safe

    @property
    def epoch(self) -> int:
        """The current negotiation's number (every rank counts alike)."""
        return self._epoch

    def next_epoch(self) -> int:
        """A new negotiation: every rank counts the same collective calls, so the same epoch."""
        self._epoch += 1
        self._stale, self._written = self._stale + self._written, []
        self.begin(f"n{self._epoch}")
        return self._epoch

    def begin(self, scope: str) -> None:
        self.scope = scope
        self._used = set()

    def _key(self, phase: str, rank: int | str) -> str:
        return f"{self.prefix}/{self.scope}/{phase}/{rank}"

    def _set(self, key: str, value: str) -> None:
        self.store.set(key, value)
        self._written.append(key)

    def post(self, key: str, value: str) -> None:
        """Set a key of this channel's prefix outside the exchanges (what a rank that timed out
        in a call says); deleted like the exchanges' keys, once the next negotiation is under
        way on every rank."""
        self._set(f"{self.prefix}/{key}", value)

    def abort(self, reason: str) -> None:
        """Tell the group this rank failed in the current scope (no-op alone)."""
        if self.world_size > 1:
            # best effort: if the store is gone, the vote that follows reports it
            with contextlib.suppress(Exception):
                self._set(self._key("abort", self.rank), reason)

    def all_gather(self, phase: str, value: Any, timeout_s: float, backend: str = "-",
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
        try:
            return self._exchange(phase, value, timeout_s, backend, abortable)
        except (NegotiationTimeout, PeerAborted):
            raise
        except Exception as exc:  # the store itself failed: rank 0, which hosts it, is gone
            raise NegotiationError(
                f"arfuse: the group's store stopped answering in phase {phase!r} (backend "
                f"{backend}): {type(exc).__name__}: {str(exc)[:200]}; rank 0 hosts it and has "
                "most likely died") from None

    def _exchange(self, phase: str, value: Any, timeout_s: float, backend: str,
                  abortable: bool) -> list[Any]:
        store: _Store = self.store
        self._set(self._key(phase, self.rank), json.dumps(value))
        pending = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + timeout_s
        pause = 0.0002
        while pending:
            pending = [r for r in pending if not store.check([self._key(phase, r)])]
            if not pending:
                break
            if abortable:
                for r in pending:
                    # a rank posts its value before it can abort, so one that did both since
                    # the look above has answered: its value counts, not its later failure
                    if store.check([self._key("abort", r)]) and not store.check(
                            [self._key(phase, r)]):
                        reason = store.get(self._key("abort", r)).decode(errors="replace")
                        raise PeerAborted(f"rank {r} failed: {reason}")
            if time.monotonic() > deadline:
                raise NegotiationTimeout(phase, backend, pending, timeout_s)
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        out = [value if r == self.rank else json.loads(store.get(self._key(phase, r)))
               for r in range(self.world_size)]
        self._delete_stale()
        return out

    def _delete_stale(self) -> None:
        """Every rank reached this exchange, so every rank is done with the last negotiation."""
        stale, self._stale = self._stale, []
        for key in stale:
            with contextlib.suppress(Exception):  # a store without delete keeps them; harmless
                self.store.delete_key(key)

    def barrier(self, phase: str, timeout_s: float, backend: str = "-") -> None:
        self.all_gather(phase, None, timeout_s, backend)
