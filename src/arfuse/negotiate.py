"""The collective protocol (DESIGN 3.4): gather facts, resolve, try candidates, vote, time out.

Every rank of the group calls ``negotiate`` in the same order with the same spec. Facts come
from every rank, so every rank computes the same plan (R7); each creation and each validation
ends in a vote, so either every rank keeps a backend or every rank moves on; every exchange
has a deadline and names the ranks that stayed silent (R8); only the given group's store and
ranks are used (R9).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn, TypeVar

from . import catalog, log, policy, topology
from .backends.base import Backend, Workspace
from .errors import CollectiveTimeout, CreationFailed, NegotiationError, PeerAborted
from .group import GroupContext
from .policy import Plan
from .rendezvous import Channel
from .settings import ResidualPromise
from .spec import Spec
from .topology import LocalFacts, Topology


@dataclass(frozen=True)
class Attempt:
    backend: str
    ok: bool
    phase: str
    failures: Mapping[int, str] = field(default_factory=dict)

    def describe(self) -> str:
        if self.ok:
            return f"{self.backend}: ok"
        ranks = ", ".join(f"rank {r}: {why}" for r, why in sorted(self.failures.items()))
        return f"{self.backend}: failed at {self.phase} ({ranks})"


@dataclass(frozen=True)
class Outcome:
    """What the group agreed on: the plan, the workspace every rank kept, and how."""

    plan: Plan
    topology: Topology
    blocked: Mapping[str, str]
    workspace: Workspace
    attempts: tuple[Attempt, ...]
    seconds: float


# --- the protocol -------------------------------------------------------------------------------


_instances: dict[str, Backend | str] = {}


def backend_instance(name: str) -> Backend | str:
    """The backend's implementation, made once per process, or why this installation cannot
    load it (FlashInfer's module imports fine without CUDA; a broken third-party one may not)."""
    found = _instances.get(name)
    if found is None:
        try:
            found = catalog.load(name)()
        except Exception as exc:
            found = f"not part of this installation: {type(exc).__name__}: {exc}"
        _instances[name] = found
    return found


def _local_payload(ctx: GroupContext, spec: Spec) -> dict[str, Any]:
    """This rank's facts, topology file, backend table and local checks (what ``negotiate``
    gathers; the request itself was agreed when the op opened)."""
    settings = ctx.settings
    facts = topology.local_facts(ctx.device)
    file_topology = (topology.load(settings.topology_path).to_dict()
                     if settings.topology_path else None)
    blocked = local_blockers(ctx, spec)
    return {
        "facts": asdict(facts),
        "file_topology": file_topology,
        "blocked": blocked,
        "backends": {d.name: catalog.fingerprint(d) for d in catalog.descriptors()},
    }


def local_blockers(ctx: GroupContext, spec: Spec) -> dict[str, str]:
    """This rank's local checks (``Backend.local_check``) of every backend its device allows:
    the backends it cannot create, with why. ``arfuse explain`` runs them too, so that its plan
    for this machine is the one creation finds."""
    blocked: dict[str, str] = {}
    for descriptor in catalog.descriptors():
        if ctx.device not in descriptor.devices:
            continue  # the policy rules it out from the device alone; no local check to pay
        why = _local_check(ctx, descriptor.name, spec)
        if why:
            blocked[descriptor.name] = why
    return blocked


def _local_check(ctx: GroupContext, name: str, spec: Spec) -> str:
    backend = backend_instance(name)
    if isinstance(backend, str):
        return backend
    try:
        if ctx.fault(name, "probe") == "none":
            return "local check returned nothing"
        return backend.local_check(ctx, spec)
    except (Exception, MemoryError) as exc:  # a failed check is a reason, not a crash
        return f"local check failed: {type(exc).__name__}: {exc}"


def _agree(payloads: list[dict[str, Any]], key: str, what: str) -> None:
    reference = payloads[0][key]
    differ = [r for r, p in enumerate(payloads) if p[key] != reference]
    if differ:
        details = "; ".join(f"rank {r}: {payloads[r][key]}" for r in differ)
        raise NegotiationError(f"ranks passed different {what}: rank 0: {reference}; {details}. "
                               "Every rank of the group must ask for the same thing")


def topology_of(ctx: GroupContext, payloads: list[dict[str, Any]]) -> Topology:
    """The group's topology from every rank's payload of an exchange that carried
    ``file_topology`` and ``facts`` (the ``ARFUSE_TOPOLOGY`` file when ranks gave one, all
    alike; else every rank's detected facts merged). Integrations with their own exchange
    reuse it."""
    if any(p["file_topology"] is not None for p in payloads):  # on any rank: all alike
        _agree(payloads, "file_topology", "topology files (ARFUSE_TOPOLOGY)")
        topo = Topology.from_dict(payloads[0]["file_topology"])
        topo.check_rank_count(ctx.world_size, "group")
        return topo
    facts = [LocalFacts(**p["facts"]) for p in payloads]
    return topology.merge(facts)


def _blocked(payloads: list[dict[str, Any]]) -> dict[str, str]:
    merged: dict[str, str] = {}
    for rank, payload in enumerate(payloads):
        for name, why in payload["blocked"].items():
            merged.setdefault(name, f"rank {rank}: {why}")
    return merged


def _agree_on_backends(payloads: list[dict[str, Any]]) -> None:
    """Every rank must have the same table of backends, each descriptor alike in every field
    (``catalog.fingerprint``): ``arfuse.register`` on some ranks only, or of descriptors that
    differ, would make them resolve different plans and wait for each other in vain."""
    tables = [p["backends"] for p in payloads]
    if all(table == tables[0] for table in tables):
        return
    problems = []
    for name in sorted({name for table in tables for name in table}):
        have = [r for r, table in enumerate(tables) if name in table]
        if len(have) < len(tables):
            lack = [r for r in range(len(tables)) if r not in have]
            problems.append(f"backend {name!r} is registered on ranks {have} but not on "
                            f"ranks {lack}")
            continue
        for key in tables[0][name]:
            seen = [table[name].get(key) for table in tables]
            if len(set(seen)) > 1:
                problems.append(f"backend {name!r} differs in {key}: "
                                + "; ".join(f"rank {r}: {v}" for r, v in enumerate(seen)))
    raise NegotiationError("ranks have different backends: " + "; ".join(problems)
                           + ". Register (arfuse.register) the same backends on every rank")


def negotiate(ctx: GroupContext, spec: Spec) -> Outcome:
    """Collective, in the epoch the op opened in: every rank ends with the same backend, or
    every rank raises."""
    started = time.perf_counter()
    epoch = ctx.channel.epoch
    value, error = attempt_locally(lambda: _local_payload(ctx, spec))
    try:
        payloads = exchange_verdicts(ctx.channel, ctx.timeout_s, "facts", value, error)
    finally:  # no reference cycle through the error this frame's traceback holds
        del error
    try:
        _agree_on_backends(payloads)
        topo = topology_of(ctx, payloads)
        blocked = _blocked(payloads)
        # an explicit backend that cannot run, or strict with nothing fused: every rank's
        # verdict from the same facts, raised together like the facts' own errors
        plan = policy.resolve(ctx.settings, topo, spec, blocked)
    except (NegotiationError, ValueError) as exc:
        fail_together(ctx.channel, ctx.timeout_s, "facts", exc)
    log.once(_level(ctx, logging.INFO), (ctx.key, spec, ctx.settings.backend),
             "arfuse group %s: plan for %s\n%s", ctx.key, _spec_text(spec), plan.explain())
    attempts: list[Attempt] = []
    for name in plan.viable:
        ctx.channel.begin(f"n{epoch}/{name}")
        backend = backend_instance(name)
        assert not isinstance(backend, str)  # a backend this rank cannot load is blocked
        attempt, workspace = _try(ctx, backend, spec)
        attempts.append(attempt)
        if workspace is not None:
            seconds = time.perf_counter() - started
            _log_outcome(ctx, spec, workspace, attempts, seconds)
            return Outcome(plan, topo, blocked, workspace, tuple(attempts), seconds)
        log.logger.log(_level(ctx, logging.WARNING), "arfuse group %s: %s; trying the next "
                       "candidate", ctx.key, attempt.describe())
    tried = "; ".join(a.describe() for a in attempts)
    fail_together(ctx.channel, ctx.timeout_s, "end", NegotiationError(
        f"arfuse group {ctx.key}: no candidate could be created on every rank ({tried})"
        + (" and ARFUSE_STRICT=1 forbids the unfused path" if ctx.settings.strict else "")))


def fail_together(channel: Channel, timeout_s: float, phase: str,
                  error: BaseException) -> NoReturn:
    """Every rank reached the same verdict from the same facts; wait until all have read them
    before raising, so that no rank's exit (rank 0 hosts the store) cuts another off mid-read."""
    channel.begin(f"{channel.scope}/fail")
    with contextlib.suppress(Exception):
        channel.barrier(f"{phase}-ack", timeout_s)
    try:
        raise error
    finally:  # its traceback holds this frame: no reference cycle through this variable
        del error


# --- local failures travel like facts -----------------------------------------------------------

T = TypeVar("T")


def attempt_locally(step: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """Run a rank's local step before an exchange: its value, or the error it raised (which
    ``exchange_verdicts`` then tells every rank instead of leaving them waiting)."""
    try:
        return step(), None
    except Exception as exc:
        return None, exc


def exchange_verdicts(channel: Channel, timeout_s: float, phase: str, value: Any,
                      error: BaseException | None) -> list[Any]:
    """Collective: every rank's ``value``. A rank whose local step failed (``error``) sends
    that instead; then every rank raises together, that rank its own error and the others
    ``PeerAborted`` naming it and why, and every rank has made the same exchange (the group's
    exchange count stays in step)."""
    mine = {"error": "" if error is None else _error_text(error), "value": value}
    try:
        payloads = channel.all_gather(phase, mine, timeout_s, abortable=False)
        refused = {rank: p["error"] for rank, p in enumerate(payloads) if p["error"]}
        if refused:
            reasons = "; ".join(f"rank {rank}: {why}" for rank, why in sorted(refused.items()))
            fail_together(channel, timeout_s, phase, error if error is not None else
                          PeerAborted(f"arfuse: rank(s) {', '.join(map(str, sorted(refused)))}"
                                      f" of the group failed locally in phase {phase!r}, so no "
                                      f"rank goes on ({reasons})"))
    finally:  # raised, its traceback holds this frame: no reference cycle through it
        del error
    return [p["value"] for p in payloads]


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:2000]


def request_of(ctx: GroupContext, spec: Spec) -> dict[str, Any]:
    """What every rank of one construction must ask alike."""
    settings = ctx.settings
    return {"spec": asdict(spec), "device": ctx.device,
            "settings": {"backend": settings.backend, "strict": settings.strict,
                         "replicated_residual": settings.replicated_residual}}


def agree_on_request(channel: Channel, timeout_s: float, requests: list[dict[str, Any]]) -> None:
    """Every rank asked for the same spec, device and settings, else every rank raises
    ``NegotiationError`` together."""
    try:
        _agree(requests, "spec", "specs (max_token_num, hidden_dim, dtype, quant)")
        _agree(requests, "device", "devices")
        _agree(requests, "settings", "settings (ARFUSE_BACKEND / ARFUSE_STRICT / "
               "ARFUSE_REPLICATED_RESIDUAL or their keywords)")
    except NegotiationError as exc:
        fail_together(channel, timeout_s, "open", exc)


def _try(ctx: GroupContext, backend: Backend,
         spec: Spec) -> tuple[Attempt, Workspace | None]:
    """Create, vote, validate, vote. Returns the workspace only if every rank succeeded."""
    name = backend.name
    made: list[Workspace] = []

    def create() -> str:
        try:
            workspace = backend.create(ctx, spec)
        except CreationFailed as exc:
            if exc.workspace is not None:  # half-made: freed after the vote, as on the others
                made.append(exc.workspace)
            raise
        if workspace is None:
            return "creation returned nothing"
        made.append(workspace)
        return ""

    def validate() -> str:
        mode = ctx.fault(name, "validate")
        if mode == "null":
            made[0].poison()
        made[0].validate()
        return "validation returned nothing" if mode == "none" else ""

    try:
        for phase, action in (("create", create), ("validate", validate)):
            failures = _step(ctx, name, phase, action)
            if failures:
                _drop(made[0] if made else None)
                return Attempt(name, False, phase, failures), None
        return Attempt(name, True, "validate"), made[0]
    except BaseException:
        _drop(made[0] if made else None)
        raise


def _step(ctx: GroupContext, backend: str, phase: str,
          action: Callable[[], str]) -> dict[int, str]:
    """Run one local step; a failure is announced at once (nobody waits for this rank), then
    every rank votes. Only a timeout ends the negotiation: the ranks are out of step."""
    try:
        why = action()
    except (CollectiveTimeout, NegotiationError):  # the group is out of step or gone
        raise
    except (Exception, MemoryError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    if why:
        ctx.channel.abort(why)
    return _vote(ctx, phase, backend, why)


def _vote(ctx: GroupContext, phase: str, backend: str, why: str) -> dict[int, str]:
    """MIN of success across the group; returns the failing ranks with their reasons."""
    reasons = ctx.all_gather(f"vote/{phase}", why, backend, abortable=False)
    return {rank: reason for rank, reason in enumerate(reasons) if reason}


def _drop(workspace: Workspace | None) -> None:
    if workspace is not None:
        try:
            workspace.destroy()
        except Exception as exc:  # destroying a half-made workspace must not mask the cause
            log.logger.warning("arfuse: destroying a failed %s workspace raised %s: %s",
                               workspace.backend, type(exc).__name__, exc)


def _level(ctx: GroupContext, level: int) -> int:
    """Decisions are the same on every rank: group rank 0 tells them, the others at debug."""
    return level if ctx.rank == 0 else logging.DEBUG


def _spec_text(spec: Spec) -> str:
    return (f"max_tokens={spec.max_tokens} hidden={spec.hidden} dtype={spec.dtype} "
            f"quant={spec.quant or 'none'}")


def _log_outcome(ctx: GroupContext, spec: Spec, workspace: Workspace,
                 attempts: list[Attempt], seconds: float) -> None:
    tried = ", ".join(a.backend for a in attempts)
    log.once(_level(ctx, logging.INFO), (ctx.key, spec, workspace.backend, id(workspace)),
             "arfuse group %s (%d ranks): using %s (tried %s) in %.1f ms; %s%s", ctx.key,
             ctx.world_size, workspace.backend, tried, seconds * 1e3, workspace.describe(),
             "; residual promised the same on every rank (ARFUSE_REPLICATED_RESIDUAL"
             + ("=check: compared every call)" if ctx.settings.replicated_residual
                is ResidualPromise.CHECKED else ")") if ctx.settings.replicated_residual.promised
             else "")
