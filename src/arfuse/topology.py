"""Facts of the all-reduce group: a frozen value, JSON in and out, and this process's own facts.

A ``Topology`` always describes the *group* (R6): ``world_size`` is the group's size and
``hosts`` holds one host identity per group rank, so ``node_count`` never counts ranks outside it.
Gathering every rank's ``LocalFacts`` is collective and lives in ``negotiate``; here the merge
is pure: a capability counts only when every rank has it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEVICES = ("cpu", "cuda")
MAX_WORLD_SIZE = 1 << 16          # far beyond any all-reduce group; bounds what a file may ask
MAX_FILE_BYTES = 4 << 20          # a topology of MAX_WORLD_SIZE ranks fits with room to spare
_FIELDS = ("device", "world_size", "hosts", "sm", "gpu", "multicast", "nvlink_all_pairs",
           "fabric", "flashinfer")


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
            raise ValueError(
                f"hosts has {len(hosts)} entries but world_size={self.world_size}; "
                "give one host identity per rank of the group"
            )
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

    @property
    def node_count(self) -> int:
        return len(set(self.hosts))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["hosts"] = list(self.hosts)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        """Missing fields take the safe value (``false``, ``null``, one host)."""
        if not isinstance(data, Mapping):
            raise ValueError("a topology must be a JSON object")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown topology field(s) {unknown}; valid: {', '.join(_FIELDS)}")
        hosts = data.get("hosts")
        if hosts is not None and not isinstance(hosts, list):
            raise TypeError("hosts must be a list of strings, one per rank")
        world_size = data.get("world_size", len(hosts) if hosts else 1)
        if hosts is None and isinstance(world_size, int) and not isinstance(world_size, bool) \
                and 1 <= world_size <= MAX_WORLD_SIZE:
            hosts = ["host0"] * world_size
        return cls(
            device=data.get("device", "cpu"),
            world_size=world_size,
            hosts=tuple(hosts or ()),
            sm=data.get("sm"),
            gpu=data.get("gpu"),
            multicast=_safe_bool(data, "multicast"),
            nvlink_all_pairs=_safe_bool(data, "nvlink_all_pairs"),
            fabric=_safe_bool(data, "fabric"),
            flashinfer=data.get("flashinfer"),
        )


def _safe_bool(data: Mapping[str, Any], name: str) -> bool:
    value = data.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {value!r}")
    return value


def load(path: str | os.PathLike[str]) -> Topology:
    """Read a topology JSON file; every problem is a ``ValueError`` naming the file. What is
    read is bounded (file size, nesting, world size), so an absurd file fails at once."""
    path = Path(path)
    name = repr(str(path))
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read topology file {name}: {exc.strerror}") from None
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
    """What one rank knows about itself; gathered from every rank and merged by ``merge``."""

    host: str
    device: str
    sm: int | None = None
    gpu: str | None = None
    multicast: bool | None = None
    nvlink_all_pairs: bool | None = None
    fabric: bool | None = None
    flashinfer: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def merge(facts: Sequence[LocalFacts]) -> Topology:
    """One topology from every rank's facts, in rank order (pure)."""
    if not facts:
        raise ValueError("merge needs the facts of at least one rank")
    devices = {f.device for f in facts}
    if len(devices) != 1:
        raise ValueError(f"ranks disagree on the device: {sorted(devices)}")
    sms = {f.sm for f in facts}
    gpus = {f.gpu for f in facts}
    versions = {f.flashinfer for f in facts}
    return Topology(
        device=facts[0].device,
        world_size=len(facts),
        hosts=tuple(f.host for f in facts),
        # A mixed group is treated as its weakest member: the smallest SM, and flashinfer only
        # when every rank has the same version (a mixed install is not something to fuse across).
        sm=None if None in sms else min(s for s in sms if s is not None),
        gpu=facts[0].gpu if len(gpus) == 1 else "mixed",
        multicast=_all_of(f.multicast for f in facts),
        nvlink_all_pairs=_all_of(f.nvlink_all_pairs for f in facts),
        fabric=_all_of(f.fabric for f in facts),
        flashinfer=facts[0].flashinfer if len(versions) == 1 else None,
    )


def _all_of(values: Any) -> bool | None:
    seen = list(values)
    if any(v is False for v in seen):
        return False
    if any(v is None for v in seen):
        return None
    return True


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
    """This process's facts. GPU capabilities are not detected yet: they stay unknown (``None``)."""
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not valid; use one of {', '.join(DEVICES)}")
    if device == "cpu":
        return LocalFacts(host=host_identity(), device="cpu", multicast=False,
                          nvlink_all_pairs=False, fabric=False, flashinfer=flashinfer_version())
    import torch

    sm: int | None = None
    gpu: str | None = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        sm = major * 10 + minor
        gpu = torch.cuda.get_device_name()
    return LocalFacts(host=host_identity(), device="cuda", sm=sm, gpu=gpu,
                      flashinfer=flashinfer_version())


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def this_machine(world_size: int, device: str | None = None) -> Topology:
    """What-if topology of ``world_size`` ranks all on this machine (for ``arfuse explain``)."""
    facts = local_facts(device or default_device())
    return merge([facts] * world_size)
