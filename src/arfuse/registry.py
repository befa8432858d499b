"""Process-wide workspace cache per group (DESIGN 3.5).

* Reuse only what fits (R4): same group, requested backend, dtype and hidden size, and enough
  capacity. A larger request negotiates a replacement sized to the high-water mark.
* One workspace per group for plain and quantised patterns (R5): workspaces are
  pattern-agnostic, so quantisation never causes a second one.
* Nothing is freed under a live user: a superseded workspace lives until its last user closes.
* ``destroy_all`` frees everything, and runs at exit (R10): it revokes every lease, so ops
  still alive are closed and let go of their group too. Once a group has no workspace left,
  arfuse holds no reference to its process group (``destroy_process_group`` can free it).

Acquire and release are collective in the same sense as construction: every rank makes the
same calls in the same order, so every rank takes the same reuse-or-negotiate branch.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import group as group_mod
from . import log, negotiate
from . import settings as settings_mod
from .backends.base import Workspace
from .errors import NegotiationError
from .group import GroupContext
from .negotiate import Outcome
from .settings import ResidualPromise, Settings
from .spec import Spec
from .torch_types import device_of

# group key, device, backend, strict, topology file, replicated residual, timeout
EntryKey = tuple[str, str, str, bool, "str | None", ResidualPromise, float]


@dataclass(eq=False)
class Entry:
    """One live workspace, the decision that made it, and the number of ops using it."""

    key: EntryKey
    outcome: Outcome
    epoch: int  # the group's negotiation that made it: the same number on every rank
    users: int = 0
    superseded: bool = False
    leases: list[Lease] = field(default_factory=list)  # its users' leases, to revoke

    @property
    def workspace(self) -> Workspace:
        return self.outcome.workspace


@dataclass(eq=False)
class Lease:
    """What a ``FusedAllReduce`` holds: its entry and its own view of the group."""

    entry: Entry
    ctx: GroupContext
    spec: Spec  # what the op asked for (the workspace may hold more)
    opened: int  # the group's exchange epoch this op was made in: its number on every rank
    reused: bool
    released: bool = field(default=False)
    # the holder's hook that drops everything it holds of the group when ``destroy_all``
    # revokes the lease (weak: the registry never keeps an op alive)
    on_revoke: weakref.WeakMethod[Callable[[], None]] | None = field(default=None)

    def revoke_with(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` (a bound method) if ``destroy_all`` frees the workspace first."""
        self.on_revoke = weakref.WeakMethod(hook)


