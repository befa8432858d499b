"""Facts of the all-reduce group: a frozen value, JSON in and out, and this process's own facts.

A ``Topology`` always describes the *group* (R6): ``world_size`` is the group's size and
``hosts`` holds one host identity per group rank, so ``node_count`` never counts ranks outside it.
Gathering every rank's ``LocalFacts`` is collective and lives in ``negotiate``; here the merge
is pure: a capability counts only when every rank has it. A fact some rank could not read is
unknown (``None``), and ``Topology.unknown`` keeps why, so ``explain`` can say it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .files import read_regular_file

DEVICES = ("cpu", "cuda")
MAX_WORLD_SIZE = 1 << 16          # far beyond any all-reduce group; bounds what a file may ask
MAX_FILE_BYTES = 4 << 20          # a topology of MAX_WORLD_SIZE ranks fits with room to spare
_FIELDS = ("device", "world_size", "hosts", "sm", "gpu", "multicast", "nvlink_all_pairs",
           "fabric", "flashinfer", "unknown")
FACTS = ("sm", "gpu", "multicast", "nvlink_all_pairs", "fabric", "flashinfer")
"""The facts that may be unknown (keys of ``Topology.unknown``)."""
_MAX_REASONS = 3                  # distinct reasons named per fact; the rest are counted



def _hosts_length_error(entries: int, world_size: object) -> str:
    return (f"hosts has {entries} entries but world_size={world_size}; give one host identity "
            "per rank of the group")

@dataclass(frozen=True)
class Topology:
    """See DESIGN 3.2. ``None`` on a capability means "unknown"; the policy treats it as absent."""

    device: str = "cpu"
    world_size: int = 1
    hosts: tuple[str, ...] = ()
    sm: int | None = None
    gpu: str | None = None
    multicast: bool | None = False
    nvlink_all_pairs: bool | None = False
    fabric: bool | None = False
    flashinfer: str | None = None
    unknown: dict[str, str] = field(default_factory=dict, hash=False)
    """Fact -> why it is unknown ("rank 3: nvidia-ml-py not installed"), for facts that are
    ``None``; optional in topology files. Not hashed: the facts themselves identify a topology."""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(
                f"device={self.device!r} is not valid; use one of {', '.join(DEVICES)}"
            )
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise TypeError(f"world_size must be an int, got {type(self.world_size).__name__}")
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size={self.world_size} is not valid; use 1..{MAX_WORLD_SIZE}")
        hosts = tuple(self.hosts) if self.hosts else ("host0",) * self.world_size
        if len(hosts) != self.world_size:
            raise ValueError(_hosts_length_error(len(hosts), self.world_size))
        if not all(isinstance(h, str) and h for h in hosts):
            raise TypeError("hosts must be a list of non-empty strings")
        object.__setattr__(self, "hosts", hosts)
        if self.sm is not None and (isinstance(self.sm, bool) or not isinstance(self.sm, int)
                                    or self.sm <= 0):
            raise ValueError(f"sm={self.sm!r} is not valid; use major*10+minor (e.g. 90) or null")
        for name in ("multicast", "nvlink_all_pairs", "fabric"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be true, false or null, got {value!r}")
        for name in ("gpu", "flashinfer"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a string or null, got {value!r}")
        object.__setattr__(self, "unknown", self._checked_unknown())

    def _checked_unknown(self) -> dict[str, str]:
        """A copy holding reasons of facts that really are unknown (a known fact needs none)."""
        if not isinstance(self.unknown, Mapping):
            raise TypeError("unknown must map fact names to reasons (a JSON object of strings)")
        bad = sorted(str(k) for k in self.unknown if k not in FACTS)
        if bad:
            raise ValueError(f"unknown names no fact {bad}; valid: {', '.join(FACTS)}")
        if not all(isinstance(v, str) for v in self.unknown.values()):
            raise TypeError("unknown must map fact names to reasons (strings)")
        return {k: v for k, v in self.unknown.items() if getattr(self, k) is None}

    @property
    def node_count(self) -> int:
        return len(set(self.hosts))

    def check_rank_count(self, ranks: int, holder: str) -> None:
        """A topology file describes one group size: a ``holder`` (the group, the job) of
        another size cannot use it."""
        if self.world_size != ranks:
            raise ValueError(f"ARFUSE_TOPOLOGY describes world_size={self.world_size} but "
                             f"the {holder} has {ranks} ranks")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``unknown`` only when some fact is, so files stay readable by older
        versions whenever nothing is unknown."""
        data = asdict(self)
        data["hosts"] = list(self.hosts)
        if not self.unknown:
            del data["unknown"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        """Missing fields take the safe value (``false``, ``null``, one host). A capability that
        is ``null`` reads as ``false``, unless ``unknown`` gives its reason: then it stays
        unknown (the policy treats both as absent; ``explain`` says why)."""
        if not isinstance(data, Mapping):
            raise ValueError("a topology must be a JSON object")
        extra = sorted(set(data) - set(_FIELDS))
        if extra:
            raise ValueError(f"unknown topology field(s) {extra}; valid: {', '.join(_FIELDS)}")
        reasons = data.get("unknown", {})
        if not isinstance(reasons, Mapping):
            raise TypeError("unknown must map fact names to reasons (a JSON object of strings)")
        hosts = data.get("hosts")
        if hosts is not None and not isinstance(hosts, list):
            raise TypeError("hosts must be a list of strings, one per rank")
        world_size = data.get("world_size", len(hosts) if hosts else 1)
        if hosts == []:  # given, and empty: not the same as leaving it out (one host)
            raise ValueError(_hosts_length_error(0, world_size))
        if hosts is None and isinstance(world_size, int) and not isinstance(world_size, bool) \
                and 1 <= world_size <= MAX_WORLD_SIZE:
            hosts = ["host0"] * world_size
        return cls(
            device=data.get("device", "cpu"),
            world_size=world_size,
            hosts=tuple(hosts or ()),
            sm=data.get("sm"),
            gpu=data.get("gpu"),
            multicast=_safe_bool(data, "multicast", reasons),
            nvlink_all_pairs=_safe_bool(data, "nvlink_all_pairs", reasons),
            fabric=_safe_bool(data, "fabric", reasons),
            flashinfer=data.get("flashinfer"),
            unknown=dict(reasons),
        )


def _safe_bool(data: Mapping[str, Any], name: str, reasons: Mapping[str, Any]) -> bool | None:
    value = data.get(name, False)
    if value is None:
        return None if name in reasons else False
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {value!r}")
    return value


def load(path: str | os.PathLike[str], source: str = "ARFUSE_TOPOLOGY") -> Topology:
    """Read a topology JSON file; every problem is a ``ValueError`` naming the file and
    ``source``, where its path came from (``ARFUSE_TOPOLOGY``, ``--topology``). Only a regular
    file is read (a FIFO or a device would block), and what is read is bounded (file size,
    nesting, world size), so an absurd file fails at once."""
    path = Path(path)
    name = f"{str(path)!r} ({source})"
    raw = read_regular_file(path, MAX_FILE_BYTES, f"topology file {name}")
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"topology file {name} is larger than {MAX_FILE_BYTES >> 20} MiB; a "
                         "topology lists one host per rank and needs far less")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"topology file {name} is not UTF-8 text (byte {exc.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"topology file {name} is not valid JSON: {exc.msg} at line {exc.lineno}"
        ) from None
    except RecursionError:
        raise ValueError(f"topology file {name} is nested too deeply to be a topology "
                         "(a flat JSON object is expected)") from None
    try:
        return Topology.from_dict(data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"topology file {name}: {exc}") from None


