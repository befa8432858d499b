"""The checks of single arguments that every checked call shares (``call_checks`` for the
all-reduce, ``moe`` for an expert step): numbers the fp32 kernels can carry, plain tensors,
memory spans, and what every call of one op must match."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from . import ctables

# the kernel's limits (csrc/call_limits.h), so its fast path refuses exactly these values too
FP32_MAX = ctables.float_constant("call_limits.h", "kFp32Max")
FP32_TINY = ctables.float_constant("call_limits.h", "kFp32Tiny")  # smallest positive (subnormal)
FP8_SCALE_MIN = ctables.float_constant("call_limits.h", "kFp8ScaleMin")

Span = tuple[int, int]


def real_number(value: Any, name: str) -> float:
    """A real scalar as a Python float: int, float, NumPy scalar, or a one-element tensor
    that holds its value (not a meta or nested tensor)."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            raise TypeError(f"{name} must be a number or a one-element tensor, got a nested "
                            "tensor")
        if value.is_meta:
            raise ValueError(f"{name} is a meta tensor, which holds no value; pass a number "
                             "or a one-element tensor with data")
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape "
                             f"{tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real number, got a {value.dtype} tensor")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            type(value).__name__ == "bool_":
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name}={value!r} is not valid: it is beyond float32 "
                         f"(|{name}| <= {FP32_MAX:.4g})") from None


def fp32_number(value: Any, name: str, positive: bool = False,
                reciprocal: bool = False) -> float:
    """``real_number`` that the fp32 kernels can carry: finite in fp32; with ``positive`` also
    > 0 after rounding to fp32; with ``reciprocal`` its fp32 reciprocal finite too."""
    number = real_number(value, name)
    if not math.isfinite(number) or abs(number) > FP32_MAX:
        raise ValueError(f"{name}={number!r} is not valid: it must be finite in float32 "
                         f"(|{name}| <= {FP32_MAX:.4g})")
    if positive:
        low = FP8_SCALE_MIN if reciprocal else FP32_TINY
        if not number >= low:
            raise ValueError(f"{name}={number!r} is not valid: it must be a number >= {low:.4g} "
                             "(> 0 in float32" + (", with a finite reciprocal)" if reciprocal
                                                  else ")"))
    return number


def span(tensor: torch.Tensor) -> Span:
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def overlap(a: Span, b: Span) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@dataclass(frozen=True)
class OpShape:
    """What every call of one ``FusedAllReduce`` must match."""

    hidden: int
    dtype: torch.dtype
    dtype_name: str
    device: torch.device  # with its index: a CUDA workspace lives on one device


def check_plain(tensor: torch.Tensor, name: str) -> None:
    """A tensor whose memory holds its values as they read: dense (strided) and not nested,
    not quantized, and no lazy conjugate or negative view (the kernels read raw memory)."""
    if tensor.layout is torch.strided and not (tensor.is_nested or tensor.is_quantized
                                               or tensor.is_conj() or tensor.is_neg()):
        return
    if tensor.is_nested:
        raise ValueError(f"{name} is a nested tensor; pass a dense [tokens, hidden] tensor")
    if tensor.layout is not torch.strided:
        raise ValueError(f"{name} has layout {tensor.layout}; pass a dense (torch.strided) "
                         "tensor (.to_dense())")
    if tensor.is_quantized:
        raise ValueError(f"{name} is a quantized tensor ({tensor.dtype}); pass a bf16, fp16 "
                         "or fp32 tensor (.dequantize())")
    if tensor.is_conj():
        raise ValueError(f"{name} is a lazily conjugated view; call .resolve_conj() first")
    raise ValueError(f"{name} is a lazily negated view; call .resolve_neg() first")