class Registry:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._entries: dict[EntryKey, list[Entry]] = {}

    def acquire(self, group: Any, request: Callable[[], tuple[Settings, Spec]],
                device: str | None = None, timeout_s: float | None = None) -> Lease:
        """Collective: a covering workspace of the group, or a newly negotiated one.

        ``request`` gives this rank's settings and spec; whatever it (or this rank's context)
        raises is exchanged first, so every rank raises together instead of the others
        waiting (``negotiate.exchange_verdicts``). ``timeout_s``: the wait for that exchange
        when the settings themselves are what failed."""
        with self._lock:
            member = group_mod.join(group)
            member.channel.next_epoch()  # one per construction, on every rank alike
            try:
                return self._acquire(member, request, device, timeout_s)
            except BaseException:
                self._forget_if_unused(member.key)
                raise

    def _acquire(self, member: group_mod.Member, request: Callable[[], tuple[Settings, Spec]],
                 device: str | None, timeout_s: float | None) -> Lease:
        def local() -> tuple[GroupContext, Spec, EntryKey, Entry | None]:
            settings, spec = request()
            ctx = group_mod.make_context(member, device, settings)
            key = _entry_key(ctx)
            return ctx, spec, key, self._covering(key, spec)

        found, error = negotiate.attempt_locally(local)
        timeout = (found[0].timeout_s if found is not None
                   else settings_mod.fallback_timeout(timeout_s))
        mine = None if found is None else {
            "request": negotiate.request_of(found[0], found[1]),
            "reuse": None if found[3] is None else found[3].epoch}
        try:
            shared = negotiate.exchange_verdicts(member.channel, timeout, "open", mine, error)
        finally:  # no reference cycle through the error this frame's traceback holds
            del error
        assert found is not None  # a rank whose local step failed raised above
        ctx, spec, key, entry = found
        negotiate.agree_on_request(member.channel, timeout, [p["request"] for p in shared])
        _agree_on_reuse(ctx, [p["reuse"] for p in shared])
        if entry is not None:
            entry.users += 1
            log.logger.debug("arfuse group %s: reusing the %s workspace for %s", ctx.key,
                             entry.workspace.backend, spec)
            return _lease(entry, ctx, spec, reused=True)
        return self._negotiate(ctx, spec, key)

    def _covering(self, key: EntryKey, spec: Spec) -> Entry | None:
        for entry in self._entries.get(key, []):
            if not entry.superseded and entry.workspace.spec.covers(spec):
                return entry
        return None

    def _negotiate(self, ctx: GroupContext, spec: Spec, key: EntryKey) -> Lease:
        live = self._entries.setdefault(key, [])
        same_shape = [e for e in live if not e.superseded
                      and e.workspace.spec.dtype == spec.dtype
                      and e.workspace.spec.hidden == spec.hidden]
        high_water = max([spec.max_tokens] + [e.workspace.spec.max_tokens for e in same_shape])
        outcome = negotiate.negotiate(ctx, replace(spec, max_tokens=high_water))
        entry = Entry(key, outcome, epoch=ctx.channel.epoch, users=1)
        for old in same_shape:
            old.superseded = True
            log.logger.log(logging.INFO if ctx.rank == 0 else logging.DEBUG,
                           "arfuse group %s: workspace for %d tokens replaced by one for "
                           "%d (it is freed when its last user closes)", ctx.key,
                           old.workspace.spec.max_tokens, high_water)
        live.append(entry)
        return _lease(entry, ctx, spec, reused=False)

    def release(self, lease: Lease) -> None:
        """Drop one user; the workspace is destroyed when its last user is gone."""
        with self._lock:
            if lease.released:
                return
            lease.released = True
            entry = lease.entry
            if lease in entry.leases:
                entry.leases.remove(lease)
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
            group_mod.forget_group(group_key)

    def workspaces(self) -> list[Workspace]:
        """Every live workspace (for ``arfuse doctor`` and leak checks)."""
        with self._lock:
            return [e.workspace for entries in self._entries.values() for e in entries]

    def destroy_all(self) -> None:
        """Free every workspace of every group (also runs at interpreter exit). Ops still
        alive are closed: each lease is revoked, so its holder drops the workspace, its
        context and with them the process group (R10)."""
        with self._lock:
            entries = [e for es in self._entries.values() for e in es]
            self._entries.clear()
            for entry in entries:
                leases, entry.leases = entry.leases, []
                for lease in leases:
                    _revoke(lease)
                try:
                    entry.workspace.destroy()
                except Exception as exc:  # at exit, keep freeing the rest
                    log.logger.warning("arfuse: destroying %s raised %s: %s",
                                       entry.workspace.backend, type(exc).__name__, exc)
            group_mod.forget_all_groups()


def _lease(entry: Entry, ctx: GroupContext, spec: Spec, reused: bool) -> Lease:
    lease = Lease(entry, ctx, spec, ctx.channel.epoch, reused=reused)
    entry.leases.append(lease)
    return lease


def _revoke(lease: Lease) -> None:
    lease.released = True
    hook = None if lease.on_revoke is None else lease.on_revoke()
    lease.on_revoke = None
    if hook is not None:
        try:
            hook()
        except Exception as exc:  # at exit, keep freeing the rest
            log.logger.warning("arfuse: closing an op raised %s: %s", type(exc).__name__, exc)


def _entry_key(ctx: GroupContext) -> EntryKey:
    """A workspace serves only requests negotiated under the same settings and topology file,
    and waits with the timeout of the op that made it (its context's)."""
    settings = ctx.settings
    return (ctx.key, str(device_of(ctx.device)), settings.backend, settings.strict,
            settings.topology_path, settings.replicated_residual, settings.timeout_s)


def _agree_on_reuse(ctx: GroupContext, verdicts: list[int | None]) -> None:
    """Every rank reuses the same workspace (named by the negotiation that made it) or every
    rank negotiates: registries that differ (ops closed on some ranks only, different
    timeouts or topology paths) fail on every rank together instead of some ranks waiting."""
    if all(v == verdicts[0] for v in verdicts):
        return
    said = "; ".join(f"rank {r}: " + ("negotiate a new workspace" if v is None else
                                      f"reuse the workspace of negotiation {v}")
                     for r, v in enumerate(verdicts))
    negotiate.fail_together(ctx.channel, ctx.timeout_s, "open", NegotiationError(
        f"arfuse group {ctx.key}: the ranks' workspaces of this group differ ({said}); every "
        "rank must make and close the same ops with the same settings (ARFUSE_TIMEOUT_S, "
        "ARFUSE_TOPOLOGY included)"))


REGISTRY = Registry()
atexit.register(REGISTRY.destroy_all)


def destroy_all() -> None:
    REGISTRY.destroy_all()
