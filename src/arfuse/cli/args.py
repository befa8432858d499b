"""Flag types and the flags several verbs share; every bad flag is one line, exit 2."""

from __future__ import annotations

import argparse
from typing import NoReturn

from .. import settings
from ..dtypes import parse_dtype
from ..spec import parse_quant


class Parser(argparse.ArgumentParser):
    """Flag errors as one line (no usage dump), like every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must list integers >= 1")
    return tuple(values)


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
    p.add_argument("--hidden", type=positive_int, default=4096, help="hidden size (4096)")
    p.add_argument("--dtype", type=dtype, default="bf16", help="bf16, fp16 or fp32 (bf16)")
    p.add_argument("--quant", type=quant, default=None,
                   help="none, fp8, nvfp4 or fp8_dynamic (none)")


def default_world_size(device: str) -> int:
    """The GPU count on CUDA, else two CPU ranks."""
    if device == "cuda":
        import torch

        return max(torch.cuda.device_count(), 1)
    return 2
