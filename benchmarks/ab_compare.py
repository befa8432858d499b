"""Two builds of arfuse side by side: ``arfuse bench`` from each source tree, alternating
A, B, A, B, ... so drift of a shared machine hits both alike; per row the median over runs of
each run's median, and the ratio B / A.

    python benchmarks/ab_compare.py --a /tmp/old/src --b src --runs 4 --out DIR \
        [--tokens 1,8,64,512] [--dtype bf16,fp32] [--backends shm]

Each tree is put first on PYTHONPATH of its own ``python -m arfuse.cli bench`` (the running
interpreter's environment otherwise), so both use the same torch and compiler; each compiles
its own kernel (cached by source hash).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def _bench(tree: str, out: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    cmd = [sys.executable, "-m", "arfuse.cli", "bench", "--world-size", "2", "--tokens",
           args.tokens, "--dtype", args.dtype, "--backends", args.backends, "--out", str(out),
           "--min-seconds", str(args.min_seconds)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads((out / "bench.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", required=True, help="source tree A (the baseline)")
    parser.add_argument("--b", required=True, help="source tree B")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--tokens", default="1,8,64,512")
    parser.add_argument("--dtype", default="bf16,fp32")
    parser.add_argument("--backends", default="shm")
    parser.add_argument("--min-seconds", type=float, default=0.3)
    parser.add_argument("--out", default="ab-out")
    args = parser.parse_args()
    out = Path(args.out)
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for i in range(args.runs):
        for label, tree in (("A", args.a), ("B", args.b)):
            runs[label].append(_bench(tree, out / f"{label}{i}", args))
            print(f"run {i} {label} done", flush=True)
    medians: dict[tuple[str, int, str], dict[str, float]] = {}
    for label, reports in runs.items():
        for report in reports:
            for row in report["results"]:
                key = (row["dtype"], row["tokens"], row["backend"])
                medians.setdefault(key, {}).setdefault(label, []).append(row["median_us"])  # type: ignore[attr-defined]
    lines = [f"{'dtype':<5} {'tokens':>6} {'row':<12} {'A us':>9} {'B us':>9} {'B/A':>6}"]
    table = []
    for (dtype, tokens, row), per in sorted(medians.items()):
        a, b = statistics.median(per["A"]), statistics.median(per["B"])  # type: ignore[arg-type]
        table.append({"dtype": dtype, "tokens": tokens, "row": row, "a_us": a, "b_us": b,
                      "ratio": b / a, "a_runs": per["A"], "b_runs": per["B"]})
        lines.append(f"{dtype:<5} {tokens:>6} {row:<12} {a:>9.1f} {b:>9.1f} {b / a:>6.2f}")
    overhead = {label: [r.get("python_overhead", {}) for r in reports]
                for label, reports in runs.items()}
    for label, per_run in overhead.items():
        for dtype in args.dtype.split(","):
            values = [r[dtype]["overhead_us"] for r in per_run if dtype in r]
            if values:
                runs_text = ", ".join(f"{v:.2f}" for v in values)
                lines.append(f"python overhead {label} {dtype}: median "
                             f"{statistics.median(values):.2f} us (runs: {runs_text})")
    text = "\n".join(lines)
    print(text)
    (out / "ab.txt").write_text(text + "\n")
    (out / "ab.json").write_text(json.dumps({"a": args.a, "b": args.b, "runs": args.runs,
                                             "machine": runs["B"][0]["machine"], "rows": table,
                                             "python_overhead": overhead}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
