"""Process-wide workspace cache per group (DESIGN 3.5).

* Reuse only what fits (R4): same group, requested backend, dtype and hidden size, and enough
  capacity. A larger request negotiates a replacement sized to the high-water mark.
* One workspace per group for plain and quantised patterns (R5): workspaces are
  pattern-agnostic, so quantisation never causes a second one.
* Nothing is freed under a live user: a superseded workspace lives until its last user closes.
* ``destroy_all`` frees everything, and runs at exit (R10). Once a group has no workspace left,
  arfuse holds no reference to its process group.

Acquire and release are collective in the same sense as construction: every rank makes the
same calls in the same order, so every rank takes the same reuse-or-negotiate branch.
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from . import log, negotiate
from .backends.base import Workspace
from .negotiate import GroupContext, Outcome
from .settings import Settings
from .spec import Spec
from .torch_types import device_of

# group key, device, backend, strict, topology file, replicated residual, timeout
EntryKey = tuple[str, str, str, bool, "str | None", "bool | str", float]


@dataclass(eq=False)
class Entry:
    """One live workspace, the decision that made it, and the number of ops using it."""

    key: EntryKey
    outcome: Outcome
    users: int = 0
    superseded: bool = False

    @property
    def workspace(self) -> Workspace:
        return self.outcome.workspace


@dataclass(eq=False)
class Lease:
    """What a ``FusedAllReduce`` holds: its entry and its own view of the group."""

    entry: Entry
    ctx: GroupContext
    reused: bool
    released: bool = field(default=False)


class Registry:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._entries: dict[EntryKey, list[Entry]] = {}

    def acquire(self, group: Any, spec: Spec, settings: Settings,
                device: str | None = None) -> Lease:
        """Collective: a covering workspace of the group, or a newly negotiated one."""
        with self._lock:
            ctx = negotiate.make_context(group, device, settings)
            # a workspace serves only requests negotiated under the same settings and topology
            # file, and waits with the timeout of the op that made it (its context's)
            key = (ctx.key, str(device_of(ctx.device)), settings.backend, settings.strict,
                   settings.topology_path, settings.replicated_residual, settings.timeout_s)
            live = self._entries.setdefault(key, [])
            for entry in live:
                if not entry.superseded and entry.workspace.spec.covers(spec):
                    entry.users += 1
                    log.logger.debug("arfuse group %s: reusing the %s workspace for %s",
                                     ctx.key, entry.workspace.backend, spec)
                    return Lease(entry, ctx, reused=True)
            same_shape = [e for e in live if not e.superseded
                          and e.workspace.spec.dtype == spec.dtype
                          and e.workspace.spec.hidden == spec.hidden]
            high_water = max([spec.max_tokens] + [e.workspace.spec.max_tokens
                                                  for e in same_shape])
            try:
                outcome = negotiate.negotiate(ctx, replace(spec, max_tokens=high_water))
            except BaseException:
                self._forget_if_unused(ctx.key)
                raise
            entry = Entry(key, outcome, users=1)
            for old in same_shape:
                old.superseded = True
                log.logger.log(logging.INFO if ctx.rank == 0 else logging.DEBUG,
                               "arfuse group %s: workspace for %d tokens replaced by one for "
                               "%d (it is freed when its last user closes)", ctx.key,
                               old.workspace.spec.max_tokens, high_water)
            live.append(entry)
            return Lease(entry, ctx, reused=False)

    def release(self, lease: Lease) -> None:
        """Drop one user; the workspace is destroyed when its last user is gone."""
        with self._lock:
            if lease.released:
                return
            lease.released = True
            entry = lease.entry
            entry.users -= 1
            if entry.users <= 0:
                live = self._entries.get(entry.key, [])
                if entry in live:
                    live.remove(entry)
                if not live:
                    self._entries.pop(entry.key, None)
                entry.workspace.destroy()
                self._forget_if_unused(entry.key[0])

    def _forget_if_unused(self, group_key: str) -> None:
        if not any(key[0] == group_key and entries for key, entries in self._entries.items()):
            negotiate.forget_group(group_key)

    def workspaces(self) -> list[Workspace]:
        """Every live workspace (for ``arfuse doctor`` and leak checks)."""
        with self._lock:
            return [e.workspace for entries in self._entries.values() for e in entries]

    def destroy_all(self) -> None:
        """Free every workspace of every group (also runs at interpreter exit)."""
        with self._lock:
            entries = [e for es in self._entries.values() for e in es]
            self._entries.clear()
            for entry in entries:
                try:
                    entry.workspace.destroy()
                except Exception as exc:  # at exit, keep freeing the rest
                    log.logger.warning("arfuse: destroying %s raised %s: %s",
                                       entry.workspace.backend, type(exc).__name__, exc)
            negotiate.forget_all_groups()


REGISTRY = Registry()
atexit.register(REGISTRY.destroy_all)


def destroy_all() -> None:
    REGISTRY.destroy_all()