@dataclass(frozen=True)
class LocalFacts:
    """What one rank knows about itself; gathered from every rank (as JSON) and merged by
    ``merge``. A rank sees only its own GPU, so for NVLink it reports who it is (``gpu_id``)
    and which GPUs of its host it reaches (``nvlink_peers``); ``merge`` judges every pair.

    ``nvlink_all_pairs`` is a rank's own verdict when it needs no peers: false (a CPU rank), or
    true (this rank reaches every GPU of its host); ``None`` leaves it to the peers."""

    host: str
    device: str
    sm: int | None = None
    gpu: str | None = None
    multicast: bool | None = None
    nvlink_all_pairs: bool | None = None
    fabric: bool | None = None
    flashinfer: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    gpu_id: str | None = None
    """This rank's physical GPU (NVML UUID): what its host's other ranks list as a peer."""
    nvlink_peers: list[str] | None = None
    """GPUs of this host this GPU has NVLink P2P to (NVML UUIDs); ``None``: unknown."""
    fabric_cluster: str | None = None
    fabric_clique: int | None = None
    unknown: dict[str, str] = field(default_factory=dict)
    """Fact -> why this rank could not read it (only for facts it left ``None``)."""


def merge(facts: Sequence[LocalFacts]) -> Topology:
    """One topology from every rank's facts, in rank order (pure). A capability is true only
    when every rank has it, false when some rank lacks it, else unknown with the reasons."""
    if not facts:
        raise ValueError("merge needs the facts of at least one rank")
    devices = {f.device for f in facts}
    if len(devices) != 1:
        raise ValueError(f"ranks disagree on the device: {sorted(devices)}")
    sms = {f.sm for f in facts}
    gpus = {f.gpu for f in facts}
    versions = {f.flashinfer for f in facts}
    nvlink, nvlink_ranks = _nvlink_all_pairs(facts)
    fabric = _fabric(facts)
    topo = Topology(
        device=facts[0].device,
        world_size=len(facts),
        hosts=tuple(f.host for f in facts),
        # A mixed group is treated as its weakest member: the smallest SM, and flashinfer only
        # when every rank has the same version (a mixed install is not something to fuse across).
        sm=None if None in sms else min(s for s in sms if s is not None),
        gpu=facts[0].gpu if len(gpus) == 1 else "mixed",
        multicast=_all_of(f.multicast for f in facts),
        nvlink_all_pairs=nvlink,
        fabric=fabric,
        flashinfer=facts[0].flashinfer if len(versions) == 1 else None,
    )
    if topo.device != "cuda":
        return topo  # GPU facts do not apply: nothing is unknown, it is absent
    unknown: dict[str, str] = {}
    for name in ("sm", "gpu", "multicast", "fabric"):
        if getattr(topo, name) is None:
            ranks = [r for r, f in enumerate(facts) if getattr(f, name) is None]
            unknown[name] = _reasons(facts, name, ranks)
    if nvlink is None:
        unknown["nvlink_all_pairs"] = _reasons(facts, "nvlink_all_pairs", nvlink_ranks)
    if len(versions) > 1:
        unknown["flashinfer"] = "ranks disagree: " + _grouped(
            [(r, f.flashinfer or "not installed") for r, f in enumerate(facts)])
    return replace(topo, unknown={name: unknown[name] for name in FACTS if name in unknown})


