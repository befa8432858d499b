"""Soak: many calls of the fused op on two real ranks, checked, with memory and descriptors
watched (DESIGN 5: "a 100,000-call soak with no mismatch and flat memory").

Why: a bug in slot double-buffering, sequence flags, copy-mode trials or the unfused path for
over-capacity calls shows only after many calls of varied sizes; a leak only as growth. What
a soak draws, checks and samples: ``arfuse.bench.soak``.

    python benchmarks/soak.py [--calls 100000] [--check-every 50] [--out FILE]
    python benchmarks/soak.py --hidden 4096 --capacity 2048 --rss-bound-mib 512  # prefill sizes

At the default sizes (hidden 128, bf16) every call is small; at hidden 4096 and a capacity of
2048 tokens two-shot runs in many steps and calls with outputs of their own reach the
kernel's streaming output stores. Resident memory then also holds the float64 reference of
the checked calls and the output pool (two calls at capacity), hence a larger bound. This
script gives the soak its command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from arfuse.bench.soak import (
    DEFAULT_CAPACITY,
    DEFAULT_HIDDEN,
    RSS_BOUND_MIB,
    Sizes,
    run_soak,
    summary,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--check-every", type=int, default=50)
    p.add_argument("--sample-every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=20261201)
    p.add_argument("--limit-s", type=float, default=1800.0)
    p.add_argument("--output-stores", default="auto", choices=("auto", "cached", "streaming"),
                   help="how the shm kernel stores a call's own outputs")
    p.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN)
    p.add_argument("--capacity", type=int, default=DEFAULT_CAPACITY,
                   help="tokens the workspace holds (calls draw up to 1.25x of it)")
    p.add_argument("--rss-bound-mib", type=float, default=RSS_BOUND_MIB,
                   help="allowed growth of resident memory after warm-up")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    if args.hidden < 16 or args.hidden % 16 or args.capacity < 2:
        p.error("--hidden: a multiple of 16 (nvfp4 blocks); --capacity: at least 2")
    result = run_soak(args.calls, args.check_every, args.sample_every, args.seed, args.limit_s,
                      args.output_stores, Sizes(args.hidden, args.capacity), args.rss_bound_mib)
    print(summary(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
