"""Negotiation cost: from an existing process group to a ready workspace.

Measures, on real ranks, median of repeats:

* cold: the first ``FusedAllReduce`` of a process (includes loading the compiled kernel);
* warm: later ones (what every further group or replacement costs);
* the unfused ``torch`` backend alone, and ``auto`` when shm fails at creation on one or on
  every rank (``ARFUSE_FAULTS``): the difference is what a failed first candidate adds.

    python benchmarks/negotiation.py [--world-size 2] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from arfuse.launch import init_from_env, launch, pin_to_core

SPEC = {"max_token_num": 2048, "hidden_dim": 4096, "dtype": torch.bfloat16}


def _time_create(backend: str | None, faults: str | None) -> tuple[float, str]:
    import torch.distributed as dist

    import arfuse

    if faults:
        os.environ["ARFUSE_FAULTS"] = faults
    try:
        dist.barrier()
        t0 = time.perf_counter()
        comm = arfuse.FusedAllReduce(backend=backend, **SPEC)  # type: ignore[arg-type]
        seconds = time.perf_counter() - t0
    finally:
        os.environ.pop("ARFUSE_FAULTS", None)
    chosen = comm.backend
    comm.close()
    return seconds, chosen


def body(rank: int, world: int, repeats: int) -> int:
    torch.set_num_threads(1)
    init_from_env("cpu")
    pin_to_core(rank, world)
    cold, cold_backend = _time_create(None, None)
    cases = {"warm shm": (None, None), "torch only": ("torch", None),
             "auto, shm fails on rank 1": (None, "shm.create@1=raise"),
             "auto, shm fails on every rank": (None, "shm.create@*=raise")}
    results: dict[str, list[float]] = {name: [] for name in cases}
    chosen: dict[str, str] = {}
    for _ in range(repeats):
        for name, (backend, faults) in cases.items():
            seconds, chosen[name] = _time_create(backend, faults)
            results[name].append(seconds)
    if rank == 0:
        med = {name: statistics.median(v) * 1e3 for name, v in results.items()}
        print(f"negotiation, {world} ranks, spec {SPEC['max_token_num']} x {SPEC['hidden_dim']}"
              f" bf16, median of {repeats}:")
        print(f"  cold (first in process, kernel load included): {cold * 1e3:7.1f} ms "
              f"-> {cold_backend}")
        for name, ms in med.items():
            print(f"  {name:<32} {ms:7.1f} ms -> {chosen[name]}")
        for name in ("auto, shm fails on rank 1", "auto, shm fails on every rank"):
            print(f"  a failed first candidate adds ({name.split(', ')[1]}): "
                  f"{med[name] - med['torch only']:.1f} ms over torch alone")
        out = Path("benchmarks/results/negotiation.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"world_size": world, "cold_ms": cold * 1e3,
                                   "median_ms": med, "backends": chosen,
                                   "repeats": repeats, "cores": os.cpu_count()}, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    return launch(body, args.world_size, args.repeats, env={"ARFUSE_LOG": "warning"})


if __name__ == "__main__":
    raise SystemExit(main())
