"""Command line: ``arfuse explain | run | bench | doctor``, one module per verb.

User errors (bad settings, bad topology files, bad flags) exit 2 with one line on stderr, never
a traceback; arfuse's own failures in this process (``ArfuseError``: a rank torchrun started
whose peers never arrived, say) exit 1, also with one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from ..errors import ArfuseError
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
    except ArfuseError as exc:
        rank = os.environ.get("RANK")  # a rank a launcher started: say which
        print(f"arfuse: {f'rank {rank}: ' if rank else ''}{type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("arfuse: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
