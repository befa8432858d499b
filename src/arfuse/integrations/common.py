"""What every engine drop-in shares: the group's agreed facts (one exchange, under the drop-in's
deadline, through the group's own store), the drop-in's deadline, and the small rules about
groups and logging that each drop-in would otherwise write again.

An engine's own rule (which backend its setting means on the group's topology) stays in its
drop-in; this module only brings every rank the same setting and the same topology.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import group as group_mod
from .. import log, negotiate
from .. import settings as settings_mod
from .. import topology as topology_mod
from ..errors import NegotiationError
from ..group import GroupContext
from ..ops import FusedAllReduce
from ..registry import REGISTRY
from ..topology import Topology

FLASHINFER_BACKENDS = ("mnnvl", "trtllm")
# The drop-ins' deadline when ARFUSE_TIMEOUT_S is not set: torch's default process-group
# timeout, which the engines' own creation waits on their gloo group. Ranks reach the first
# creation after loading their weights, minutes apart on a large model; arfuse's 60 s default
# would end that start-up on the early ranks.
DROP_IN_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Agreed:
    """What every rank of the group sent and what they agree on: the engine's setting and
    the group's topology (its node count is the group's own, R6)."""

    setting: Any
    topology: Topology
    group_key: str
    rank: int
    world_size: int
    known: tuple[Any, ...] = ()  # every rank's ``known()`` (``agree``), in rank order


def drop_in_timeout_s() -> float:
    """``ARFUSE_TIMEOUT_S`` when set, else ``DROP_IN_TIMEOUT_S`` (what the engine would wait)."""
    if os.environ.get(settings_mod.ENV_VARS["timeout_s"]) is not None:
        return settings_mod.load().timeout_s
    return DROP_IN_TIMEOUT_S


def _fallback_timeout_s() -> float:
    """The drop-in's wait for a rank whose own settings are what failed."""
    try:
        return drop_in_timeout_s()
    except (TypeError, ValueError):
        return DROP_IN_TIMEOUT_S


def level(rank: int, level: int) -> int:
    """Decisions are the same on every rank: group rank 0 tells them, the others at debug."""
    return level if rank == 0 else logging.DEBUG


def normalize(group: Any) -> Any:
    """``None`` is the default group, or one process without ``torch.distributed``."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


def rank_and_size(group: Any) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def cuda_if_available() -> str | None:
    """The engines pass their gloo group while their tensors are CUDA: CUDA whenever
    available; otherwise arfuse infers the device from the group."""
    return "cuda" if torch.cuda.is_available() else None


def forget_if_unused(key: str) -> None:
    """R10: no reference to the group's store once arfuse holds no workspace of it."""
    if not any(ws.ctx.key == key for ws in REGISTRY.workspaces()):
        group_mod.forget_group(key)


def _local_view(ctx: GroupContext, setting: Any, known: Any) -> dict[str, Any]:
    """This rank's setting, what it already knows, its facts and topology file (what
    ``agree`` exchanges)."""
    path = ctx.settings.topology_path
    return {"setting": setting, "known": known,
            "file_topology": topology_mod.load(path).to_dict() if path else None,
            "facts": asdict(topology_mod.local_facts(ctx.device))}


def _agreed_setting(ctx: GroupContext, payloads: list[dict[str, Any]], name: str) -> Any:
    settings = [p["setting"] for p in payloads]
    if any(s != settings[0] for s in settings):
        values = "; ".join(f"rank {rank}: {s!r}" for rank, s in enumerate(settings))
        raise NegotiationError(f"ranks of group {ctx.key} have different {name}: "
                               f"{values}. Every rank of the group must ask for the same thing")
    return settings[0]


def agree(group: Any, device: str | None, setting: Callable[[], Any], name: str, scope: str,
          check: Callable[[], None] = lambda: None,
          known: Callable[[], Any] = lambda: None) -> Agreed:
    """Collective on ``group``: every rank sends its setting (``setting()``, called ``name``
    in errors) and facts through the group's own store, under the drop-in's deadline.
    ``check``: the caller's checks of its arguments; what it, ``setting()`` or this rank's
    settings raise travels in the exchange, so every rank fails together instead of the
    others waiting. ``known``: what this rank already knows of the request (a remembered
    answer, JSON), which may differ between ranks: every rank gets all of them in
    ``Agreed.known``, so a rank that answers from memory still makes the exchange its peers
    make, and they all answer alike."""
    member = group_mod.join(group)
    epoch = member.channel.next_epoch()
    member.channel.begin(f"n{epoch}/{scope}")

    def local() -> tuple[GroupContext, dict[str, Any]]:
        check()
        value, knows = setting(), known()
        conf = settings_mod.load(timeout_s=drop_in_timeout_s())
        log.configure(conf.log_level)
        ctx = group_mod.make_context(member, device, conf)
        return ctx, _local_view(ctx, value, knows)

    try:
        found, error = negotiate.attempt_locally(local)
        timeout = found[0].timeout_s if found is not None else _fallback_timeout_s()
        try:
            payloads = negotiate.exchange_verdicts(member.channel, timeout, "facts",
                                                   None if found is None else found[1], error)
        finally:  # no reference cycle through the error this frame's traceback holds
            del error
        assert found is not None  # a rank whose local step failed raised above
        ctx = found[0]
        try:
            agreed = _agreed_setting(ctx, payloads, name)
            topo = negotiate.topology_of(ctx, payloads)
        except (NegotiationError, ValueError) as exc:
            negotiate.fail_together(ctx.channel, ctx.timeout_s, "facts", exc)
    finally:
        forget_if_unused(member.key)
    return Agreed(agreed, topo, ctx.key, ctx.rank, ctx.world_size,
                  tuple(p["known"] for p in payloads))


def release(ops: Iterable[FusedAllReduce], engine: str) -> None:
    """Close every op, going on past one that raises (R10: free the rest)."""
    for op in ops:
        try:
            op.close()
        except Exception as exc:  # keep freeing the rest
            log.logger.warning("arfuse %s drop-in: releasing a %s workspace raised %s: %s",
                               engine, op.backend, type(exc).__name__, exc)
