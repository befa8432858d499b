"""hier's creation: the host layout from the group's facts, the gloo subgroups (a host's
ranks; the ranks of one local index on every host), each host's shm workspaces, then the
workspace (``workspace.HierWorkspace``, which runs the calls)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ... import collective, group, topology
from ...errors import CreationFailed
from ...spec import Spec
from ..base import Backend, Workspace
from ..shm.backend import ShmBackend
from ..shm.workspace import ShmWorkspace
from . import HostLayout, footprint, host_layout, partial_spec
from .workspace import HierWorkspace

# Subgroups by their global ranks, made once per process and kept: a gloo group's name (and
# so its keys in the store) is a hash of its ranks, so one destroyed and made again would meet
# its predecessor's keys. Every workspace over the same ranks shares them, like the channel.
_SUBGROUPS: dict[tuple[int, ...], Any] = {}
_subgroups_lock = threading.Lock()
# What making them opened (their connections' descriptors and gloo's threads), so that a
# check for what arfuse leaves behind after destroy_all can tell them from a leak.
_held_descriptors: set[int] = set()
_held_tasks = 0


def _open_descriptors() -> set[tuple[int, str]]:
    """(descriptor, what it points to): the listing's own descriptor, closed by the time it is
    read, drops out, and a number reused for something else counts as new."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found.add((int(name), os.readlink(f"/proc/self/fd/{name}")))
    return found


def _task_count() -> int:
    return len(os.listdir("/proc/self/task"))


def held_for_the_process() -> tuple[frozenset[int], int]:
    """The descriptors and OS threads the process-lifetime subgroups hold."""
    with _subgroups_lock:
        return frozenset(_held_descriptors), _held_tasks


def _subgroup(ranks: list[int]) -> Any:
    """The gloo subgroup of these global ranks (collective over them only)."""
    key = tuple(ranks)
    with _subgroups_lock:
        found = _SUBGROUPS.get(key)
        if found is None:
            found = _SUBGROUPS[key] = dist.new_group(
                ranks, backend="gloo", use_local_synchronization=True,
                timeout=timedelta(minutes=30))
        return found


@contextlib.contextmanager
def _kept_for_the_process() -> Iterator[None]:
    """Counts what the block opens (subgroups, their channels) as held for the process."""
    global _held_tasks
    fds, tasks = _open_descriptors(), _task_count()
    try:
        yield
    finally:
        with _subgroups_lock:
            _held_descriptors.update(fd for fd, _ in _open_descriptors() - fds)
            _held_tasks += max(0, _task_count() - tasks)


class HierBackend(Backend):
    name = "hier"

    def local_check(self, ctx: Any, spec: Spec) -> str:
        """shm's checks for this rank's host segment (fp32 rows), sized for the most ranks a
        host can hold where hier is viable (half the group: the layout is not known before
        the facts are gathered)."""
        bound = replace(ctx, world_size=max(2, ctx.world_size // 2))
        return ShmBackend().local_check(bound, partial_spec(spec))

    def create(self, ctx: Any, spec: Spec) -> Workspace | None:
        """Collective: the host layout from the group's facts, the subgroups (host and local
        index), the host's shm workspace on the host subgroup. The injected fault runs after
        everything is made, so a failing rank has taken part in every exchange."""
        from ...negotiate import topology_of

        settings = ctx.settings
        payloads = ctx.all_gather("hier-hosts", {
            "facts": asdict(topology.local_facts("cpu")),
            "file_topology": (topology.load(settings.topology_path).to_dict()
                              if settings.topology_path else None)}, self.name)
        layout = host_layout(topology_of(ctx, payloads).hosts)
        if layout.problem() or layout.host_count < 2:
            raise CreationFailed(layout.problem() or "the group spans one host")
        everyone = (dist.get_process_group_ranks(ctx.group) if ctx.group is not None
                    else [0])
        h, local = layout.where(ctx.rank)
        host_ranks = [everyone[r] for r in layout.ranks[h]]
        cross_ranks = [everyone[members[local]] for members in layout.ranks]
        inner = finisher = None
        with _kept_for_the_process():
            if layout.local_size > 1:
                host_group = _subgroup(host_ranks)
            cross_group = _subgroup(cross_ranks)
            cross_ctx = _context(cross_group, ctx)
        collective.agree_size(cross_group, 0)  # every rank, at one point of the group's order
        if layout.local_size > 1:
            inner = finisher = _host_workspace(host_group, ctx, partial_spec(spec),
                                               layout.hosts[h])
            if spec.dtype != inner.spec.dtype:
                try:
                    finisher = _host_workspace(host_group, ctx, spec, layout.hosts[h])
                except BaseException:
                    inner.destroy()
                    raise
        workspace = HierWorkspace(ctx, spec, layout, inner, finisher, cross_ctx,
                                  footprint(ctx.world_size, spec, _topo(layout)).bytes_per_rank)
        try:
            mode = ctx.fault(self.name, "create")
        except BaseException:
            workspace.destroy()
            raise
        if mode == "none":
            workspace.destroy()
            return None
        if mode == "null":
            workspace.poison()
        return workspace


def _host_workspace(host_group: Any, ctx: Any, spec: Spec, host: str) -> ShmWorkspace:
    """A shm workspace of ``spec`` on the host's ranks (collective over them)."""
    made = ShmBackend().create(_context(host_group, ctx), spec)
    if made is None:
        raise CreationFailed(f"the shm workspace of host {host} was not made")
    assert isinstance(made, ShmWorkspace)
    return made


def _topo(layout: HostLayout) -> topology.Topology:
    hosts = [layout.hosts[h] for h, members in enumerate(layout.ranks) for _ in members]
    return topology.Topology(device="cpu", world_size=len(hosts), hosts=tuple(hosts))


def _context(subgroup: Any, ctx: Any) -> Any:
    """A context on ``subgroup`` with ``ctx``'s settings and no injected faults (the faults
    name ranks of the whole group; this backend injects its own), in a new epoch of the
    subgroup's channel: every creation over it is one, counted alike by its ranks."""
    made = replace(group.make_context(group.join(subgroup), "cpu", ctx.settings), faults=())
    made.channel.next_epoch()
    return made
