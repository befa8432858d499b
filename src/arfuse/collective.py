"""``torch.distributed`` collectives of a call, within the group's deadline (R8).

A rank whose wait runs out posts that in the group's store, so the ranks that did call can
name the ones that did not (``CallTimeout.silent``). Used by the unfused backend's calls and
by the op's residual check; negotiation has its own channel (``rendezvous``).
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import time
from typing import Any

import torch
import torch.distributed as dist

from .errors import CallTimeout

# torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single; same semantics
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# how long ranks that timed out wait to see which others timed out too
SILENT_GRACE_S = 0.5


def wait_within_deadline(work: Any, ctx: Any, phase: str, backend: str, call: int) -> None:
    """Wait for async ``work`` at most the group's timeout; on a timeout (ours or the process
    group's) raise ``CallTimeout`` naming the ranks that never joined call number ``call``."""
    deadline = time.monotonic() + ctx.timeout_s
    try:
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(0.0002)
        work.wait()
    except Exception as exc:
        if ctx.group is not None:
            keep_for_the_process(ctx.group)
        silent = silent_ranks(ctx, phase, call)
        reported = f"{type(exc).__name__}: {str(exc)[:200]}"
        if not isinstance(exc, TimeoutError) and PEER_GONE.search(str(exc)):
            if silent is None and ctx.world_size == 2:  # the store went too; one peer it is
                silent = [1 - ctx.rank]
            raise CallTimeout(phase, backend, silent, ctx.timeout_s,
                              message=peer_gone(phase, backend, silent, call, reported)) from None
        detail = f" (call {call})" + (
            "" if isinstance(exc, TimeoutError) else f"; the process group reported {reported}")
        raise CallTimeout(phase, backend, silent, ctx.timeout_s, detail=detail) from None


# what gloo (and NCCL's socket layer) say when a peer's end of the connection went away
PEER_GONE = re.compile(r"connection (?:closed|reset)|(?:closed|reset) by peer|broken pipe|"
                       r"ECONNRESET|EPIPE", re.IGNORECASE)


def peer_gone(phase: str, backend: str, silent: list[int] | None, call: int,
              reported: str) -> str:
    """The text of a call whose process group lost the connection to a peer: the peer died or
    left (it says so at once; no deadline ran out), named where the store knows it."""
    who = ("a peer (which rank is unknown)" if not silent else
           f"rank(s) {', '.join(map(str, silent))}")
    return (f"arfuse {backend}: the connection to {who} was closed or reset during a call "
            f"(phase {phase!r}, backend {backend}, call {call}): the peer died or left the "
            f"group; the process group reported {reported}")


_kept: list[int] = []


def keep_for_the_process(group: Any) -> None:
    """Never free ``group``: its abandoned collective stays queued in the backend (gloo), and
    the backend's destructor waits for it, which held the process's exit until the process
    group's own timeout (torch's default: 30 minutes). A group out of step is of no further
    use (``WorkspaceBroken.GROUP_ADVICE``), so it lives until the process ends, unfreed; one
    reference the interpreter cannot drop at shutdown (a list would be cleared then)."""
    if id(group) in _kept:
        return
    _kept.append(id(group))
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def silent_ranks(ctx: Any, phase: str, call: int) -> list[int] | None:
    """Ranks that timed out at this call say so in the store; the others are silent."""
    store = ctx.channel.store
    if store is None:
        return None
    key = f"timeout/{phase}/{call}"
    prefix = f"{ctx.channel.prefix}/{key}"
    with contextlib.suppress(Exception):
        ctx.channel.post(f"{key}/{ctx.rank}", "1")
        time.sleep(SILENT_GRACE_S)
        return [r for r in range(ctx.world_size) if not store.check([f"{prefix}/{r}"])]
    return None


def gather(x: torch.Tensor, ctx: Any, phase: str, backend: str, call: int) -> torch.Tensor:
    """``[world, *x.shape]`` of every rank's ``x`` over the group, within the deadline."""
    world = ctx.world_size
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    wait_within_deadline(_all_gather(out, x, group=ctx.group, async_op=True), ctx, phase,
                         backend, call)
    return out.view(world, *x.shape)
