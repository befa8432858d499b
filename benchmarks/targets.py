"""Where the CPU kernel's targets stand on this machine, in one command.

Runs ``arfuse bench`` (shm and DeepSpeed side by side, interleaved in rounds) ``--runs`` times
and ``benchmarks/oversubscribed.py`` once, then gives a verdict per target from the median over
runs, with every run's figure beside it: three runs cannot tell 0.99 from 1.03 on a machine that
drifts by 10-20% between runs. ``--isa avx2`` measures the AVX2 build (``ARFUSE_SHM_ISA``),
which is the kernel an AVX2-only machine builds; run it there without ``--isa`` to measure that
machine.

    python benchmarks/targets.py --runs 5 --out benchmarks/results/targets-now

Targets (world size 2, hidden 4096, bf16 and fp32): in place at most 1.0x DeepSpeed's
all-reduce alone at 1, 8, 64, 512 and 2048 tokens, with new output tensors at most 1.1x; from
64 tokens within 2x of the memory floor (``x_floor`` of ``arfuse bench``); two ranks on one
core: a 1-token call under 40 us and a decode-like step at least 1.5x faster than gloo's; Python
overhead per call under 3 us. The ratios to DeepSpeed are also given with
``replicated_residual=True`` (the ``-replicated`` rows: the residual is the same on every rank,
as in tensor parallelism). Needs DeepSpeed for the ratios (``EXTRAS=bench
./scripts/setup.sh``); without it those verdicts say "not measured".

``--pattern moe_finalize`` (or ``moe_reduce``) gives the MoE targets instead: ``arfuse bench
--pattern ... --backends shm,torch,deepspeed`` ``--runs`` times (1-512 tokens by default), the
fused call at least 3x faster than torch's expert step + arfuse's fused all-reduce and at least
4x faster than that step + DeepSpeed's all-reduce + eager add + RMSNorm.

    python benchmarks/targets.py --pattern moe_finalize --runs 3 --out benchmarks/results/moe-now
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from arfuse.backends.shm.build import ISAS
from arfuse.bench.targets import DTYPES, TOKENS, moe_verdicts, table, verdicts
from arfuse.moe_workload import MOE_PATTERNS

MOE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

HERE = Path(__file__).resolve().parent


def _quietly(cmd: list[str], env: dict[str, str]) -> None:
    """Run cmd; its output (progress bars, tables) is shown only if it fails."""
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"{' '.join(cmd[1:])} failed with exit status {done.returncode}")


def _bench(out: Path, runs: int, tokens: str, dtypes: str, env: dict[str, str],
           pattern: str, threads: int = 1) -> list[Path]:
    paths = []
    moe = ["--pattern", pattern, "--backends", "shm,torch,deepspeed"] \
        if pattern != "residual_rmsnorm" else ["--backends", "shm,deepspeed"]
    for i in range(runs):
        run_dir = out / f"run{i}"
        cmd = [sys.executable, "-m", "arfuse.cli", "bench", "--tokens", tokens, "--dtype",
               dtypes, *moe, "--threads", str(threads), "--out", str(run_dir)]
        print(f"run {i + 1}/{runs}: {' '.join(cmd[1:])}", flush=True)
        _quietly(cmd, env)
        paths.append(run_dir / "bench.json")
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", default=None,
                        help=f"default {','.join(map(str, TOKENS))}; MoE: "
                        f"{','.join(map(str, MOE_TOKENS))}")
    parser.add_argument("--pattern", default="residual_rmsnorm",
                        choices=("residual_rmsnorm", *MOE_PATTERNS))
    parser.add_argument("--dtype", default=",".join(DTYPES))
    parser.add_argument("--isa", default=None, choices=ISAS, help="ARFUSE_SHM_ISA for every run")
    parser.add_argument("--no-oversubscribed", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (1)")
    parser.add_argument("--out", default="benchmarks/results/targets-now")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.isa:
        env["ARFUSE_SHM_ISA"] = args.isa
    moe = args.pattern != "residual_rmsnorm"
    tokens_text = args.tokens or ",".join(map(str, MOE_TOKENS if moe else TOKENS))
    reports = [json.loads(p.read_text()) for p in _bench(out, args.runs, tokens_text,
                                                         args.dtype, env, args.pattern,
                                                         args.threads)]
    tokens = tuple(int(t) for t in tokens_text.split(","))
    dtypes = tuple(args.dtype.split(","))
    one_core = None
    if not moe and not args.no_oversubscribed:
        path = out / "oversubscribed.json"
        _quietly([sys.executable, str(HERE / "oversubscribed.py"), "--out", str(path)], env)
        one_core = json.loads(path.read_text())
    found = moe_verdicts(reports, tokens, dtypes) if moe else verdicts(reports, one_core,
                                                                        tokens, dtypes)
    machine = reports[0].get("machine", {})
    text = table(found, machine)
    print(text)
    (out / "targets.txt").write_text(text + "\n")
    (out / "targets.json").write_text(json.dumps(
        {"machine": machine, "runs": args.runs, "isa_override": args.isa,
         "threads_per_rank": args.threads,
         "pattern": args.pattern,
         "verdicts": [{**asdict(v), "median": v.median, "met": v.met, "runs_met": v.runs_met}
                      for v in found]}, indent=1))
    print(f"wrote {out / 'targets.txt'}, {out / 'targets.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
