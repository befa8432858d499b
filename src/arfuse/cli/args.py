"""Flag types and the flags several verbs share; every bad flag is one line, exit 2."""

from __future__ import annotations

import argparse
import math
from typing import NoReturn

from .. import settings
from ..dtypes import parse_dtype
from ..pattern import (
    DEFAULT_GROUP_SIZE,
    GROUP_SIZES_TEXT,
    QUANT_OUTPUTS,
    check_group_size,
    quant_output,
)
from ..spec import QUANTS, parse_quant
from ..topology import MAX_WORLD_SIZE

CALL_SIZE_MAX = 2**31 - 1
"""Tokens and hidden size of a call: FlashInfer's kernels take both as 32-bit ints, so no larger
value describes a call arfuse could fuse (and every size a job derives from them stays far
inside torch's 64-bit sizes)."""


class Parser(argparse.ArgumentParser):
    """Flag errors as one line (no usage dump), like every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int(text: str, high: int | None, why: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    if high is not None and value > high:
        raise argparse.ArgumentTypeError(f"{text!r} is too large; use 1..{high} ({why})")
    return value


def positive_int(text: str) -> int:
    return _int(text, None, "")


def call_size(text: str) -> int:
    """Tokens or hidden size of a call: 1..CALL_SIZE_MAX."""
    return _int(text, CALL_SIZE_MAX, "the GPU kernels take it as a 32-bit int")


def world_size(text: str) -> int:
    """Ranks of a group arfuse describes: 1..MAX_WORLD_SIZE (whether this machine can start
    them is the launcher's check, ``launch.check_ranks``)."""
    return _int(text, MAX_WORLD_SIZE, "the largest group a topology describes")


def int_list(text: str) -> tuple[int, ...]:
    """Comma list of call sizes (token counts), each 1..CALL_SIZE_MAX."""
    items = [v for v in text.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} must list integers >= 1")
    try:
        return tuple(call_size(v.strip()) for v in items)
    except argparse.ArgumentTypeError as exc:
        if len(items) == 1:
            raise
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def positive_seconds(text: str) -> float:
    """A duration: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; use a finite number of "
                                         "seconds > 0, such as 0.3")
    return value


def dtype(text: str) -> str:
    try:
        return parse_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def dtype_list(text: str) -> tuple[str, ...]:
    values = tuple(dtype(v) for v in text.split(",") if v.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} names no dtype")
    return values


def quant(text: str) -> str | None:
    try:
        return parse_quant(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_spec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=settings.backend_choices(), default=None,
                   help="backend to ask for (default: ARFUSE_BACKEND or auto)")
    p.add_argument("--hidden", type=call_size, default=4096, help="hidden size (4096)")
    p.add_argument("--dtype", type=dtype, default="bf16", help="bf16, fp16 or fp32 (bf16)")
    p.add_argument("--quant", type=quant, default=None,
                   help=f"none, {', '.join(QUANTS)} (none)")


def _grouped_quants() -> str:
    return " or ".join(dict.fromkeys(str(o.quant) for o in QUANT_OUTPUTS if o.grouped))


def _layouts() -> str:
    """Each quant of several rows with its layouts, its default first."""
    by_quant: dict[str, list[str]] = {}
    for o in QUANT_OUTPUTS:
        if o.quant and o.layout:
            by_quant.setdefault(o.quant, []).append(o.layout)
    return "; ".join(f"{q}: {', '.join(layouts)}" for q, layouts in by_quant.items())


def add_quant_format_flags(p: argparse.ArgumentParser) -> None:
    """A quantised output's group size and scale layout (the call's ``group_size`` and
    ``layout``)."""
    p.add_argument("--group-size", type=positive_int, default=None,
                   help=f"{_grouped_quants()}: columns per scale, {GROUP_SIZES_TEXT} dividing "
                        f"--hidden ({DEFAULT_GROUP_SIZE})")
    p.add_argument("--scale-format", default=None,
                   help=f"the scale layout of a quant with several ({_layouts()}; the first "
                        "is the default)")


def check_quant_format(quant: str | None, group_size: int | None, scale_format: str | None,
                       hidden: int) -> None:
    """``--group-size`` and ``--scale-format`` as the call checks take them (ValueError,
    which the CLI prints as one line and exit 2)."""
    rows = [o for o in QUANT_OUTPUTS if o.quant == quant]
    if group_size is not None and not any(o.grouped for o in rows):
        raise ValueError(f"--group-size is for --quant {_grouped_quants()}, got --quant "
                         f"{quant or 'none'}")
    if scale_format is not None and not any(o.layout for o in rows):
        raise ValueError(f"--scale-format is for a quant with several scale layouts "
                         f"({_layouts()}), got --quant {quant or 'none'}")
    if any(o.grouped for o in rows):
        check_group_size(group_size, hidden)
    if scale_format is not None:
        quant_output(quant, scale_format)  # ValueError naming layout and the quant's


def add_moe_flags(p: argparse.ArgumentParser) -> None:
    """The MoE patterns' sizes (``--pattern moe_finalize`` or ``moe_reduce``)."""
    p.add_argument("--top-k", type=positive_int, default=8,
                   help="experts per token (8); moe_reduce: the experts' rows it sums")
    p.add_argument("--experts", type=positive_int, default=64,
                   help="experts a token picks its top_k from (64; moe_finalize)")


def default_world_size(device: str) -> int:
    """The GPU count on CUDA, else two CPU ranks."""
    if device == "cuda":
        import torch

        return max(torch.cuda.device_count(), 1)
    return 2
