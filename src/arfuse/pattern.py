"""The fused pattern: what one call computes, one type every layer takes (DESIGN 3.9).

A pattern is what is reduced (the sum over ranks of ``x``, or of each rank's expert rows
combined first: ``moe_reduce``, ``moe_finalize``, docs/design.md 3.12), what the epilogue does
with the sum (nothing; RMSNorm; the residual added, then RMSNorm) and which quantised output it
makes (none, FP8 with the caller's scale, FP8 with a scale per token, NVFP4 with its scale
layout). A call's pattern follows from its arguments (``Pattern.of_call``); each backend's
descriptor says which patterns it fuses (``BackendDescriptor.fuses``); the call signature
carries its code, whose numbers are the kernel's (``csrc/signature.h``, read by
``arfuse.ctables``), so room for patterns to come is left in one place.

Pure: no torch, so the policy and ``explain`` can use it as data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from . import ctables

_S = ctables.header("signature.h")
REDUCTIONS: dict[str, int] = {"all_reduce": int(_S["kReductionAllReduce"]),
                              "moe_reduce": int(_S["kReductionMoeReduce"]),
                              "moe_finalize": int(_S["kReductionMoeFinalize"])}
EPILOGUES: dict[str, int] = {"none": int(_S["kEpilogueNone"]),
                             "rmsnorm": int(_S["kEpilogueRmsNorm"]),
                             "residual_rmsnorm": int(_S["kEpilogueResidualRmsNorm"])}
# (quant, NVFP4 scale layout) -> output code
OUTPUTS: dict[tuple[str | None, str | None], int] = {
    (None, None): int(_S["kOutputNone"]),
    ("fp8", None): int(_S["kOutputFp8"]),
    ("fp8_dynamic", None): int(_S["kOutputFp8Dynamic"]),
    ("nvfp4", "swizzled_128x4"): int(_S["kOutputNvfp4Swizzled"]),
    ("nvfp4", "linear"): int(_S["kOutputNvfp4Linear"]),
}
REDUCTION_SHIFT = int(_S["kReductionShift"])
_EPILOGUE_SHIFT = int(_S["kEpilogueShift"])
_EPILOGUE_TEXT = {"none": "", "rmsnorm": " + RMSNorm", "residual_rmsnorm": " + residual + RMSNorm"}
_REDUCTION_TEXT = {"all_reduce": "all-reduce",
                   "moe_reduce": "MoE expert reduction + all-reduce",
                   "moe_finalize": "MoE finalize + all-reduce"}


@dataclass(frozen=True, slots=True)
class Pattern:
    """One fused pattern. ``quant`` is ``None``, ``fp8``, ``fp8_dynamic`` or ``nvfp4``;
    ``layout`` is NVFP4's scale layout (``swizzled_128x4``, ``linear``), ``None`` otherwise."""

    epilogue: str = "none"
    quant: str | None = None
    layout: str | None = None
    reduction: str = "all_reduce"

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction={self.reduction!r} is not valid; use one of "
                             f"{', '.join(REDUCTIONS)}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"epilogue={self.epilogue!r} is not valid; use one of "
                             f"{', '.join(EPILOGUES)}")
        if (self.quant, self.layout) not in OUTPUTS:
            raise ValueError(f"quant={self.quant!r} with layout={self.layout!r} is not a "
                             "quantised output; use " + ", ".join(
                                 f"({q!r}, {lay!r})" for q, lay in OUTPUTS))

    @classmethod
    def of_call(cls, norm: bool, residual: bool, quant: str | None,
                layout: str, reduction: str = "all_reduce") -> Pattern:
        """The pattern of a call with (``norm``: a weight was given) and ``residual``,
        quantised as ``quant`` (NVFP4 with its scale ``layout``)."""
        epilogue = "none" if not norm else "residual_rmsnorm" if residual else "rmsnorm"
        return cls(epilogue, quant, layout if quant == "nvfp4" else None, reduction)

    @property
    def code(self) -> int:
        """The code the call signature carries (``csrc/signature.h``)."""
        return (REDUCTIONS[self.reduction] << REDUCTION_SHIFT
                | EPILOGUES[self.epilogue] << _EPILOGUE_SHIFT
                | OUTPUTS[(self.quant, self.layout)])

    @classmethod
    def from_code(cls, code: int) -> Pattern:
        reduction = code >> REDUCTION_SHIFT
        epilogue = (code >> _EPILOGUE_SHIFT) & ((1 << (REDUCTION_SHIFT - _EPILOGUE_SHIFT)) - 1)
        output = code & ((1 << _EPILOGUE_SHIFT) - 1)
        try:
            return cls(_key_of(EPILOGUES, epilogue), *_key_of(OUTPUTS, output),
                       reduction=_key_of(REDUCTIONS, reduction))
        except KeyError:
            raise ValueError(f"{code} is not the code of a pattern") from None

    @property
    def quantised(self) -> bool:
        return self.quant is not None

    @property
    def norm(self) -> bool:
        return self.epilogue != "none"

    @property
    def moe(self) -> bool:
        """Whether each rank first combines its expert rows (``moe_reduce``, ``moe_finalize``)."""
        return self.reduction != "all_reduce"

    def without_quant(self) -> Pattern:
        return Pattern(self.epilogue, None, None, self.reduction)

    def without_moe(self) -> Pattern:
        """The all-reduce pattern that follows a MoE pattern's expert step."""
        return Pattern(self.epilogue, self.quant, self.layout)

    @property
    def name(self) -> str:
        """Short and unique: ``residual_rmsnorm+nvfp4_linear``, ``allreduce`` (alone)."""
        parts = [] if self.reduction == "all_reduce" else [self.reduction]
        parts.append("allreduce" if self.epilogue == "none" else self.epilogue)
        if self.quant is not None:
            parts.append(self.quant + ("" if self.layout is None else
                                       "_swizzled" if self.layout == "swizzled_128x4"
                                       else "_linear"))
        return "+".join(parts)

    def describe(self) -> str:
        """``all-reduce + residual + RMSNorm + nvfp4 (linear)``."""
        text = _REDUCTION_TEXT[self.reduction] + _EPILOGUE_TEXT[self.epilogue]
        if self.quant is not None:
            text += f" + {self.quant}" + (f" ({self.layout})" if self.layout else "")
        return text


K = TypeVar("K")


def _key_of(table: Mapping[K, int], code: int) -> K:
    for key, value in table.items():
        if value == code:
            return key
    raise KeyError(code)


ALL_REDUCE: tuple[Pattern, ...] = tuple(Pattern(epilogue, quant, layout)
                                        for epilogue in EPILOGUES for quant, layout in OUTPUTS)
"""Every all-reduce pattern, the plain all-reduce first."""
ALL: tuple[Pattern, ...] = ALL_REDUCE + tuple(
    Pattern(p.epilogue, p.quant, p.layout, reduction)
    for reduction in REDUCTIONS if reduction != "all_reduce" for p in ALL_REDUCE)
"""Every pattern: the all-reduce ones, then the MoE ones."""
