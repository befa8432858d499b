"""Rank bodies for the life of the shm segment: its creation with a silent, failing or killed
peer, how it is named, what is left in its directory and in the working directory, views of
the slot after close, the kernel's handle released during a call. Module level, so they can be
pickled."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch


def shm_create_with_a_silent_peer(rank: int, world: int, directory: str) -> str:
    """Rank 0 creates the shm segment while rank 1 never takes part: what rank 0 raises, and
    which segments of its process are left in ``directory`` (ARFUSE_SHM_DIR)."""
    from arfuse import group, settings
    from arfuse.backends.shm import backend as shm_backend
    from arfuse.spec import Spec

    ctx = group.make_context(group.join(None), "cpu", settings.load(timeout_s=1.0))
    ctx.channel.next_epoch()
    ctx.channel.begin("n1/shm")
    if rank != 0:
        time.sleep(3.0)  # alive, silent
        return "silent"
    try:
        shm_backend.ShmBackend().create(ctx, Spec(max_tokens=16, hidden=64, dtype="fp32"))
        outcome = "created"
    except Exception as exc:  # the test checks the class
        outcome = type(exc).__name__
    mine = [p for p in os.listdir(directory) if p.split("-")[1:2] == [str(os.getpid())]]
    return f"{outcome}; left: {mine}"


def peer_fails_in_shm_exchange(rank: int, world: int, phase: str, directory: str,
                               fails: str) -> dict[str, Any]:
    """Rank 1 fails at the shm creation exchange ``phase``: with ``fails="exchange"`` it
    announces a failure instead of its value (the others see ``PeerAborted`` there); with
    ``fails="cleanup"`` its mapped workspace fails and then freeing it raises too. What the
    other ranks hold of segments right after the failed attempt (no garbage collection), their
    attempts, and what is left in ``directory`` (ARFUSE_SHM_DIR)."""
    import gc

    import arfuse
    from arfuse import group
    from arfuse.backends.shm.workspace import ShmWorkspace

    gc.disable()
    if rank == 1 and fails == "exchange":
        original = group.GroupContext.all_gather

        def all_gather(self: Any, name: str, value: Any, backend: str = "-",
                       abortable: bool = True) -> list[Any]:
            if name == phase:
                self.channel.abort(f"MemoryError: injected before {phase}")
                raise MemoryError(f"injected before {phase}")
            return original(self, name, value, backend, abortable)

        group.GroupContext.all_gather = all_gather  # type: ignore[method-assign]
    if rank == 1 and fails == "cleanup":
        free = ShmWorkspace._free

        def publish_identity(self: Any) -> None:
            raise MemoryError("injected after mapping")

        def failing_free(self: Any) -> None:
            free(self)
            raise RuntimeError("injected: freeing raised")

        ShmWorkspace.publish_identity = publish_identity  # type: ignore[method-assign]
        ShmWorkspace._free = failing_free  # type: ignore[method-assign]
    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32)
    report: dict[str, Any] = {"backend": comm.backend, "held": _segments_held(),
                              "attempts": [a.describe() for a in comm.attempts]}
    comm.close()
    torch.distributed.barrier()
    report["left"] = sorted(os.listdir(directory))
    gc.enable()
    return report


def creator_killed_at(rank: int, world: int, point: str, named: str) -> str:
    """Rank 0 SIGKILLs itself at ``point`` of the shm creation (after the exchange of that
    name returned; "named": right after it gave the segment a name); the others report what
    they raised. ``named``: "never" (the usual way), "for a peer" (rank 1 acts as if in
    another pid namespace, so rank 0 names the segment for it) or "from the start" (rank 0's
    filesystem has no unnamed files)."""
    import errno
    import signal

    import arfuse
    from arfuse import group
    from arfuse.backends.shm import segment as shm_segment

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == 1 and named == "for a peer":
        namespace = shm_segment.pid_namespace()
        shm_segment.pid_namespace = lambda: namespace + 1  # type: ignore[assignment]
    if rank == 0:
        link, open_ = shm_segment.os.link, shm_segment.os.open
        all_gather = group.GroupContext.all_gather

        def link_then(*args: Any, **kwargs: Any) -> None:
            link(*args, **kwargs)
            if point == "named":
                die()

        def open_then(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if named == "from the start" and flags & os.O_TMPFILE == os.O_TMPFILE:
                raise OSError(errno.EOPNOTSUPP, "no unnamed files here")
            return open_(path, flags, *args, **kwargs)

        def all_gather_then(self: Any, name: str, *args: Any, **kwargs: Any) -> list[Any]:
            if name == point == "shm-name" and named == "from the start":
                die()  # named, the peers not told
            got = all_gather(self, name, *args, **kwargs)
            if name == point:
                die()
            return got

        shm_segment.os.link = link_then  # type: ignore[assignment]
        shm_segment.os.open = open_then  # type: ignore[assignment]
        group.GroupContext.all_gather = all_gather_then  # type: ignore[method-assign]
    try:
        arfuse.FusedAllReduce(max_token_num=64, hidden_dim=64, dtype=torch.float32,
                              backend="shm", strict=True)
    except Exception as exc:  # the test checks that the creator's death was noticed
        return type(exc).__name__
    return "created"


def shm_segment_named(rank: int, world: int, named: str) -> dict[str, Any]:
    """A shm op made the way ``named`` says (as in ``creator_killed_at``) and used: its result
    and whether anything is left in the directory."""
    import errno

    import arfuse
    from arfuse.backends.shm import segment as shm_segment

    if rank == 1 and named == "for a peer":
        namespace = shm_segment.pid_namespace()
        shm_segment.pid_namespace = lambda: namespace + 1  # type: ignore[assignment]
    if rank == 0 and named == "from the start":
        open_ = shm_segment.os.open

        def open_then(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & os.O_TMPFILE == os.O_TMPFILE:
                raise OSError(errno.EOPNOTSUPP, "no unnamed files here")
            return open_(path, flags, *args, **kwargs)

        shm_segment.os.open = open_then  # type: ignore[assignment]
    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 backend="shm", strict=True)
    left = sorted(os.listdir(shm_segment.segment_dir()))
    out = comm(torch.ones(2, 64)).out
    comm.close()
    return {"out": out.sum().item(), "left": left}


def create_with_user_files_in_the_working_directory(rank: int, world: int,
                                                    directory: str) -> list[str]:
    """Ranks run in ``directory`` (their working directory), ARFUSE_SHM_DIR set but empty: a
    shm op is made, used and closed; what ``directory`` holds after."""
    import arfuse

    os.chdir(directory)
    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=32, dtype=torch.float32,
                                 backend="shm", strict=True)
    comm(torch.ones(1, 32))
    comm.close()
    torch.distributed.barrier()
    return sorted(os.listdir(directory))


def _mapped_bytes(start: int, end: int) -> int:
    """How many of the addresses [start, end) this process has mapped."""
    covered = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = (int(a, 16) for a in line.split()[0].split("-"))
        covered += max(0, min(high, end) - max(low, start))
    return covered


def _segments_held() -> dict[str, list[str]]:
    """This process's descriptors and mappings of arfuse segments (as the leak check sees them)."""
    from arfuse.scenarios import fd_targets, is_segment, mapped_segments

    return {"fds": sorted(t for t in fd_targets().values() if is_segment(t)),
            "maps": mapped_segments()}


