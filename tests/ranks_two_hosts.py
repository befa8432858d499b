"""The rank body of test_two_hosts.py: one rank of a job that spans two hosts, run by torchrun
as a script (``python ranks_two_hosts.py two_hosts OUT_DIR``), kept apart from the test so
that it can be started by path."""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

from arfuse.scenarios import LeakBaseline, check_result, make_inputs, run_pattern

PATTERNS = ("plain", "norm", "norm_residual", "fp8", "in_place")


def _calls(comm: Any, ranks: list[int], rank: int, seed: int) -> dict[str, Any]:
    """A few calls of every pattern, each against the float64 reference of ``ranks``; then
    the op is closed."""
    worst, calls = 0.0, 0
    stats: dict[str, int] = {}
    for k, tokens in enumerate((1, 7, 64, 65)):
        for pattern in PATTERNS:
            xs, residual, weight = make_inputs(seed + k, tokens, 64, "fp32", ranks)
            result = run_pattern(comm, pattern, xs[ranks.index(rank)], residual, weight)
            worst = max(worst, check_result(pattern, "fp32", xs, residual, weight, result))
            calls += 1
    stats = comm.stats()
    comm.close()  # the next case negotiates afresh (the registry would reuse this one)
    return {"calls": calls, "max_ratio": worst, "stats": stats}


def _describe(comm: Any) -> dict[str, Any]:
    plan = comm.plan
    return {"backend": comm.backend, "plan_backend": plan.backend, "node_count": plan.node_count,
            "world_size": plan.world_size, "viable": list(plan.viable),
            "reasons": {c.backend: c.reason for c in plan.candidates},
            "attempts": [a.describe() for a in comm.attempts]}


def _attempt(make: Any) -> dict[str, Any]:
    started = time.monotonic()
    try:
        comm = make()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
    found = _describe(comm)
    found["seconds"] = time.monotonic() - started
    return {**found, "comm": comm}


def two_hosts(out_dir: str) -> None:
    """One rank of the two-host job (under torchrun): what the group looks like, shm not
    offered, shm forced, shm on a topology that lies, torch numerics, subgroups per host."""
    import torch.distributed as dist

    import arfuse

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    marker = Path("/dev/shm") / f"two-hosts-marker-rank{rank}"
    marker.write_text(socket.gethostname())
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else []
    # hier's gloo subgroups live as long as the process (DESIGN 4, hier): made here, by a
    # first op, so that they are part of the baseline like the subgroups above
    arfuse.FusedAllReduce(max_token_num=1, hidden_dim=64, dtype=torch.float32).close()
    dist.barrier()  # every connection, subgroups included, exists before the baseline
    report: dict[str, Any] = {"rank": rank, "world": world, "hostname": socket.gethostname(),
                              "dev_shm": sorted(os.listdir("/dev/shm"))}
    baseline = LeakBaseline()
    spec = {"max_token_num": 128, "hidden_dim": 64, "dtype": torch.float32}

    auto = _attempt(lambda: arfuse.FusedAllReduce(**spec))
    if "comm" in auto:
        auto.update(_calls(auto.pop("comm"), list(range(world)), rank, 10))
    report["auto"] = auto

    forced = _attempt(lambda: arfuse.FusedAllReduce(**spec, backend="shm"))
    if "comm" in forced:
        forced.update(_calls(forced.pop("comm"), list(range(world)), rank, 20))
    report["forced_shm"] = forced

    if world == 2:  # a topology file claiming one host: only the shm attempt can tell
        lie = Path(out_dir) / f"one-host-rank{rank}.json"
        lie.write_text(json.dumps({"device": "cpu", "world_size": 2, "hosts": ["h", "h"]}))
        os.environ["ARFUSE_TOPOLOGY"] = str(lie)
        lying = _attempt(lambda: arfuse.FusedAllReduce(**spec, backend="shm"))
        if "comm" in lying:
            lying.update(_calls(lying.pop("comm"), list(range(world)), rank, 30))
        report["forced_shm_one_host_topology"] = lying
        del os.environ["ARFUSE_TOPOLOGY"]

    if world == 4:  # node-local TP groups {0,1} on one host, {2,3} on the other (R6)
        mine, ranks = (groups[0], [0, 1]) if rank < 2 else (groups[1], [2, 3])
        local = _attempt(lambda: arfuse.FusedAllReduce(mine, **spec))
        if "comm" in local:
            local.update(_calls(local.pop("comm"), ranks, rank, 40))
        report["node_local_group"] = local

    arfuse.destroy_all()
    report["leaks"] = baseline.leaks()
    report["segments_left"] = [n for n in os.listdir("/dev/shm") if n.startswith("arfuse-")]
    marker.unlink()
    dist.barrier()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report, default=str))
    dist.destroy_process_group()


def link_down(out_dir: str) -> None:
    """One rank of a hier job (2 hosts x 2 ranks) whose link between the hosts the test takes
    down mid-run: 12 good calls, a file saying so, then calls until one fails; what it raised
    and how long that call took go to ``rank<r>.json``, and the process ends at once (its
    process group cannot be torn down without the link)."""
    import torch.distributed as dist

    import arfuse

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 timeout_s=6)
    x = torch.full((4, 64), float(rank + 1))
    for _ in range(12):
        comm(x)
    (Path(out_dir) / f"ready-rank{rank}").write_text(comm.backend)
    found: dict[str, Any] = {"rank": rank, "backend": comm.backend, "type": ""}
    for calls in range(100_000):
        started = time.monotonic()
        try:
            comm(x)
        except Exception as exc:
            found.update(type=type(exc).__name__, error=str(exc)[:600],
                         seconds=time.monotonic() - started, calls=calls)
            break
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(found))
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "two_hosts":
        two_hosts(sys.argv[2])
    elif sys.argv[1] == "link_down":
        link_down(sys.argv[2])
    else:
        raise SystemExit(f"unknown body {sys.argv[1]!r}")
