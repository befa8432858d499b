"""What a fused all-reduce is asked to carry: the spec every rank must agree on, and the rules
of its patterns (quantisation names, their preconditions, scale layouts: arfuse.pattern's
table of quantised outputs).

Kept free of torch so the policy can be reasoned about (and property-tested) as plain data;
``torch.dtype`` values are accepted and named by their canonical short names.
"""

from __future__ import annotations

from dataclasses import dataclass

from .dtypes import DTYPES, parse_dtype
from .pattern import QUANT_OUTPUTS, quant_output

# the quantised outputs' names: the table's (arfuse/csrc/signature.h)
QUANTS: tuple[str, ...] = tuple(dict.fromkeys(o.quant for o in QUANT_OUTPUTS if o.quant))
NVFP4_BLOCK = quant_output("nvfp4", "linear").block


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


def quant_problem(quant: str | None, dtype: str, hidden: int) -> str:
    """Why ``quant`` cannot quantise rows of ``hidden`` elements of ``dtype`` ("" when it can;
    the rule is the table's, ``QuantOutput.problem``)."""
    return next(o for o in QUANT_OUTPUTS if o.quant == quant).problem(dtype, hidden)


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
        problem = quant_problem(self.quant, self.dtype, self.hidden)
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
