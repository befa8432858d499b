"""Per-token-group FP8 (``quant="fp8_group"``) fused into the all-reduce, against what users run
without it: two ranks, bf16, hidden 7168 (DeepSeek-V3) and 4096, side by side in one run (rows
interleaved in rounds, ``arfuse.bench.timing``), medians and their ratios:

    (a) fused          arfuse's all-reduce + residual + RMSNorm, no quantisation
    (b) fused+group    the same call with quant="fp8_group" (group 128, fp32 scales)
    (c) fused, eager   (a), then the quantisation in eager torch as DeepSeek's act_quant
                       writes it (what a user writes today)
    (d) deepspeed      DeepSpeed's inference_all_reduce + eager add + RMSNorm + that
                       quantisation (needs DeepSpeed: ``EXTRAS=bench ./scripts/setup.sh``)

Targets: b/a <= 1.15, c/b >= 2, d/b >= 4. Before timing, every size checks that (b) and (c)
give the same bytes. The machine, the kernel's ISA and the options go into the JSON.

    python benchmarks/group_fp8.py --out benchmarks/results/group-fp8.json
    python benchmarks/group_fp8.py --tokens 1,8 --hidden 4096 --min-seconds 0.02   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from arfuse.bench.baselines import (
    act_quant,
    clean_deepspeed_segments,
    deepspeed_setup,
    prebuild_deepspeed,
    rmsnorm_add,
)
from arfuse.bench.machine import machine_record
from arfuse.bench.options import EPS, BenchOptions
from arfuse.bench.timing import Row, measure
from arfuse.launch import launch

TOKENS = (1, 8, 64, 512, 2048)
HIDDEN = (7168, 4096)
GROUP = 128
ROWS = {"a": "fused", "b": "fused+fp8_group", "c": "fused, eager act_quant",
        "d": "deepspeed+norm+act_quant"}
TARGETS = {"b/a": ("<=", 1.15), "c/b": (">=", 2.0), "d/b": (">=", 4.0)}


def _rows(comm: Any, ds: Any, x: torch.Tensor, work: torch.Tensor, residual: torch.Tensor,
          weight: torch.Tensor) -> dict[str, Row]:
    def reset(work: torch.Tensor = work, x: torch.Tensor = x) -> None:
        work.copy_(x)  # DeepSpeed reduces in place

    def eager(c: Any = comm, x: torch.Tensor = work) -> Any:
        return act_quant(c(x, residual=residual, weight=weight, eps=EPS).out)

    def deepspeed(x: torch.Tensor = work) -> Any:
        ds.inference_all_reduce(x)
        return act_quant(rmsnorm_add(x, residual, weight))

    rows: dict[str, Row] = {
        "a": (lambda c=comm, x=work: c(x, residual=residual, weight=weight, eps=EPS), reset),
        "b": (lambda c=comm, x=work: c(x, residual=residual, weight=weight, eps=EPS,
                                       quant="fp8_group", group_size=GROUP), reset),
        "c": (eager, reset)}
    if ds is not None:
        rows["d"] = (deepspeed, reset)
    return rows


def _same_bytes(comm: Any, x: torch.Tensor, residual: torch.Tensor,
                weight: torch.Tensor) -> bool:
    fused = comm(x, residual=residual, weight=weight, eps=EPS, quant="fp8_group",
                 group_size=GROUP)
    codes, scales = act_quant(comm(x, residual=residual, weight=weight, eps=EPS).out)
    return bool(torch.equal(fused.quant_out.view(torch.uint8), codes.view(torch.uint8))
                and torch.equal(fused.scale_out.view(torch.int32), scales.view(torch.int32)))


def body(rank: int, world: int, opts: dict[str, Any]) -> int:
    import torch.distributed as dist

    import arfuse
    from arfuse.launch import init_from_env, pin_to_core

    torch.set_num_threads(1)
    ds, ds_note = deepspeed_setup(rank) if opts["deepspeed"] else (None, opts["why_no_ds"])
    init_from_env("cpu")
    pinned = pin_to_core(rank, world)
    bench = BenchOptions(world_size=world, tokens=tuple(opts["tokens"]), hidden=0,
                         dtypes=("bf16",), backends=(), out="", min_seconds=opts["min_seconds"])
    generator = torch.Generator().manual_seed(1234 + rank)
    same = torch.Generator().manual_seed(4321)  # the residual and weight: as in TP
    results: list[dict[str, Any]] = []
    for hidden in opts["hidden"]:
        comm = arfuse.FusedAllReduce(max_token_num=max(opts["tokens"]), hidden_dim=hidden,
                                     dtype=torch.bfloat16, backend="shm", strict=True)
        weight = (torch.rand(hidden, generator=same) + 0.5).bfloat16()
        for tokens in opts["tokens"]:
            x = torch.randn(tokens, hidden, generator=generator).bfloat16()
            residual = torch.randn(tokens, hidden, generator=same).bfloat16()
            work = x.clone()
            same_bytes = _same_bytes(comm, x, residual, weight)
            times, _ = measure(_rows(comm, ds, x, work, residual, weight), bench,
                               5 + getattr(comm.workspace, "copy_trial_calls", 0))
            medians = {row: statistics.median(t) for row, t in times.items()}
            results.append({"hidden": hidden, "tokens": tokens, "same_bytes": same_bytes,
                            "median_us": medians, "iters": {r: len(t) for r, t in times.items()},
                            "ratios": _ratios(medians)})
        comm.close()
    dist.barrier()
    if ds is not None and rank == 0:
        clean_deepspeed_segments()
    if rank != 0:
        return 0
    report = {"machine": machine_record(pinned, world), "options": opts, "deepspeed": ds_note,
              "group_size": GROUP, "rows": ROWS, "targets": TARGETS, "results": results}
    print(_table(report))
    path = Path(opts["out"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0 if all(r["same_bytes"] for r in results) else 1


def _ratios(medians: dict[str, float]) -> dict[str, float | None]:
    found: dict[str, float | None] = {}
    for name in TARGETS:
        top, bottom = name.split("/")
        found[name] = medians[top] / medians[bottom] if top in medians else None
    return found


def _table(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [f"{machine['cpu']}, {machine['cores']} cores, ISA {machine['isa']}, kernel "
             f"{machine['kernel_isa']}, torch {machine['torch']}, {machine['date']}; "
             f"{report['deepspeed']}",
             "median us per call: " + "; ".join(f"({k}) {v}" for k, v in ROWS.items()),
             "targets: " + ", ".join(f"{k} {op} {v}" for k, (op, v) in TARGETS.items()),
             f"{'hidden':>6} {'tokens':>6} " + " ".join(f"{'(' + k + ')':>9}" for k in ROWS)
             + " " + " ".join(f"{k:>6}" for k in TARGETS) + "  same bytes"]
    for r in report["results"]:
        cells = " ".join(f"{r['median_us'][k]:9.1f}" if k in r["median_us"] else f"{'-':>9}"
                         for k in ROWS)
        ratios = " ".join(f"{v:6.2f}" if v is not None else f"{'-':>6}"
                          for v in r["ratios"].values())
        lines.append(f"{r['hidden']:>6} {r['tokens']:>6} {cells} {ratios}  {r['same_bytes']}")
    lines.append("verdicts (over sizes): " + "; ".join(_verdict(report, k) for k in TARGETS))
    return "\n".join(lines)


def _verdict(report: dict[str, Any], name: str) -> str:
    op, target = TARGETS[name]
    values = [r["ratios"][name] for r in report["results"] if r["ratios"][name] is not None]
    if not values:
        return f"{name}: not measured"
    met = [v <= target if op == "<=" else v >= target for v in values]
    worst = max(values) if op == "<=" else min(values)
    return f"{name} {op} {target}: {sum(met)}/{len(met)} sizes met (worst {worst:.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--hidden", default=",".join(map(str, HIDDEN)))
    parser.add_argument("--min-seconds", type=float, default=0.3,
                        help="about this long per row and size (0.3)")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave row (d) out")
    parser.add_argument("--out", default="benchmarks/results/group-fp8.json")
    args = parser.parse_args()
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
        hidden = [int(h) for h in args.hidden.split(",")]
    except ValueError:
        parser.error("--tokens and --hidden take comma-separated integers")
    if not tokens or min(tokens) < 1 or not hidden or any(h % GROUP for h in hidden):
        parser.error(f"--tokens must be >= 1 and --hidden multiples of {GROUP}")
    if args.min_seconds <= 0:
        parser.error("--min-seconds must be > 0")
    deepspeed, why = not args.no_deepspeed, "row (d) not requested"
    if deepspeed:
        why = prebuild_deepspeed()
        if why:
            why = f"row (d) not measured: DeepSpeed unavailable ({why})"
            print(why, file=sys.stderr)
            deepspeed = False
    opts = {"tokens": tokens, "hidden": hidden, "min_seconds": args.min_seconds,
            "deepspeed": deepspeed, "why_no_ds": why, "out": args.out}
    return launch(body, 2, opts, env={"OMP_NUM_THREADS": "1", "ARFUSE_LOG": "warning",
                                      **({"DS_ACCELERATOR": "cpu"} if deepspeed else {})})


if __name__ == "__main__":
    os.environ.setdefault("ARFUSE_LOG", "warning")
    sys.exit(main())
