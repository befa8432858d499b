"""``arfuse bench``: latency sweep of the fused op against what users run without arfuse.

This verb parses its flags, checks once what every rank would fail on, starts the ranks
(``arfuse.launch``) and prints the report; what is measured and how is ``arfuse.bench``,
imported by the ranks (a bad flag is refused before torch is imported).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..bench.options import BENCH_TOKENS, BENCH_TOKENS_MOE, ROWS, BenchOptions, memory_needs
from ..moe_workload import MOE_PATTERNS, check_moe_sizes
from ..pattern import QUANT_OUTPUTS, quant_output
from . import args as cli_args

DEFAULT_OUT = "out/bench"
"""Under ``out/``, which git ignores: a run from a checkout leaves nothing to commit by mistake,
and never writes over the recorded figures in benchmarks/results/."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="latency sweep: shm vs torch (gloo) vs deepspeed")
    p.add_argument("--world-size", type=cli_args.world_size, default=None,
                   help="ranks to start (2; under torchrun: the ranks it started)")
    p.add_argument("--tokens", type=cli_args.int_list, default=None,
                   help="token counts (1,2,4,...,4096; a MoE pattern: 1,2,4,...,512)")
    p.add_argument("--hidden", type=cli_args.call_size, default=4096,
                   help="hidden size (4096)")
    p.add_argument("--dtype", type=cli_args.dtype_list, default=("bf16", "fp32"),
                   help="dtypes (bf16,fp32)")
    p.add_argument("--backends", default=",".join(ROWS),
                   help="rows to measure (shm,torch,deepspeed,arfuse-torch,shm-over; torch: "
                   "the user's two lines, dist.all_reduce + residual.add_ + F.rms_norm, the "
                   "baseline; arfuse-torch: arfuse's torch backend; shm-over: a shm call over "
                   "its capacity)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for bench.json/.txt/.png ({DEFAULT_OUT})")
    p.add_argument("--min-seconds", type=cli_args.positive_seconds, default=0.3,
                   help="measure each row for about this long (0.3)")
    p.add_argument("--pattern", choices=("residual_rmsnorm", *MOE_PATTERNS),
                   default="residual_rmsnorm",
                   help="the call timed: all-reduce + residual + RMSNorm (default), or a MoE "
                   "expert step fused before it, against torch's expert step before each row")
    p.add_argument("--threads", type=cli_args.positive_int, default=1,
                   help="intra-op threads per rank, each rank pinned to this many cores (1)")
    cli_args.add_moe_flags(p)
    p.add_argument("--quant", type=cli_args.quant, default=None,
                   help="the quantised output every row makes, one that makes its own scales: "
                   + ", ".join(dict.fromkeys(str(o.quant) for o in QUANT_OUTPUTS
                                             if o.quant and o.scale_in == "none"))
                   + " (none; the unfused rows quantise after their RMSNorm)")
    cli_args.add_quant_format_flags(p)
    p.set_defaults(func=run)


def _backends(text: str) -> tuple[str, ...]:
    """``--backends``: some of ROWS, comma-separated."""
    backends = tuple(b.strip() for b in text.split(",") if b.strip())
    unknown = set(backends) - set(ROWS)
    if unknown or not backends:
        raise ValueError(f"--backends: {'unknown ' + str(sorted(unknown)) if unknown else 'none'}"
                         f"; use some of {', '.join(ROWS)}")
    return backends


def bench_rank(rank: int, world: int, opts: BenchOptions) -> int:
    """One rank: the run (``arfuse.bench.body``); rank 0 writes and prints the report."""
    from ..bench.body import bench_body
    from ..bench.report import write_plot, write_table

    report = bench_body(rank, world, opts)
    if report is not None:
        out = Path(opts.out)
        print(write_table(report, out), flush=True)
        print(f"\n{write_plot(report, out)}")
    return 0


def run(args: argparse.Namespace) -> int:
    from ..launch import check_memory, job_ranks, launch
    from ..spec import Spec
    from .explain import check_job

    backends = _backends(args.backends)
    moe = args.pattern != "residual_rmsnorm"
    if moe:
        check_moe_sizes(args.pattern, args.top_k, args.experts)
    if args.quant is not None and (moe or quant_output(args.quant).scale_in != "none"):
        free = ", ".join(dict.fromkeys(str(o.quant) for o in QUANT_OUTPUTS
                                       if o.quant and o.scale_in == "none"))
        raise ValueError(f"--quant {args.quant}: bench times the quants that make their own "
                         f"scales ({free}) after residual_rmsnorm only")
    cli_args.check_quant_format(args.quant, args.group_size, args.scale_format, args.hidden)
    tokens = args.tokens or (BENCH_TOKENS_MOE if moe else BENCH_TOKENS)
    ranks = job_ranks(args.world_size)
    if ranks.world < 2:
        raise ValueError("--world-size must be >= 2 for a benchmark of a collective")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out} is a file; give a folder for bench.json/.txt/.png")
    # what every rank would fail on, once here (one line, exit 2); the shm rows ask for shm
    # and nothing else, as the ranks do
    shm = "shm" in backends
    for dtype in args.dtype:
        check_job("shm" if shm else None, True if shm else None, ranks, "cpu",
                  Spec(max_tokens=max(tokens), hidden=args.hidden, dtype=dtype,
                       quant=args.quant))
    check_memory(memory_needs(max(tokens), args.hidden, tuple(args.dtype), args.pattern,
                              args.top_k, args.experts), ranks)
    opts = BenchOptions(world_size=ranks.world, tokens=tuple(tokens),
                        hidden=args.hidden, dtypes=tuple(args.dtype), backends=backends,
                        out=args.out, min_seconds=args.min_seconds, pattern=args.pattern,
                        top_k=args.top_k, experts=args.experts,
                        threads=args.threads, quant=args.quant,
                        group_size=args.group_size, scale_format=args.scale_format)
    if "deepspeed" in backends and not _prebuild_deepspeed() and backends == ("deepspeed",):
        raise ValueError("--backends deepspeed: DeepSpeed is unavailable here (see above); "
                         "nothing to measure")
    if shm:
        from ..backends.shm import build

        build.load()  # build once here, not in every rank at once
    # the report names the backend and its negotiation time; the plan log would only cut
    # through the progress bar (ARFUSE_LOG=info brings it back)
    return launch(bench_rank, ranks.world, opts,
                  env={"OMP_NUM_THREADS": "1",
                       "ARFUSE_LOG": os.environ.get("ARFUSE_LOG", "warning")})


def _prebuild_deepspeed() -> bool:
    """DeepSpeed's shm op built before the ranks start; whether it is available (why not:
    printed)."""
    from ..bench.baselines import prebuild_deepspeed

    why = prebuild_deepspeed()
    if why:
        print(f"arfuse bench: deepspeed unavailable: {why}")
    return not why
