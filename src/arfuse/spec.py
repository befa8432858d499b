"""What a fused all-reduce is asked to carry: the spec every rank must agree on, and the rules
of its patterns (quantisation names, the NVFP4 preconditions, scale layouts).

Kept free of torch so the policy can be reasoned about (and property-tested) as plain data;
``torch.dtype`` values are accepted and named by their canonical short names.
"""

from __future__ import annotations

from dataclasses import dataclass

from .dtypes import DTYPES, parse_dtype

QUANTS: tuple[str, ...] = ("fp8", "nvfp4", "fp8_dynamic")
SCALED_QUANTS = ("fp8", "nvfp4")  # the caller gives the scale; fp8_dynamic computes its own
NVFP4_BLOCK = 16
LAYOUTS: tuple[str, ...] = ("swizzled_128x4", "linear")


def parse_quant(value: object, name: str = "quant") -> str | None:
    """``None``/``"none"`` -> ``None``; a name of ``QUANTS`` as is; anything else is an error."""
    allowed = ", ".join(("none", *QUANTS))
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be None or one of {allowed}, got {type(value).__name__}")
    text = value.strip().lower()
    if text in ("", "none"):
        return None
    if text not in QUANTS:
        raise ValueError(f"{name}={value!r} is not valid; use one of {allowed}")
    return text


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not valid; use one of {', '.join(LAYOUTS)}")
    return str(layout)


def nvfp4_problem(dtype: str, hidden: int) -> str:
    """Why NVFP4 cannot quantise rows of ``hidden`` elements of ``dtype`` ("" when it can).

    The one copy of this rule: the spec, the call checks and the kernel's fast path (which
    mirrors it, tested against this) all refuse the same cases."""
    if dtype == "fp32":
        return "quant='nvfp4' needs dtype bf16 or fp16, not fp32"
    if hidden % NVFP4_BLOCK:
        return f"quant='nvfp4' needs hidden a multiple of {NVFP4_BLOCK}, got hidden={hidden}"
    return ""


@dataclass(frozen=True)
class Spec:
    """Shape of the largest call and the patterns asked for, identical on every rank."""

    max_tokens: int
    hidden: int
    dtype: str = "bf16"
    quant: str | None = None

    def __post_init__(self) -> None:
        for field_name in ("max_tokens", "hidden"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{field_name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{field_name}={value} is not valid; it must be >= 1")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        object.__setattr__(self, "quant", parse_quant(self.quant))
        if self.quant == "nvfp4":
            problem = nvfp4_problem(self.dtype, self.hidden)
            if problem:
                raise ValueError(problem)

    @property
    def elem_size(self) -> int:
        return DTYPES[self.dtype].size

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.elem_size

    def covers(self, other: Spec) -> bool:
        """True when a workspace built for ``self`` can serve ``other`` (R4).

        Quantisation is not compared: every backend's workspace serves the plain and the quantised
        patterns alike, so one workspace per group covers both (R5).
        """
        return (
            self.dtype == other.dtype
            and self.hidden == other.hidden
            and self.max_tokens >= other.max_tokens
        )
