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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from arfuse.backends.shm.build import ISAS

TOKENS = (1, 8, 64, 512, 2048)
DTYPES = ("bf16", "fp32")
IN_PLACE_MAX = 1.0  # x DeepSpeed's all-reduce alone
NEW_OUTPUTS_MAX = 1.1
FLOOR_MAX = 2.0  # x the one-rate memory floor
FLOOR_FROM_TOKENS = 64
ONE_CORE_CALL_MAX_US = 40.0
ONE_CORE_DECODE_MIN = 1.5  # gloo's decode-like step / arfuse's
OVERHEAD_MAX_US = 3.0
# (target, arfuse bench row, limit) of the ratios to DeepSpeed's all-reduce alone
RATIO_ROWS = (("in place x DeepSpeed", "shm-inplace", IN_PLACE_MAX),
              ("new outputs x DeepSpeed", "shm", NEW_OUTPUTS_MAX),
              ("in place, replicated x DeepSpeed", "shm-inplace-replicated", IN_PLACE_MAX),
              ("new outputs, replicated x DeepSpeed", "shm-replicated", NEW_OUTPUTS_MAX))

HERE = Path(__file__).resolve().parent


@dataclass
class Verdict:
    """One target at one size: each run's figure, their median, and whether it meets the limit
    (``None``: not measured)."""

    target: str
    dtype: str
    tokens: int | None
    limit: float
    at_most: bool  # True: the figure must be <= limit; False: >= limit
    per_run: list[float] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return statistics.median(self.per_run) if self.per_run else None

    def meets(self, value: float) -> bool:
        return value <= self.limit if self.at_most else value >= self.limit

    @property
    def met(self) -> bool | None:
        median = self.median
        return None if median is None else self.meets(median)

    @property
    def runs_met(self) -> int:
        return sum(self.meets(v) for v in self.per_run)


def _row(report: dict[str, Any], dtype: str, tokens: int, backend: str) -> dict[str, Any] | None:
    entry: dict[str, Any]
    for entry in report.get("results", []):
        if (entry.get("dtype"), entry.get("tokens"), entry.get("backend")) == (dtype, tokens,
                                                                                backend):
            return entry
    return None


def verdicts(reports: list[dict[str, Any]], one_core: dict[str, Any] | None,
             tokens: tuple[int, ...] = TOKENS, dtypes: tuple[str, ...] = DTYPES) -> list[Verdict]:
    """Every target's verdict from ``arfuse bench`` reports (one per run) and an
    ``oversubscribed.py`` report (or None). Pure: no I/O."""
    out: list[Verdict] = []
    for dtype in dtypes:
        for t in tokens:
            ratios = [Verdict(name, dtype, t, limit, True) for name, _, limit in RATIO_ROWS]
            floor = Verdict("in place x floor", dtype, t, FLOOR_MAX, True)
            for report in reports:
                ds = _row(report, dtype, t, "deepspeed")
                for verdict, (_, row_name, _) in zip(ratios, RATIO_ROWS, strict=True):
                    row = _row(report, dtype, t, row_name)
                    if ds is not None and row is not None:
                        verdict.per_run.append(row["median_us"] / ds["median_us"])
                ip = _row(report, dtype, t, "shm-inplace")
                if ip is not None and ip.get("x_floor") is not None:
                    floor.per_run.append(float(ip["x_floor"]))
            out += ratios
            if t >= FLOOR_FROM_TOKENS:
                out.append(floor)
        overhead = Verdict("python overhead us", dtype, None, OVERHEAD_MAX_US, True)
        for report in reports:
            value = report.get("python_overhead", {}).get(dtype, {}).get("overhead_us")
            if value is not None:
                overhead.per_run.append(float(value))
        out.append(overhead)
    call = Verdict("one core: 1-token call us", "bf16", 1, ONE_CORE_CALL_MAX_US, True)
    decode = Verdict("one core: decode step gloo / arfuse", "bf16", 1, ONE_CORE_DECODE_MIN, False)
    for row in (one_core or {}).get("rows", []):
        if row.get("placement") == "shared":
            call.per_run.append(float(row["call_us"]))
            decode.per_run.append(float(row["gloo_over_arfuse"]))
    return [*out, call, decode]


def table(found: list[Verdict], machine: dict[str, Any]) -> str:
    lines = [f"{machine.get('cpu', '?')}, kernel {machine.get('kernel_isa', '?')}, "
             f"{machine.get('world_size', 2)} ranks",
             f"{'target':<36} {'dtype':>5} {'tokens':>6} {'limit':>7} {'median':>8}  "
             f"{'met':<12} per run"]
    for v in found:
        median = v.median
        met = "not measured" if v.met is None else (
            f"yes ({v.runs_met}/{len(v.per_run)})" if v.met else
            f"no ({v.runs_met}/{len(v.per_run)})")
        sign = "<=" if v.at_most else ">="
        lines.append(f"{v.target:<36} {v.dtype:>5} {'' if v.tokens is None else v.tokens:>6} "
                     f"{sign}{v.limit:<5g} {'-' if median is None else f'{median:.3f}':>8}  "
                     f"{met:<12} {' '.join(f'{x:.2f}' for x in v.per_run)}")
    return "\n".join(lines)


def _quietly(cmd: list[str], env: dict[str, str]) -> None:
    """Run cmd; its output (progress bars, tables) is shown only if it fails."""
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"{' '.join(cmd[1:])} failed with exit status {done.returncode}")


def _bench(out: Path, runs: int, tokens: str, dtypes: str, env: dict[str, str]) -> list[Path]:
    paths = []
    for i in range(runs):
        run_dir = out / f"run{i}"
        cmd = [sys.executable, "-m", "arfuse.cli", "bench", "--tokens", tokens, "--dtype",
               dtypes, "--backends", "shm,deepspeed", "--out", str(run_dir)]
        print(f"run {i + 1}/{runs}: {' '.join(cmd[1:])}", flush=True)
        _quietly(cmd, env)
        paths.append(run_dir / "bench.json")
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--dtype", default=",".join(DTYPES))
    parser.add_argument("--isa", default=None, choices=ISAS, help="ARFUSE_SHM_ISA for every run")
    parser.add_argument("--no-oversubscribed", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/targets-now")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.isa:
        env["ARFUSE_SHM_ISA"] = args.isa
    reports = [json.loads(p.read_text()) for p in _bench(out, args.runs, args.tokens,
                                                         args.dtype, env)]
    one_core = None
    if not args.no_oversubscribed:
        path = out / "oversubscribed.json"
        _quietly([sys.executable, str(HERE / "oversubscribed.py"), "--out", str(path)], env)
        one_core = json.loads(path.read_text())
    tokens = tuple(int(t) for t in args.tokens.split(","))
    found = verdicts(reports, one_core, tokens, tuple(args.dtype.split(",")))
    machine = reports[0].get("machine", {})
    text = table(found, machine)
    print(text)
    (out / "targets.txt").write_text(text + "\n")
    (out / "targets.json").write_text(json.dumps(
        {"machine": machine, "runs": args.runs, "isa_override": args.isa,
         "verdicts": [{**asdict(v), "median": v.median, "met": v.met, "runs_met": v.runs_met}
                      for v in found]}, indent=1))
    print(f"wrote {out / 'targets.txt'}, {out / 'targets.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
