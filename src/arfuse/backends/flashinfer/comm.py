"""FlashInfer's collective steps on the group's own channel, so that no rank waits forever.

FlashInfer's constructors exchange memory handles through the ``comm_backend`` they are given
(``allgather``/``bcast``/``barrier``). Its ``TorchDistBackend`` runs them as torch.distributed
collectives: a rank whose constructor raised (no multicast, out of memory, a driver error)
never joins, and its peers wait in the collective until the process group's own timeout, if
ever. Here the same interface runs on arfuse's channel: every exchange has the group's
deadline (``ARFUSE_TIMEOUT_S``), and a rank that failed has already announced it (negotiation
aborts the scope before it votes), so a peer waiting in FlashInfer's exchange raises
``PeerAborted`` at once and votes "failed" too.

Before any rank enters the constructor, ``agree_to_enter`` settles what would make it raise or
hang on some ranks only: different FlashInfer versions, FABRIC against POSIX handles, a
Confidential Computing mode on some ranks, a temp directory that same-host ranks do not share
(FlashInfer >= 0.6.16 and torch's symmetric memory pass file descriptors over sockets there),
and a rank without the free memory the workspace needs.
"""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import tempfile
import types
import uuid
from collections.abc import Mapping
from typing import Any

from ...errors import CreationFailed
from ...topology import host_identity


def _encode(value: Any) -> str:
    """Handles are bytes (FABRIC), socket paths, ints: pickled, as ``all_gather_object``
    does, and carried as text through the JSON channel."""
    return base64.b64encode(pickle.dumps(value)).decode("ascii")


def _decode(text: str) -> Any:
    return pickle.loads(base64.b64decode(text))  # written by this group's ranks only


class ChannelComm:
    """FlashInfer's ``CommBackend`` (``Get_rank``, ``Get_size``, ``allgather``, ``bcast``,
    ``barrier``, ``Split``) over the group's channel. Mixed in before FlashInfer's own
    ``TorchDistBackend`` (``channel_comm``): FlashInfer 0.6.13 takes the group for torch's
    symmetric memory from a ``TorchDistBackend``'s ``_group`` (R9)."""

    _ctx: Any
    _backend: str
    _count: int

    def _attach(self, ctx: Any, backend: str) -> None:
        self._ctx, self._backend, self._count = ctx, backend, 0

    def rescope(self, scope: str) -> None:
        """Exchanges after creation (checkpoint) run in a scope of their own, the same on every
        rank; collective like every call on this object."""
        self._ctx.channel.begin(scope)
        self._count = 0

    def _exchange(self, value: Any) -> list[Any]:
        phase = f"fi/{self._count}"
        self._count += 1
        return [_decode(v) for v in self._ctx.channel.all_gather(
            phase, _encode(value), self._ctx.timeout_s, self._backend, True)]

    def Get_rank(self) -> int:  # FlashInfer's CommBackend names
        return int(self._ctx.rank)

    def Get_size(self) -> int:
        return int(self._ctx.world_size)

    def allgather(self, data: Any) -> list[Any]:
        return self._exchange(data)

    def bcast(self, data: Any, root: int) -> Any:
        return self._exchange(data if self._ctx.rank == root else None)[root]

    def barrier(self) -> None:
        self._exchange(None)

    def Split(self, color: int, key: int) -> Any:
        raise NotImplementedError("arfuse's comm backend serves exactly its group; FlashInfer "
                                  "asked to split it")


_classes: dict[type, type] = {}


def channel_comm(ctx: Any, backend: str, torch_dist_backend: type) -> Any:
    """A ``comm_backend`` for FlashInfer bound to ``ctx``'s group: FlashInfer's own
    ``TorchDistBackend(group)`` (so its type checks and ``_group`` hold) whose exchanges run on
    the channel."""
    cls = _classes.get(torch_dist_backend)
    if cls is None:
        cls = types.new_class("ArfuseChannelComm", (ChannelComm, torch_dist_backend))
        _classes[torch_dist_backend] = cls
    comm = cls(ctx.group)
    comm._attach(ctx, backend)
    return comm


def _marker() -> tuple[str | None, str]:
    """A file in the temp directory FlashInfer's and torch's fd exchange use, for same-host
    peers to look for; ``(None, why)`` when it cannot be made."""
    directory = tempfile.gettempdir()
    path = os.path.join(directory, f"arfuse-fdx-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        open(path, "x").close()  # only its existence matters
    except OSError as exc:
        return None, f"cannot create a file in the temp directory {directory}: {exc.strerror}"
    return path, ""


def agree_to_enter(ctx: Any, backend: str, facts: Mapping[str, Any], problem: str) -> None:
    """Collective, before FlashInfer's constructor: every rank enters it, or every rank raises
    ``CreationFailed`` naming the ranks and reasons. ``facts`` must be equal on every rank;
    ``problem`` is this rank's own reason not to enter ("" for none)."""
    sockets = facts.get("fabric") is not True  # FABRIC handles travel through the channel
    marker, why = _marker() if sockets else (None, "")
    try:
        mine = {"facts": dict(facts), "host": host_identity(), "marker": marker,
                "problem": problem or why}
        everyone = ctx.all_gather("fi-enter/facts", mine, backend)
        local = mine["problem"]
        if not local and sockets:
            unseen = [r for r, peer in enumerate(everyone)
                      if r != ctx.rank and peer["host"] == mine["host"] and peer["marker"]
                      and not os.path.exists(peer["marker"])]
            if unseen:
                local = (f"the temp directory {tempfile.gettempdir()} is not the one of "
                         f"same-host rank(s) {unseen} (FlashInfer and torch pass memory "
                         "handles over sockets there; give the ranks one TMPDIR)")
        verdicts = ctx.all_gather("fi-enter/verdict", local, backend)
    finally:
        if marker:
            with contextlib.suppress(OSError):
                os.remove(marker)
    reasons = [f"rank {r}: {v}" for r, v in enumerate(verdicts) if v]
    for name in sorted(facts):
        values = [peer["facts"].get(name) for peer in everyone]
        if any(v != values[0] for v in values):
            reasons.append(f"ranks differ in {name}: " + ", ".join(
                f"rank {r}: {v}" for r, v in enumerate(values)))
    if reasons:
        raise CreationFailed(f"{backend}: not entering FlashInfer's constructor, it would fail "
                             "or hang on some ranks only (" + "; ".join(reasons) + ")")
