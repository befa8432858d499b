"""Launch real ranks over gloo with short timeouts, so a bug fails a test instead of hanging CI."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from arfuse.launch import store_listener

_CTX = mp.get_context("forkserver")
# imported once per test process instead of once per rank; a module that is not installed
# is skipped (the forkserver ignores a failed preload). ARFUSE_TEST_PRELOAD (names separated
# by spaces) replaces the list where the ranks need less: scripts/arm_check.sh, under
# emulation, where torch.compile's modules cost seconds to import and its ranks never use them.
_PRELOAD = ("torch", "torch.distributed", "arfuse", "torch._dynamo", "torch._inductor.compile_fx",
            "transformers")
_CTX.set_forkserver_preload(os.environ.get("ARFUSE_TEST_PRELOAD", " ".join(_PRELOAD)).split())


@dataclass
class RankResult:
    rank: int
    ok: bool
    value: Any = None
    error: str = ""
    exitcode: int | None = None
    seconds: float = 0.0

    def __repr__(self) -> str:
        state = "ok" if self.ok else f"error={self.error[-600:]!r} exitcode={self.exitcode}"
        return f"RankResult(rank={self.rank}, {state})"


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int,
           listener: socket.socket | None, env: dict[str, str], args: tuple[Any, ...],
           results: Any, init: bool) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    from arfuse.launch import rank_store

    torch.set_num_threads(1)
    started = time.perf_counter()
    store = None
    try:
        if init:
            # rank 0 hosts the store, as in a plain init_process_group
            store = rank_store(rank, world, port, listener, 30.0)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=30))
        value = fn(rank, world, *args)
        # plain pickle copies tensor data: torch's queue reducers would share memory that dies
        # with this process
        results.put((rank, True, pickle.dumps(value), "", time.perf_counter() - started))
    except BaseException as exc:  # report everything, including timeouts, to the parent
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        results.put((rank, False, None, text, time.perf_counter() - started))
    finally:
        if store is not None:
            _leave_together(store, rank, world)
        if init and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


LEAVE_S = 5.0
"""How long rank 0 waits at the end for the other ranks to be done with its store."""


def _leave_together(store: Any, rank: int, world: int) -> None:
    """Rank 0 hosts the store: it stays until every other rank has finished with it (at most
    ``LEAVE_S``: a rank that died does not hold it up longer), so that a peer still reading the
    last keys of a collective step is not cut off by rank 0's exit."""
    with contextlib.suppress(Exception):
        if rank != 0:
            store.add("harness/left", 1)
            return
        deadline = time.monotonic() + LEAVE_S
        while store.add("harness/left", 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.02)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, env: dict[str, str] | None = None,
              timeout: float = 90.0, init: bool = True,
              expect: int | None = None) -> list[RankResult]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; never waits past ``timeout``.

    ``expect``: stop waiting once that many ranks reported (the rest are hung on purpose).
    """
    expect = world if expect is None else expect
    results = _CTX.Queue()
    # bound and listening before any rank starts, handed to rank 0 only: no other run can be
    # given its port (a port found free, closed and bound again later could be)
    with store_listener() as listener:
        port = int(listener.getsockname()[1])
        procs = [_CTX.Process(target=_entry, args=(fn, r, world, port,
                                                    listener if r == 0 and init else None,
                                                    dict(env or {}), args, results, init),
                              daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
    out: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout
    while len(out) < expect and time.monotonic() < deadline:
        try:
            rank, ok, value, error, seconds = results.get(timeout=0.2)
            out[rank] = RankResult(rank, ok, _load(value), error, seconds=seconds)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                # drain what is left, then stop waiting for ranks that died
                try:
                    while True:
                        rank, ok, value, error, seconds = results.get(timeout=0.5)
                        out[rank] = RankResult(rank, ok, _load(value), error, seconds=seconds)
                except queue.Empty:
                    break
    grace = deadline if expect == world else time.monotonic() + 1.0
    for p in procs:
        p.join(timeout=max(0.1, grace - time.monotonic()) if p.is_alive() else 0.1)
        if p.is_alive():
            p.kill()
            p.join(5)
    with contextlib.suppress(queue.Empty, EOFError, OSError):
        while len(out) < world:  # reports that arrived while we joined
            rank, ok, value, error, seconds = results.get(timeout=0.2)
            out[rank] = RankResult(rank, ok, _load(value), error, seconds=seconds)
    final = []
    for r, p in enumerate(procs):
        res = out.get(r, RankResult(r, False, error="no result (killed, hung or died)"))
        res.exitcode = p.exitcode
        final.append(res)
    return final


def _load(value: Any) -> Any:
    return pickle.loads(value) if isinstance(value, bytes) else value


def values(results: list[RankResult]) -> list[Any]:
    """The values, asserting every rank succeeded (with every rank's error in the message)."""
    bad = [r for r in results if not r.ok]
    assert not bad, "\n".join(f"rank {r.rank}: {r.error}" for r in bad)
    return [r.value for r in results]


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """What ``fn()`` ended with in a rank: the error's class and text ("" for none) and the
    seconds it took, for the test to check."""
    started = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return {"type": type(exc).__name__, "error": str(exc),
                "seconds": time.monotonic() - started}
    return {"type": "", "error": "", "seconds": time.monotonic() - started}
