"""Command line: ``arfuse explain | run | bench | doctor``, one module per verb.

User errors (bad settings, bad topology files, bad flags) exit 2 with one line on stderr, never
a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from . import args as cli_args
from . import bench, doctor, explain, run, scenario

VERBS = (explain, run, bench, doctor, scenario)


def build_parser() -> argparse.ArgumentParser:
    parser = cli_args.Parser(
        prog="arfuse", description="Fused all-reduce + residual + RMSNorm on the backend this "
        "machine really supports.")
    sub = parser.add_subparsers(dest="command", required=True)
    for verb in VERBS:
        verb.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ValueError, TypeError) as exc:
        print(f"arfuse: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("arfuse: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