def slot_view_after_close(rank: int, world: int) -> dict[str, Any]:
    """A call from this rank's slot, then close() while the slot's view is still held: what
    the view reads, whether this process still maps the segment, and whether the addresses
    are freed once the view goes (no garbage collection: reference counts alone)."""
    import gc

    import arfuse

    gc.disable()
    comm = arfuse.FusedAllReduce(max_token_num=1024, hidden_dim=1024, dtype=torch.float32,
                                 backend="shm", strict=True)
    path = comm.workspace.path  # type: ignore[attr-defined]
    start, end = comm.workspace.shared_span()  # type: ignore[union-attr]
    buf = comm.input_buffer(4)[:, :64]  # a view of a view
    buf.fill_(rank + 1.0)
    out = comm(comm.input_buffer(4)).out
    torch.distributed.barrier()  # every rank is out of its call
    comm.close()
    report: dict[str, Any] = {
        "path": path, "out": out.sum().item(), "out_in_segment": start <= out.data_ptr() < end,
        "read_after_close": buf.sum().item()}
    buf.fill_(5.0)  # writable too: the process's own memory now
    report["written_after_close"] = buf.sum().item()
    report["held_after_close"] = _segments_held()
    report["segment_bytes"] = end - start
    report["mapped_while_viewed"] = _mapped_bytes(start, end)
    del buf
    report["mapped_after_last_view"] = _mapped_bytes(start, end)
    gc.enable()
    return report


def release_during_operator_call(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 runs the torch operator in a thread while rank 1 is late, and meanwhile drops
    every Python reference to the kernel's ShmComm, so the operator's own reference is the
    last, released on a thread without the GIL when the call ends. The process must live on
    and the call give the sum."""
    import threading

    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 backend="shm", strict=True, timeout_s=20.0)
    ws = comm.workspace
    handle = int(ws.handle)  # type: ignore[attr-defined]
    x = torch.full((2, 64), float(rank + 1))

    def operator() -> torch.Tensor:
        return torch.ops.arfuse.shm_fused_allreduce(handle, x, None, None, 1e-6, 0.0, 0, 0.0,
                                                    None, None)[0]

    if rank == 1:
        time.sleep(1.5)
        return {"out": operator()[0, 0].item(), "released": False}
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["out"] = operator()[0, 0].item()
        except Exception as exc:  # reported, not raised: the thread's result is checked
            box["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.5)
    released = thread.is_alive()  # still waiting for rank 1: the operator holds the ShmComm
    comm._fast = None  # type: ignore[attr-defined]
    ws._comm = None  # type: ignore[attr-defined]
    import gc

    gc.collect()
    thread.join(30)
    return {**box, "released": released}