def _all_of(values: Any) -> bool | None:
    seen = list(values)
    if any(v is False for v in seen):
        return False
    if any(v is None for v in seen):
        return None
    return True


def _link(a: LocalFacts, b: LocalFacts) -> bool | None:
    """Whether two ranks of one host are NVLink-connected: yes if either side reports it, no if
    a side that could name the other does not, else unknown."""
    if a.gpu_id is not None and a.gpu_id == b.gpu_id:
        return True  # one GPU: nothing to link
    if a.nvlink_all_pairs or b.nvlink_all_pairs:
        return True
    if (a.nvlink_peers is not None and b.gpu_id in a.nvlink_peers) or (
            b.nvlink_peers is not None and a.gpu_id in b.nvlink_peers):
        return True
    a_knows = a.nvlink_peers is not None and b.gpu_id is not None
    b_knows = b.nvlink_peers is not None and a.gpu_id is not None
    return False if a_knows or b_knows else None


def _nvlink_all_pairs(facts: Sequence[LocalFacts]) -> tuple[bool | None, list[int]]:
    """Per host, is every pair of the group's GPUs there NVLink-connected? (One GPU on a host:
    trivially yes.) Also the ranks whose missing facts leave it unknown."""
    if any(f.nvlink_all_pairs is False for f in facts):
        return False, []
    if all(f.nvlink_all_pairs for f in facts):
        return True, []  # every rank reaches every GPU of its host: no pair to judge
    by_host: dict[str, list[int]] = {}
    for rank, f in enumerate(facts):
        by_host.setdefault(f.host, []).append(rank)
    vague: set[int] = set()
    for ranks in by_host.values():
        for i, a in enumerate(ranks):
            for b in ranks[i + 1:]:
                linked = _link(facts[a], facts[b])
                if linked is False:
                    return False, []
                if linked is None:
                    vague.update(r for r in (a, b) if facts[r].nvlink_peers is None
                                 or facts[r].gpu_id is None)
    if vague:
        return None, sorted(vague)
    return True, []


