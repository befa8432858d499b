"""``hier``: CPU ranks on two or more hosts, fused: shared memory in each host (the shm kernel on
the host's ranks), ``torch.distributed`` (gloo) between hosts, then the epilogue on the reduced
rows, in the kernel's second host step (DESIGN 4, "hier").

This module is the backend's descriptor (pure) and the host layout it reads from the topology;
``workspace`` creates and runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...catalog import BackendDescriptor, Footprint
from ...pattern import Pattern
from ...sizing import ceil_div
from ...spec import Spec
from ...topology import Topology
from ..shm import fuses as shm_fuses
from ..shm.layout import MAX_TOKENS, MAX_WORLD, ShmLayout

PARTIAL_DTYPE = "fp32"
"""What the host's partial sums are kept in, in shared memory and on the wire: the sum order
is fp32 throughout (DESIGN 4), so no partial is rounded to the activation dtype."""
PARTIAL_BYTES = 4


@dataclass(frozen=True)
class HostLayout:
    """The group's ranks by host: hosts in the order their first rank comes in the group, and
    each host's ranks in group rank order (the sum order of DESIGN 4)."""

    hosts: tuple[str, ...]
    ranks: tuple[tuple[int, ...], ...]

    @property
    def host_count(self) -> int:
        return len(self.hosts)

    @property
    def local_size(self) -> int:
        """Ranks per host (the first host's; ``problem`` says when they differ)."""
        return len(self.ranks[0]) if self.ranks else 0

    def problem(self) -> str:
        sizes = [len(r) for r in self.ranks]
        if len(set(sizes)) > 1:
            held = ", ".join(f"{h}: {n}" for h, n in zip(self.hosts, sizes, strict=True))
            return (f"hosts hold different numbers of ranks ({held}); the links between hosts "
                    "pair the ranks of equal local index, so every host needs as many")
        return ""

    def describe(self) -> str:
        return f"{self.host_count} hosts x {self.local_size} ranks"

    def where(self, rank: int) -> tuple[int, int]:
        """``(host index, local index)`` of group rank ``rank``."""
        for h, members in enumerate(self.ranks):
            if rank in members:
                return h, members.index(rank)
        raise ValueError(f"rank={rank} is not in the group")

    def host_of(self, rank: int) -> str:
        return self.hosts[self.where(rank)[0]]


def host_layout(hosts: Sequence[str]) -> HostLayout:
    order: list[str] = []
    members: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        if host not in members:
            order.append(host)
            members[host] = []
        members[host].append(rank)
    return HostLayout(tuple(order), tuple(tuple(members[h]) for h in order))


def unmet(topology: Topology, spec: Spec) -> str:
    if topology.device != "cpu":
        return f"needs CPU tensors, device is {topology.device}"
    if topology.node_count < 2:
        return "spans one host only (shm runs such a group whole)"
    layout = host_layout(topology.hosts)
    problem = layout.problem()
    if problem:
        return problem
    if layout.local_size > MAX_WORLD:
        return f"{layout.local_size} ranks per host, over shm's {MAX_WORLD}"
    if spec.max_tokens > MAX_TOKENS:
        return f"max_tokens {spec.max_tokens} is over the kernel's limit of {MAX_TOKENS}"
    return ""


def fuses(topology: Topology, spec: Spec, pattern: Pattern) -> bool:
    """Every pattern shm fuses (its rule): the epilogue and quantisation run once on the
    reduced rows."""
    return shm_fuses(topology, spec, pattern)


def notes(topology: Topology, spec: Spec) -> tuple[str, ...]:
    layout = host_layout(topology.hosts)
    if layout.local_size == 1:
        return (f"{layout.describe()}: the torch backend's call between the hosts (each rank's "
                "rows cross as they are, one gloo exchange per call), then the fp32 sum, "
                "residual, RMSNorm and quantisation in the shm kernel where the process has "
                "it",)
    return (f"{layout.describe()}: fp32 partial sums through shm in each host, one gloo "
            f"exchange between hosts per call ({layout.local_size} links in parallel), then "
            "residual, RMSNorm and quantisation on the reduced rows in the shm kernel's "
            "gather on each host",)


def partial_spec(spec: Spec) -> Spec:
    """The host step's shm workspace: the same rows, kept in fp32, sum only."""
    return Spec(spec.max_tokens, spec.hidden, PARTIAL_DTYPE)


def footprint(world_size: int, spec: Spec, topology: Topology) -> Footprint:
    """Each host's shm segment of fp32 rows and, for 16-bit rows, its segment in their dtype
    (the fused gather), shared by that host's ranks (one rank per host: the peer's rows of
    the largest call, kept)."""
    local = host_layout(topology.hosts).local_size if topology.hosts else world_size
    if local < 2:
        return Footprint(spec.max_tokens * spec.hidden * spec.elem_size, spec.max_tokens)
    total = ShmLayout(local, spec.max_tokens, spec.hidden, PARTIAL_BYTES).total_bytes
    if spec.elem_size != PARTIAL_BYTES:
        total += ShmLayout(local, spec.max_tokens, spec.hidden, spec.elem_size).total_bytes
    return Footprint(ceil_div(total, local), spec.max_tokens)


DESCRIPTORS = (BackendDescriptor(
    name="hier", fused=True, devices=("cpu",), auto_rank=1,
    implementation="arfuse.backends.hier.backend:HierBackend",
    unmet=unmet, fuses=fuses, notes=notes, footprint=footprint),)
