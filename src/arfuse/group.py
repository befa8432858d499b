"""One all-reduce group as this rank sees it: its membership (rank, size, the group's channel)
and, under one op's settings, its context. What every layer that talks to the group takes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from . import faults, topology
from .rendezvous import Channel
from .settings import Settings


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


@dataclass(frozen=True)
class Member:
    """This rank in a group before any of its settings are known: enough to exchange with the
    other ranks (rank, size, the group's channel)."""

    group: Any  # torch.distributed.ProcessGroup, or None for a single process
    rank: int
    world_size: int
    key: str
    channel: Channel


def join(group: Any) -> Member:
    """This rank of ``group`` (``None``: WORLD, or one process) and the group's channel. Only a
    ``group`` that is not a process group of this process fails here: with no group there is
    nobody to tell."""
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
    key = group_key(group)
    with _channels_lock:
        channel = _channels.get(key)
        if channel is None or channel.world_size != world or channel.rank != rank:
            channel = _channels[key] = Channel(store, f"arfuse/{key}", rank, world)
        channel.store = store
    return Member(group, rank, world, key, channel)


def make_context(member: Member, device: str | None, settings: Settings) -> GroupContext:
    """The member's context under ``settings``: its device (``None``: the group's) and the
    settings' faults; bad values are errors that name them."""
    import torch

    if device is None:
        device = _device_of(member.group)
    elif device not in topology.DEVICES:
        raise ValueError(f"device={device!r} is not valid; use one of "
                         f"{', '.join(topology.DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but this process has no usable CUDA device "
                         "(torch.cuda.is_available() is False); use device='cpu'")
    return GroupContext(group=member.group, rank=member.rank, world_size=member.world_size,
                        device=device, key=member.key, channel=member.channel,
                        settings=settings, faults=faults.parse(settings.faults))


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
