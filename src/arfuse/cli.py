"""Command line: ``arfuse explain | run | bench | doctor``.

User errors (bad settings, bad topology files, bad flags) exit 2 with one line on stderr, never
a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from . import policy, settings, topology
from .spec import Spec, parse_dtype, parse_quant


class _Parser(argparse.ArgumentParser):
    """Flag errors as one line (no usage dump), like every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must list integers >= 1")
    return values


def _dtype(text: str) -> str:
    try:
        return parse_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _dtype_list(text: str) -> list[str]:
    return [_dtype(v) for v in text.split(",") if v.strip()]


def _quant(text: str) -> str | None:
    try:
        return parse_quant(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_spec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=settings.BACKENDS, default=None,
                   help="backend to ask for (default: ARFUSE_BACKEND or auto)")
    p.add_argument("--hidden", type=_positive_int, default=4096, help="hidden size (4096)")
    p.add_argument("--dtype", type=_dtype, default="bf16", help="bf16, fp16 or fp32 (bf16)")
    p.add_argument("--quant", type=_quant, default=None, help="none, fp8 or nvfp4 (none)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="arfuse", description="Fused all-reduce + residual + RMSNorm on the backend this "
        "machine really supports.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("explain", help="what arfuse would pick, and why")
    p.add_argument("--topology", default=None, help="topology JSON (default: this machine)")
    p.add_argument("--world-size", type=_positive_int, default=None,
                   help="ranks, for this machine without --topology (default: GPUs, or 2 on CPU)")
    p.add_argument("--max-tokens", type=_positive_int, default=2048, help="tokens per call (2048)")
    _add_spec_flags(p)
    p.add_argument("--strict", action="store_true", default=None,
                   help="no unfused fallback (ARFUSE_STRICT=1)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_explain)

    from . import commands  # the collective commands live apart from the parser

    commands.add_subcommands(sub, _add_spec_flags, _positive_int, _int_list, _dtype_list)
    return parser


def _explain_topology(args: argparse.Namespace, conf: settings.Settings) -> topology.Topology:
    path = args.topology or conf.topology_path
    if path:
        return topology.load(path)
    device = topology.default_device()
    world = args.world_size
    if world is None:
        if device == "cuda":
            import torch

            world = max(torch.cuda.device_count(), 1)
        else:
            world = 2
    return topology.this_machine(world, device)


def cmd_explain(args: argparse.Namespace) -> int:
    conf = settings.load(backend=args.backend, strict=args.strict)
    topo = _explain_topology(args, conf)
    spec = Spec(max_tokens=args.max_tokens, hidden=args.hidden, dtype=args.dtype, quant=args.quant)
    from .backends.registry import missing

    plan = policy.resolve(conf, topo, spec, missing())
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan.explain())
    return 0


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
