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
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

from . import catalog, faults, log, policy, topology
from .backends.base import Backend, Workspace
from .errors import CollectiveTimeout, CreationFailed, NegotiationError
from .policy import Plan
from .rendezvous import Channel
from .settings import Settings
from .spec import Spec
from .topology import LocalFacts, Topology


@dataclass(frozen=True)
class GroupContext:
    """One all-reduce group as this rank sees it, with the settings of one ``FusedAllReduce``.

    Immutable: two ops on one group each have their own context (their own timeout and faults);
    they share the group's channel, whose exchange counter every rank advances alike."""

    group: Any  # torch.distributed.ProcessGroup, or None for a single process
    rank: int
    world_size: int
    device: str
    key: str
    channel: Channel
    settings: Settings
    faults: tuple[faults.Fault, ...] = field(default=())

    @property
    def timeout_s(self) -> float:
        return self.settings.timeout_s

    def all_gather(self, phase: str, value: Any, backend: str = "-",
                   abortable: bool = True) -> list[Any]:
        return self.channel.all_gather(phase, value, self.timeout_s, backend, abortable)

    def barrier(self, phase: str, backend: str = "-") -> None:
        self.channel.barrier(phase, self.timeout_s, backend)

    def fault(self, backend: str, phase: str) -> str | None:
        """Run the injected fault for this point, if any (``None``, ``"none"`` or ``"null"``)."""
        if not self.faults:
            return None
        return faults.inject(self.faults, backend, phase, self.rank)


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


# --- the group's context ------------------------------------------------------------------------


def group_key(group: Any) -> str:
    if group is None:
        return "single-process"
    name = getattr(group, "group_name", None)
    return str(name) if name else f"group@{id(group):x}"


_channels: dict[str, Channel] = {}
_channels_lock = threading.Lock()


def forget_group(key: str) -> None:
    """Let go of the group's store once it has no workspace left. The channel itself stays:
    its exchange counter must keep counting, or a later negotiation would reuse old keys."""
    with _channels_lock:
        channel = _channels.get(key)
        if channel is not None:
            channel.store = None


def forget_all_groups() -> None:
    with _channels_lock:
        for channel in _channels.values():
            channel.store = None


def make_context(group: Any, device: str | None, settings: Settings) -> GroupContext:
    """Rank, size, device and the shared channel of ``group`` (``None``: WORLD, or one
    process); bad arguments are errors that name them."""
    import torch
    import torch.distributed as dist

    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        rank, world, store = 0, 1, None
    else:
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got "
                            f"{type(group).__name__}")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError("group: this process is not a member of the given group")
        store = dist.distributed_c10d._get_process_group_store(group)
    if device is None:
        device = _device_of(group)
    elif device not in topology.DEVICES:
        raise ValueError(f"device={device!r} is not valid; use one of "
                         f"{', '.join(topology.DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but this process has no usable CUDA device "
                         "(torch.cuda.is_available() is False); use device='cpu'")
    key = group_key(group)
    with _channels_lock:
        channel = _channels.get(key)
        if channel is None or channel.world_size != world or channel.rank != rank:
            channel = _channels[key] = Channel(store, f"arfuse/{key}", rank, world)
        channel.store = store
    return GroupContext(group=group, rank=rank, world_size=world, device=device, key=key,
                        channel=channel, settings=settings, faults=faults.parse(settings.faults))


def _device_of(group: Any) -> str:
    """NCCL groups carry CUDA tensors; gloo groups CPU tensors; mixed: CUDA if present."""
    import torch
    import torch.distributed as dist

    if group is None:
        return "cpu"
    name = str(dist.get_backend(group)).lower()
    if "nccl" in name and ("gloo" not in name or torch.cuda.is_available()):
        return "cuda"
    return "cpu"


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
    settings = ctx.settings
    facts = topology.local_facts(ctx.device)
    file_topology = (topology.load(settings.topology_path).to_dict()
                     if settings.topology_path else None)
    blocked = local_blockers(ctx, spec)
    return {
        "spec": asdict(spec),
        "settings": {"backend": settings.backend, "strict": settings.strict,
                     "replicated_residual": settings.replicated_residual},
        "facts": asdict(facts),
        "file_topology": file_topology,
        "blocked": blocked,
    }


def local_blockers(ctx: GroupContext, spec: Spec) -> dict[str, str]:
    """This rank's local checks (``Backend.blocker``) of every backend its device allows: the
    backends it cannot create, with why. ``arfuse explain`` runs them too, so that its plan for
    this machine is the one creation finds."""
    blocked: dict[str, str] = {}
    for descriptor in catalog.descriptors():
        if ctx.device not in descriptor.devices:
            continue  # the policy rules it out from the device alone; no local check to pay
        why = _local_blocker(ctx, descriptor.name, spec)
        if why:
            blocked[descriptor.name] = why
    return blocked


def _local_blocker(ctx: GroupContext, name: str, spec: Spec) -> str:
    backend = backend_instance(name)
    if isinstance(backend, str):
        return backend
    try:
        if ctx.fault(name, "probe") == "none":
            return "local check returned nothing"
        return backend.blocker(ctx, spec)
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
        if topo.world_size != ctx.world_size:
            raise ValueError(f"ARFUSE_TOPOLOGY describes world_size={topo.world_size} but the "
                             f"group has {ctx.world_size} ranks")
        return topo
    facts = [LocalFacts(**p["facts"]) for p in payloads]
    return topology.merge(facts)


def _blocked(payloads: list[dict[str, Any]]) -> dict[str, str]:
    merged: dict[str, str] = {}
    for rank, payload in enumerate(payloads):
        for name, why in payload["blocked"].items():
            merged.setdefault(name, f"rank {rank}: {why}")
    return merged


def negotiate(ctx: GroupContext, spec: Spec) -> Outcome:
    """Collective: every rank ends with the same backend, or every rank raises."""
    started = time.perf_counter()
    epoch = ctx.channel.next_epoch()
    payloads = ctx.all_gather("facts", _local_payload(ctx, spec))
    try:
        _agree(payloads, "spec", "specs (max_token_num, hidden_dim, dtype, quant)")
        _agree(payloads, "settings", "settings (ARFUSE_BACKEND / ARFUSE_STRICT / "
               "ARFUSE_REPLICATED_RESIDUAL or their keywords)")
        topo = topology_of(ctx, payloads)
        blocked = _blocked(payloads)
        # an explicit backend that cannot run, or strict with nothing fused: every rank's
        # verdict from the same facts, raised together like the facts' own errors
        plan = policy.resolve(ctx.settings, topo, spec, blocked)
    except (NegotiationError, ValueError) as exc:
        fail_together(ctx, "facts", exc)
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
    fail_together(ctx, "end", NegotiationError(
        f"arfuse group {ctx.key}: no candidate could be created on every rank ({tried})"
        + (" and ARFUSE_STRICT=1 forbids the unfused path" if ctx.settings.strict else "")))


def fail_together(ctx: GroupContext, phase: str, error: Exception) -> NoReturn:
    """Every rank reached the same verdict from the same facts; wait until all have read them
    before raising, so that no rank's exit (rank 0 hosts the store) cuts another off mid-read."""
    ctx.channel.begin(f"{ctx.channel.scope}/fail")
    with contextlib.suppress(Exception):
        ctx.barrier(f"{phase}-ack")
    raise error


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
             + ("=check: compared every call)" if ctx.settings.replicated_residual == "check"
                else ")") if ctx.settings.replicated_residual else "")
