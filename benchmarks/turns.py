"""arfuse's unfused paths against the user's two lines, taking turns block by block in one
process group: the torch backend and hier (two hosts of one rank each, by topology file, on
this machine), each called in place, against ``dist.all_reduce`` + ``residual.add_`` +
``F.rms_norm`` on the same group. Every row's inputs are restored before each call (timed
alike in every row); ``--rounds`` rounds of ``--calls`` calls of each row in turn, so that the
machine's drift falls on all of them; the slowest rank's median per row. Finer than
``arfuse bench`` where the baseline itself runs in two modes from run to run.

    python benchmarks/turns.py --tokens 1,8,64 --dtype fp32 [--backends torch,hier]
        [--out benchmarks/results/<machine>/turns.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from arfuse.bench.machine import machine_record
from arfuse.launch import launch

HIDDEN = 4096
EPS = 1e-6
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def body(rank: int, world: int, opts: argparse.Namespace) -> int:
    import arfuse
    from arfuse.launch import init_from_env, pin_to_core

    torch.set_num_threads(1)
    init_from_env("cpu")
    pin_to_core(rank, world)
    rows = []
    for name in opts.dtype:
        dtype = DTYPES[name]
        for tokens in opts.tokens:
            ops = {b: arfuse.FusedAllReduce(max_token_num=tokens, hidden_dim=HIDDEN, dtype=dtype,
                                            backend=b, strict=True) for b in opts.backends}
            source = torch.randn(tokens, HIDDEN).to(dtype)
            source_residual = torch.randn(tokens, HIDDEN).to(dtype)
            weight = (torch.rand(HIDDEN) + 0.5).to(dtype)
            x, residual = source.clone(), source_residual.clone()
            times: dict[str, list[float]] = {b: [] for b in ("user", *opts.backends)}
            for _ in range(opts.rounds):
                for row in times:
                    for _ in range(opts.calls):
                        x.copy_(source)
                        residual.copy_(source_residual)
                        start = time.perf_counter()
                        if row == "user":
                            dist.all_reduce(x)
                            residual.add_(x)
                            torch.nn.functional.rms_norm(residual, (HIDDEN,), weight, EPS)
                        else:
                            ops[row](x, residual=residual, weight=weight, eps=EPS, out=x,
                                     residual_out=residual)
                        times[row].append(time.perf_counter() - start)
            medians = {row: statistics.median(t) * 1e6 for row, t in times.items()}
            every: list[Any] = [None] * world
            dist.all_gather_object(every, medians)
            worst = {row: max(m[row] for m in every) for row in medians}
            rows.append({"dtype": name, "tokens": tokens, "us": worst,
                         **{f"{b}_over_user": worst[b] / worst["user"] for b in opts.backends}})
            for op in ops.values():
                op.close()
    if rank == 0:
        report(rows, opts)
    return 0


def report(rows: list[dict[str, Any]], opts: argparse.Namespace) -> None:
    print(f"{'dtype':5} {'tokens':>6} {'user us':>9} "
          + " ".join(f"{b + ' us':>9} {b + '/user':>10}" for b in opts.backends), flush=True)
    for r in rows:
        print(f"{r['dtype']:5} {r['tokens']:6d} {r['us']['user']:9.1f} "
              + " ".join(f"{r['us'][b]:9.1f} {r[b + '_over_user']:10.2f}"
                         for b in opts.backends), flush=True)
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps({
            "machine": machine_record(pinned=True, world=2), "options": vars(opts),
            "rows": rows}, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,8,64,512")
    parser.add_argument("--dtype", default="bf16,fp32")
    parser.add_argument("--backends", default="torch,hier")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--out", default="")
    opts = parser.parse_args()
    opts.tokens = [int(t) for t in opts.tokens.split(",")]
    opts.dtype = opts.dtype.split(",")
    opts.backends = opts.backends.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        env = {}
        if "hier" in opts.backends:  # two hosts of one rank each, as far as arfuse can tell
            topology = Path(tmp) / "two-hosts.json"
            topology.write_text(json.dumps({"device": "cpu", "world_size": 2,
                                            "hosts": ["a", "b"]}))
            env["ARFUSE_TOPOLOGY"] = str(topology)
        return launch(body, 2, opts, env=env, timeout_s=1800)


if __name__ == "__main__":
    sys.exit(main())