def _fabric(facts: Sequence[LocalFacts]) -> bool | None:
    """One MNNVL fabric: every rank registered, all in the same cluster and clique."""
    seen = _all_of(f.fabric for f in facts)
    if seen is not True:
        return seen
    cliques = {(f.fabric_cluster, f.fabric_clique) for f in facts}
    cluster, clique = next(iter(cliques))
    return len(cliques) == 1 and cluster is not None and clique is not None


def _reasons(facts: Sequence[LocalFacts], name: str, ranks: Sequence[int]) -> str:
    """"rank 3: why" for the ranks that left ``name`` unknown, grouped by reason."""
    return _grouped([(r, facts[r].unknown.get(name) or "not reported") for r in ranks])


def _grouped(items: Sequence[tuple[int, str]]) -> str:
    by_reason: dict[str, list[int]] = {}
    for rank, reason in items:
        by_reason.setdefault(reason, []).append(rank)
    parts = [f"{_rank_text(ranks)}: {reason}" for reason, ranks in by_reason.items()]
    if len(parts) > _MAX_REASONS:
        parts = [*parts[:_MAX_REASONS], f"{len(parts) - _MAX_REASONS} other reasons"]
    return "; ".join(parts)


def _rank_text(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3"."""
    spans: list[str] = []
    start = prev = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def host_identity() -> str:
    """Hostname plus kernel boot id: two containers of one kernel with one hostname are one host."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    name = socket.gethostname()
    return f"{name}:{boot}" if boot else name


def flashinfer_version() -> str | None:
    """The installed FlashInfer version, without importing it (importing loads CUDA)."""
    from importlib import metadata

    for dist in ("flashinfer-python", "flashinfer"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def local_facts(device: str) -> LocalFacts:
    """This process's facts. On CUDA every GPU fact is read (``gpu_facts``); what cannot be read
    stays unknown (``None``) with its reason."""
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not valid; use one of {', '.join(DEVICES)}")
    if device == "cpu":
        return LocalFacts(host=host_identity(), device="cpu", multicast=False,
                          nvlink_all_pairs=False, fabric=False, flashinfer=flashinfer_version())
    from . import gpu_facts

    gpu = gpu_facts.read()
    return LocalFacts(
        host=host_identity(), device="cuda", sm=gpu.sm, gpu=gpu.gpu, multicast=gpu.multicast,
        fabric=gpu.fabric, flashinfer=flashinfer_version(), gpu_id=gpu.gpu_id,
        nvlink_peers=None if gpu.nvlink_peers is None else list(gpu.nvlink_peers),
        fabric_cluster=gpu.fabric_cluster, fabric_clique=gpu.fabric_clique,
        unknown=dict(gpu.unknown))


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def this_machine(world_size: int, device: str | None = None,
                 facts: LocalFacts | None = None) -> Topology:
    """What-if topology of ``world_size`` ranks all on this machine (for ``arfuse explain``):
    this GPU's facts on every rank, NVLink judged as this GPU and ``world_size - 1`` of its
    NVLink peers (the best group this host offers it)."""
    facts = facts or local_facts(device or default_device())
    if facts.device == "cuda" and world_size > 1 and facts.nvlink_all_pairs is None:
        reach = (None if facts.nvlink_peers is None
                 else len(facts.nvlink_peers) >= world_size - 1)
        facts = replace(facts, nvlink_all_pairs=reach, gpu_id=None, nvlink_peers=None)
    return merge([facts] * world_size)
