"""Two ranks that share one core, and two ranks with a core each: how the shm op waits.

Ranks pinned to one core cannot both run: a rank that spins waiting for its peer only delays
the peer. The kernel sleeps on the flag (futex) at once when the peer last ran on its CPU, and
spins first when the peer has a CPU of its own. Two loops, each placement:

* ``1-token loop``: 1-token bf16 calls in place (``out=x, residual_out=residual``), back to back;
  median microseconds per call;
* ``decode-like loop``: per step some work (a matmul of about ``--work-us``, as a layer's would
  be), then the 1-token all-reduce + residual + RMSNorm; median microseconds per step, arfuse
  against gloo's ``all_reduce`` + add + RMSNorm in eager torch doing the same.

Placements: ``shared`` pins both ranks (every thread, gloo's included) to core 0, as
``taskset -c 0`` would; ``own`` pins rank r to core r. Writes
``benchmarks/results/oversubscribed-<label>.json``.

    python benchmarks/oversubscribed.py --label after
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 4096
EPS = 1e-6


def _rmsnorm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    """gloo's side: residual += x; x = RMSNorm(residual) * weight (in place, eager torch)."""
    residual.add_(x)
    r = residual.float()
    x.copy_(r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS) * weight.float())


def _work(a: torch.Tensor, b: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        torch.mm(a, b)


def _loop_calls(comm: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        comm(x, residual=residual, weight=weight, eps=EPS, out=x, residual_out=residual)
        times.append((time.perf_counter_ns() - start) / 1e3)
    return times


def _loop_decode(step: Any, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        step()
        times.append((time.perf_counter_ns() - start) / 1e3)
    return times


def _rank(rank: int, world: int, port: int, placement: str, opts: dict[str, Any],
          results: Any) -> None:
    os.environ.setdefault("ARFUSE_LOG", "warning")
    if placement == "shared":  # the whole process, as taskset -c 0 (gloo's threads too)
        os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    if placement == "own":  # after the group exists: gloo's threads stay free
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    import arfuse
    from arfuse.backends.shm import build as shm_build

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=HIDDEN, dtype=torch.bfloat16,
                                 backend="shm", strict=True, timeout_s=60)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16)
    residual = torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16)
    weight = (torch.rand(HIDDEN, generator=gen) + 0.5).to(torch.bfloat16)
    a = torch.randn(1, HIDDEN, generator=gen)
    b = torch.randn(HIDDEN, opts["work_cols"], generator=gen)

    _loop_calls(comm, x, residual, weight, 200)  # warm up
    dist.barrier()
    calls = _loop_calls(comm, x, residual, weight, opts["calls"])

    def fused_step() -> None:
        _work(a, b, 1)
        comm(x, residual=residual, weight=weight, eps=EPS, out=x, residual_out=residual)

    def gloo_step() -> None:
        _work(a, b, 1)
        dist.all_reduce(x)
        _rmsnorm_add(x, residual, weight)

    work_only = _loop_decode(lambda: _work(a, b, 1), 50)
    decode: dict[str, list[float]] = {"arfuse": [], "gloo": []}
    for _ in range(opts["rounds"]):  # alternate, so that drift hits both alike
        for name, step in (("arfuse", fused_step), ("gloo", gloo_step)):
            dist.barrier()
            step()
            decode[name].extend(_loop_decode(step, opts["steps"]))
    report = {"rank": rank, "isa": getattr(shm_build.load(), "isa", "pure-torch"),
              "path": comm.workspace.path,  # type: ignore[attr-defined]
              "call_us": statistics.median(calls),
              "call_p90_us": sorted(calls)[int(0.9 * len(calls))],
              "work_us": statistics.median(work_only),
              "decode_arfuse_us": statistics.median(decode["arfuse"]),
              "decode_gloo_us": statistics.median(decode["gloo"])}
    comm.close()
    results.put(report)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(placement: str, opts: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, placement, opts, results))
             for r in range(2)]
    for p in procs:
        p.start()
    reports = sorted((results.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(60)
    worst = {key: max(r[key] for r in reports) for key in
             ("call_us", "call_p90_us", "work_us", "decode_arfuse_us", "decode_gloo_us")}
    worst["gloo_over_arfuse"] = worst["decode_gloo_us"] / worst["decode_arfuse_us"]
    return {"placement": placement, "isa": reports[0]["isa"], "path": reports[0]["path"],
            "ranks": reports, **worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="now", help="results file suffix")
    parser.add_argument("--placements", default="shared,own")
    parser.add_argument("--calls", type=int, default=3000, help="1-token loop calls")
    parser.add_argument("--steps", type=int, default=100, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--work-cols", type=int, default=512,
                        help="columns of the [1, 4096] x [4096, N] fp32 matmul of a step")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    opts = {"calls": args.calls, "steps": args.steps, "rounds": args.rounds,
            "work_cols": args.work_cols}
    rows = []
    print(f"{'placement':>9} {'isa':>12} {'1-token call':>13} {'p90':>7} {'work':>7} "
          f"{'decode arfuse':>14} {'decode gloo':>12} {'gloo/arfuse':>12}   (us, median)")
    for placement in args.placements.split(","):
        row = run(placement, opts)
        rows.append(row)
        print(f"{placement:>9} {row['isa']:>12} {row['call_us']:>13.1f} "
              f"{row['call_p90_us']:>7.1f} {row['work_us']:>7.1f} "
              f"{row['decode_arfuse_us']:>14.1f} {row['decode_gloo_us']:>12.1f} "
              f"{row['gloo_over_arfuse']:>11.2f}x")
    out = Path(args.out or f"benchmarks/results/oversubscribed-{args.label}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "label": args.label, "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": _cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
        "options": opts, "hidden": HIDDEN, "dtype": "bf16", "tokens": 1,
        "note": "times are the slower rank's median; decode steps alternate arfuse/gloo rounds",
        "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
