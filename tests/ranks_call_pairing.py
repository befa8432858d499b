"""Rank bodies for calls that must pair across ranks: calls that differ (MismatchedCall on
every rank), calls from two threads of one rank, a peer that is late, hung or never calls.
Module level, so they can be pickled."""

from __future__ import annotations

import time
from typing import Any

import torch

from harness import outcome


def mismatched_calls(rank: int, world: int, mode: str | None,
                     cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case on a fresh op: rank r calls with ``case["ranks"][min(r, len - 1)]`` as
    (tokens, pattern, quant); reports how that call and the call after it end on this rank."""
    import arfuse

    hidden = 4096  # 16 KiB fp32 rows: 4-row blocks, so 16 and 40 tokens differ in blocks
    report = []
    for case in cases:
        tokens, pattern, quant = case["ranks"][min(rank, len(case["ranks"]) - 1)]
        comm = arfuse.FusedAllReduce(max_token_num=64, hidden_dim=hidden, dtype=torch.float32,
                                     backend="shm", strict=True, timeout_s=5,
                                     quant=case.get("spec_quant"))
        if mode is not None and comm.workspace.path == "c++":  # type: ignore[attr-defined]
            comm.workspace.set_mode(mode)  # type: ignore[attr-defined]
        x = torch.full((tokens, hidden), float(rank + 1))
        if case.get("in_slot"):
            slot = comm.input_buffer(tokens)
            slot.copy_(x)
            x = slot
        kwargs: dict[str, Any] = {}
        if pattern != "plain":
            kwargs["weight"] = torch.ones(hidden)
        if pattern == "residual":
            kwargs["residual"] = torch.ones(tokens, hidden)
        if quant is not None:
            kwargs.update(quant=quant, scale=0.5)
        entry: dict[str, Any] = {"path": comm.workspace.path}  # type: ignore[attr-defined]
        started = time.monotonic()
        try:
            comm(x, **kwargs)
            entry["error"] = ""
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["seconds"] = time.monotonic() - started
        try:
            after = comm(torch.ones(2, hidden)).out
            entry["after"] = "ok" if bool(torch.all(after == world)) else f"wrong: {after}"
        except Exception as exc:
            entry["after"] = f"{type(exc).__name__}: {exc}"
        comm.close()
        report.append(entry)
    return report


def mismatched_tokens(rank: int, world: int, tokens: list[int], backend: str,
                      residual_on: list[bool]) -> dict[str, Any]:
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=64, hidden_dim=32, dtype=torch.float32,
                                 backend=backend, timeout_s=5)
    x = torch.full((tokens[rank], 32), float(rank + 1))
    kwargs: dict[str, Any] = {}
    if residual_on[rank]:
        kwargs = {"residual": torch.zeros_like(x), "weight": torch.ones(32)}
    return outcome(lambda: comm(x, **kwargs))


def announce_across_capacity(rank: int, world: int) -> dict[str, Any]:
    """A call over capacity runs unfused; ``ShmWorkspace.announce`` makes it meet the shm group
    first. Every rank announcing the same call goes on; rank 0 calling within capacity while
    the others announce a call over it raises MismatchedCall everywhere (R11)."""
    import arfuse
    from arfuse.call_checks import CallArgs

    hidden = 64
    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=hidden, dtype=torch.float32,
                                 backend="shm", strict=True, timeout_s=5)
    workspace: Any = comm.workspace
    report: dict[str, Any] = {"path": workspace.path}
    workspace.announce(CallArgs(torch.ones(20, hidden)))  # the same on every rank
    report["after_same"] = bool(torch.all(comm(torch.ones(3, hidden)).out == world))
    started = time.monotonic()
    try:
        if rank == 0:
            comm(torch.ones(4, hidden))
        else:
            workspace.announce(CallArgs(torch.ones(20, hidden)))
        report["error"] = ""
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] = time.monotonic() - started
    comm.close()
    return report


def calls_from_two_threads(rank: int, world: int, tokens: int, calls: int) -> dict[str, Any]:
    """Rank 0 calls one FusedAllReduce from two threads at once (inputs all 1 in one thread,
    all 100 in the other), the other ranks from one thread (2, then 200). Each call must pair
    whole calls across ranks: every output uniform, its value one of the possible sums."""
    import threading

    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=64, hidden_dim=1024, dtype=torch.float32,
                                 backend="shm", strict=True, timeout_s=20.0)
    weight = torch.ones(1024)
    seen: dict[str, list[list[float]]] = {"A": [], "B": []}
    errors: list[str] = []

    def run(tag: str, value: float) -> None:
        try:
            x = torch.full((tokens, 1024), value)
            residual = torch.zeros(tokens, 1024)
            for _ in range(calls):
                got = comm(x, residual=residual, weight=weight, eps=1e-6).residual_out
                seen[tag].append(sorted(set(got.flatten().tolist())))
        except Exception as exc:
            errors.append(f"{tag}: {type(exc).__name__}: {exc}")

    if rank == 0:
        threads = [threading.Thread(target=run, args=("A", 1.0)),
                   threading.Thread(target=run, args=("B", 100.0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        run("A", 2.0)
        run("B", 200.0)
    return {"seen": seen, "errors": errors, "path": comm.workspace.path}  # type: ignore[attr-defined]


def call_then_report(rank: int, world: int, mode: str | None = None) -> dict[str, Any]:
    """Two calls on shm (faults from the environment); report how each rank's second call ends."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32)
    if mode is not None:
        comm.workspace.set_mode(mode)  # type: ignore[attr-defined]
    started = time.monotonic()
    try:
        comm(torch.ones(2, 64))
        comm(torch.ones(2, 64))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started,
                "backend": comm.backend}
    return {"error": "", "seconds": time.monotonic() - started, "backend": comm.backend}


