"""Rank bodies for the negotiation tests: creation under injected faults, specs and topology
files that differ across ranks, a rank that dies while the op is made, new ops after a broken
workspace. Module level, so they can be pickled."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from harness import outcome


def negotiate_once(rank: int, world: int, backend: str | None, hidden: int = 64,
                   max_tokens: int = 16) -> dict[str, Any]:
    """Create a comm (faults come from the environment), run one call, report what happened."""
    import arfuse

    started = time.perf_counter()
    comm = arfuse.FusedAllReduce(max_token_num=max_tokens, hidden_dim=hidden,
                                 dtype=torch.float32, backend=backend)
    seconds = time.perf_counter() - started
    x = torch.full((2, hidden), float(rank + 1))
    out = comm(x).out
    ok = bool(torch.all(out == world * (world + 1) / 2))
    attempts = [a.describe() for a in comm.attempts]
    result = {"backend": comm.backend, "correct": ok, "attempts": attempts, "seconds": seconds,
              "pid": os.getpid()}
    comm.close()
    return result


def fault_sequence(rank: int, world: int, clauses: list[str]) -> list[dict[str, Any]]:
    """Negotiate once per ``ARFUSE_FAULTS`` value, in one process (non-fatal faults only)."""
    out = []
    for clause in clauses:
        os.environ["ARFUSE_FAULTS"] = clause
        try:
            out.append(negotiate_once(rank, world, None) | {"clause": clause})
        finally:
            os.environ.pop("ARFUSE_FAULTS", None)
    return out


def expect_failure(rank: int, world: int, backend: str | None = None) -> dict[str, Any]:
    """Negotiate (faults from the environment) and report the error this rank ends with."""
    started = time.monotonic()
    try:
        result = negotiate_once(rank, world, backend)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
    return {"error": "", "result": result, "seconds": time.monotonic() - started}


def mismatched_spec(rank: int, world: int) -> str:
    import arfuse

    try:
        arfuse.FusedAllReduce(max_token_num=16, hidden_dim=64 + 16 * rank, dtype=torch.float32,
                              timeout_s=10)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def create_then_report(rank: int, world: int) -> dict[str, Any]:
    import arfuse

    return outcome(lambda: arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64,
                                                dtype=torch.float32))


def topology_file_on_one_rank(rank: int, world: int, file_rank: int, path: str) -> str:
    """ARFUSE_TOPOLOGY set on rank ``file_rank`` only: what creating an op gives."""
    if rank == file_rank:
        os.environ["ARFUSE_TOPOLOGY"] = path
    else:
        os.environ.pop("ARFUSE_TOPOLOGY", None)
    import arfuse

    try:
        comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=64, dtype=torch.float32,
                                     timeout_s=10.0)
    except Exception as exc:  # the test checks the class and the text
        return f"{type(exc).__name__}: {exc}"
    comm.close()
    return f"created: {comm.plan.backend}"


def new_ops_after_a_broken_workspace(rank: int, world: int, backend: str) -> dict[str, Any]:
    """Both ranks make an op; rank 1 is late for its call, so rank 0 times out (rank 1's call
    may still succeed: the ranks fail apart). Then what WorkspaceBroken advises: every rank
    closes its ops, and new ones with the same settings must work."""
    import torch.distributed as dist

    import arfuse

    def make() -> Any:
        return arfuse.FusedAllReduce(max_token_num=4, hidden_dim=64, dtype=torch.float32,
                                     backend=backend, strict=True, timeout_s=1.0)

    first = make()
    x = torch.full((2, 64), float(rank + 1))
    if rank == 1:
        time.sleep(1.5)
    report: dict[str, Any] = {}
    for key in ("first", "first_again"):
        try:
            first(x)
            report[key] = "ran"
        except Exception as exc:  # the test checks the class and the text
            report[key] = f"{type(exc).__name__}: {exc}"
        if rank == 1:
            break
    dist.barrier()
    first.close()
    second = make()
    report["second"] = second(x).out[0, 0].item()
    second.close()
    return report
