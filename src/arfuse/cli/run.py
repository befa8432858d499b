"""``arfuse run``: the main job. A row-parallel linear layer on every rank, then the fused
all-reduce + residual + RMSNorm (+ quantisation), checked against a single-process float64
reference of the whole layer, and timed against the unfused path, side by side.

This module checks the flags and starts the ranks without importing torch; the job itself is
``cli/run_job.py``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..dtypes import DTYPES
from ..moe_workload import MOE_PATTERNS, check_moe_sizes, expert_rows_bytes
from . import args as cli_args

DEFAULT_TOKENS = (1, 8, 64, 512)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="the main job: row-parallel layer + fused all-reduce, "
                       "checked against a reference and timed against the unfused path")
    p.add_argument("--world-size", type=cli_args.world_size, default=None,
                   help="ranks to start (2; under torchrun: the ranks it started)")
    p.add_argument("--tokens", type=cli_args.int_list, default=DEFAULT_TOKENS,
                   help="token counts (1,8,64,512)")
    p.add_argument("--steps", type=cli_args.positive_int, default=50,
                   help="timed steps per size (50)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when this host has a GPU per rank, else cpu")
    p.add_argument("--strict", action="store_true", default=None,
                   help="fail instead of running unfused")
    p.add_argument("--pattern", choices=("residual_rmsnorm", *MOE_PATTERNS),
                   default="residual_rmsnorm",
                   help="the call: all-reduce + residual + RMSNorm (default), or a MoE expert "
                   "step fused before it")
    cli_args.add_moe_flags(p)
    cli_args.add_spec_flags(p)
    cli_args.add_quant_format_flags(p)
    p.set_defaults(func=run)


def in_features(hidden: int, world: int) -> int:
    """The layer's input width: about twice ``hidden``, split evenly over the ranks."""
    return 2 * hidden // world * world or world


def memory_needs(tokens: int, hidden: int, dtype: str, world: int, pattern: str = \
                 "residual_rmsnorm", top_k: int = 0, experts: int = 0) -> dict[str, int]:
    """Lower bounds of what one rank of the job allocates at once, keyed by the flags that
    size each: the whole layer's weight and the largest activation, each also in float64 for
    the reference; for a MoE pattern its expert rows (``moe_workload.expert_rows_bytes``) and
    every rank's float64 expert step."""
    width = in_features(hidden, world)
    itemsize = DTYPES[dtype].size
    sizes = f"--tokens {tokens} --hidden {hidden} ({dtype})"
    needs = {f"{sizes}, the layer's weight and activations with their float64 reference":
             (hidden + tokens) * width * (itemsize + 8)}
    if pattern != "residual_rmsnorm":
        moe = expert_rows_bytes(pattern, tokens, hidden, top_k, experts, itemsize)
        needs[f"--top-k {top_k} {sizes}, the expert rows and every rank's float64 expert "
              "step"] = moe["rows"] + top_k * tokens * hidden * 8 + world * tokens * hidden * 8
        if "picks" in moe:
            needs[f"--experts {experts} --tokens {tokens}, each token's pick of its experts"] = \
                moe["picks"]
    return needs


def run(args: argparse.Namespace) -> int:
    from ..launch import check_memory, default_device, job_ranks, launch
    from ..spec import Spec
    from .explain import check_job

    # what needs no torch first: a bad flag is refused before its import
    ranks = job_ranks(args.world_size)
    spec = Spec(max_tokens=max(args.tokens), hidden=args.hidden, dtype=args.dtype,
                quant=args.quant)
    cli_args.check_quant_format(args.quant, args.group_size, args.scale_format, args.hidden)
    if args.pattern != "residual_rmsnorm":
        check_moe_sizes(args.pattern, args.top_k, args.experts)
    device = args.device or default_device(ranks)
    check_job(args.backend, args.strict, ranks, device, spec)
    check_memory(memory_needs(spec.max_tokens, spec.hidden, spec.dtype, ranks.world,
                              args.pattern, args.top_k, args.experts), ranks)
    from .run_checks import RunOptions
    from .run_job import run_body

    opts = RunOptions(world_size=ranks.world, tokens=tuple(args.tokens), hidden=args.hidden,
                      dtype=args.dtype, quant=args.quant, steps=args.steps,
                      backend=args.backend, device=device, strict=args.strict,
                      pattern=args.pattern, top_k=args.top_k, experts=args.experts,
                      group_size=args.group_size, scale_format=args.scale_format)
    # the job prints the plan itself; the log repeats it only if asked (ARFUSE_LOG=info)
    return launch(run_body, ranks.world, opts,
                  env={"ARFUSE_LOG": os.environ.get("ARFUSE_LOG", "warning")})