def torch_peer_killed_mid_call(rank: int, world: int, timeout_s: float,
                               victim: int) -> dict[str, Any]:
    """Every rank but ``victim`` makes a second call on the torch backend; ``victim`` is
    SIGKILLed while they wait in it (it never reports; rank 0 also hosts the store)."""
    import os
    import signal

    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 backend="torch", timeout_s=timeout_s)
    comm(torch.ones(2, 64))
    if rank == victim:
        time.sleep(1.0)  # the others are in their second call by now
        os.kill(os.getpid(), signal.SIGKILL)
    first = outcome(lambda: comm(torch.ones(2, 64)))
    second = outcome(lambda: comm(torch.ones(2, 64)))
    return {**first, "second": second}


def torch_peer_never_calls(rank: int, world: int, timeout_s: float) -> dict[str, Any]:
    """Rank 0 calls the torch backend; rank 1 never does (it only waits, alive)."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 backend="torch", timeout_s=timeout_s)
    if rank != 0:
        time.sleep(timeout_s + 3)
        return {"type": "", "error": "", "seconds": 0.0}
    first = outcome(lambda: comm(torch.ones(2, 64)))
    second = outcome(lambda: comm(torch.ones(2, 64)))
    return {**first, "second": second}


def torch_peer_late(rank: int, world: int, late_s: float) -> dict[str, Any]:
    """Rank 1 joins a torch-backend call ``late_s`` after rank 0 (well within the timeout):
    what each call gave."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 backend="torch", timeout_s=30)
    if rank == 1:
        time.sleep(late_s)
    value: list[float] = []
    got = outcome(lambda: value.append(float(comm(torch.full((2, 64),
                                                           float(rank + 1))).out[0, 0])))
    comm.close()
    return {**got, "value": value[0] if value else None}


def one_rank_refuses_a_plain_call(rank: int, world: int, backend: str,
                                  case: str) -> list[dict[str, Any]]:
    """Rank 1 passes an argument its own checks refuse (``dtype``: x in float64; ``eps``: a
    negative eps; ``out``: an ``out=`` of the wrong shape), the other ranks a good call; then
    every rank makes a good call on the same op, which must still work."""
    import arfuse

    hidden = 64
    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=hidden, dtype=torch.float32,
                                 backend=backend, strict=backend != "torch", timeout_s=10)
    x = torch.full((4, hidden), float(rank + 1))
    residual, weight = torch.ones(4, hidden), torch.ones(hidden)
    kwargs: dict[str, Any] = {"residual": residual, "weight": weight}
    if rank == 1 and case == "dtype":
        x = x.double()
    if rank == 1 and case == "eps":
        kwargs["eps"] = -1.0
    if rank == 1 and case == "out":
        kwargs["out"] = torch.empty(3, hidden)
    first = outcome(lambda: comm(x, **kwargs))
    good = torch.full((4, hidden), float(rank + 1))
    after = outcome(lambda: comm(good, residual=residual, weight=weight))
    comm.close()
    return [first, after]
