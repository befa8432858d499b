"""``arfuse scenario run FILE|DIR``: parse, run the scenarios (``arfuse.scenarios``), print."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..scenarios.language import scenario_files
from ..scenarios.runner import coverage, format_table, run_one

MAX_LIMIT_SCALE = 100.0  # 600 s (the largest limit_s) times this still fits every timeout


def limit_scale(text: str) -> float:
    """``--limit-scale``: a positive finite factor (0, a negative, inf, nan or a huge one would
    turn every limit into nonsense or a traceback)."""
    allowed = f"use a number > 0 and <= {MAX_LIMIT_SCALE:g}, such as 2 or 0.5"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; {allowed}") from None
    if not math.isfinite(value) or not 0 < value <= MAX_LIMIT_SCALE:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; {allowed}")
    return value


def check_output_file(path: str) -> None:
    """``--json``: checked before the first scenario runs, not after all of them."""
    target = Path(path)
    parent = target.parent
    if target.is_dir():
        raise ValueError(f"--json {path!r} is a directory; give a file path")
    if not parent.is_dir():
        raise ValueError(f"--json {path!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists()
                                                    and not os.access(target, os.W_OK)):
        raise ValueError(f"--json {path!r} cannot be written (permission denied)")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("scenario", help="replay the field's failures as scenarios")
    verbs = p.add_subparsers(dest="scenario_command", required=True)
    run_p = verbs.add_parser("run", help="run scenario files (FILE or DIR of *.toml)")
    run_p.add_argument("paths", nargs="+", help="scenario files or directories")
    run_p.add_argument("--json", default=None, help="write the outcomes to this file")
    run_p.add_argument("--limit-scale", type=limit_scale, default=1.0,
                       help="multiply every scenario's hard limit, in (0, 100] (slow "
                       "machines)")
    run_p.set_defaults(func=run)


def run(args: argparse.Namespace, say: Callable[[str], None] = print) -> int:
    if args.json:
        check_output_file(args.json)
    files = scenario_files(args.paths)
    if not files:
        raise ValueError(f"no scenario files in {args.paths}")
    if os.environ.get("ARFUSE_SHM_PURE_TORCH") != "1":
        from ..backends.shm import build as shm_build

        shm_build.load()  # a first build (about a minute) must not count against a scenario's limit
    outcomes = []
    for path in files:
        outcome = run_one(path, args.limit_scale)
        say(f"{outcome.status.upper():<5} {outcome.scenario.name} ({outcome.seconds:.1f} s)")
        outcomes.append(outcome)
    say("")
    say(format_table(outcomes))
    if len(files) > 1:
        say("")
        say(coverage(outcomes))
    if args.json:
        text = json.dumps([
            {"scenario": o.scenario.name, "file": str(o.scenario.path), "rows": o.scenario.rows,
             "cases": o.scenario.cases, "level": o.scenario.level, "status": o.status,
             "seconds": round(o.seconds, 2), "summary": o.summary, "problems": o.problems}
            for o in outcomes], indent=2)
        try:
            Path(args.json).write_text(text)
        except OSError as exc:  # removed or filled since the check: still one line
            raise ValueError(f"--json {args.json!r} cannot be written: {exc}") from None
    return 1 if any(o.status == "fail" for o in outcomes) else 0
