"""What a fused all-reduce is asked to carry: the spec every rank must agree on.

Kept free of torch so the policy can be reasoned about (and property-tested) as plain data;
``torch.dtype`` values are accepted and named by their canonical short names.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Canonical dtype name -> element size in bytes."""

_DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}

QUANTS: tuple[str, ...] = ("fp8", "nvfp4")
NVFP4_BLOCK = 16


def parse_dtype(value: object, name: str = "dtype") -> str:
    """Canonical name (``bf16``, ``fp16``, ``fp32``) of a dtype given by name or ``torch.dtype``."""
    text = str(value).strip().lower()
    text = text.removeprefix("torch.")
    if text not in _DTYPE_ALIASES:
        raise ValueError(
            f"{name}={value!r} is not supported; use bf16, fp16 or fp32 "
            "(or torch.bfloat16, torch.float16, torch.float32)"
        )
    return _DTYPE_ALIASES[text]


def parse_quant(value: object, name: str = "quant") -> str | None:
    """``None``/``"none"`` -> ``None``; ``"fp8"``/``"nvfp4"`` as is; anything else is an error."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be None, 'none', 'fp8' or 'nvfp4', got {type(value).__name__}"
        )
    text = value.strip().lower()
    if text in ("", "none"):
        return None
    if text not in QUANTS:
        raise ValueError(f"{name}={value!r} is not valid; use none, fp8 or nvfp4")
    return text


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
            if self.dtype == "fp32":
                raise ValueError("quant='nvfp4' needs dtype bf16 or fp16, not fp32")
            if self.hidden % NVFP4_BLOCK:
                raise ValueError(
                    f"quant='nvfp4' needs hidden a multiple of {NVFP4_BLOCK}, "
                    f"got hidden={self.hidden}"
                )

    @property
    def elem_size(self) -> int:
        return DTYPES[self.dtype]

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
