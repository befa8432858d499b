"""The fused pattern: what one call computes, one type every layer takes (DESIGN 3.9).

A pattern is what is reduced (the sum over ranks of ``x``, or of each rank's expert rows
combined first: ``moe_reduce``, ``moe_finalize``, docs/design.md 3.12), what the epilogue does
with the sum (nothing; RMSNorm; the residual added, then RMSNorm) and which quantised output it
makes (none, FP8 with the caller's scale, FP8 with a scale per token, NVFP4 with its scale
layout). A call's pattern follows from its arguments (``Pattern.of_call``); each backend's
descriptor says which patterns it fuses (``BackendDescriptor.fuses``); the call signature
carries its code, whose numbers are the kernels' (``arfuse/csrc/signature.h``, read by
``arfuse.ctables``), so room for patterns to come is left in one place. The quantised outputs
are the table ``kQuantOutputs`` of ``arfuse/csrc/quant_outputs.h`` (``QUANT_OUTPUTS`` here): a
row names, numbers and shapes each one and says its scale rule, for both languages; everything
else reads the row (``quant_output`` is the one place a ``quant`` name is looked up, and
refused).

Pure: no torch, so the policy and ``explain`` can use it as data.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from . import ctables

_S = ctables.header("signature.h")
_Q = ctables.header("quant_outputs.h")
REDUCTIONS: dict[str, int] = {"all_reduce": int(_S["kReductionAllReduce"]),
                              "moe_reduce": int(_S["kReductionMoeReduce"]),
                              "moe_finalize": int(_S["kReductionMoeFinalize"])}
EPILOGUES: dict[str, int] = {"none": int(_S["kEpilogueNone"]),
                             "rmsnorm": int(_S["kEpilogueRmsNorm"]),
                             "residual_rmsnorm": int(_S["kEpilogueResidualRmsNorm"])}
_SCALE_IN = {int(_Q["kScaleInNone"]): "none", int(_Q["kScaleInDequant"]): "dequant",
             int(_Q["kScaleInEncode"]): "encode"}
_RULES = {int(_Q["kRuleNone"]): "none", int(_Q["kRuleStatic"]): "static",
          int(_Q["kRuleAmaxOverMax"]): "amax_over_max",
          int(_Q["kRuleFloorOverMax"]): "floor_over_max",
          int(_Q["kRulePowerOfTwo"]): "power_of_two",
          int(_Q["kRuleEncodeBlock"]): "encode_block"}
_QUANT_TYPES = {int(_Q["kQuantTypeNone"]): None, int(_Q["kQuantTypeE4m3"]): "float8_e4m3fn",
                int(_Q["kQuantTypeUint8"]): "uint8", int(_Q["kQuantTypeFloat32"]): "float32",
                int(_Q["kQuantTypeInt32"]): "int32"}
_ORDERS = {int(_Q["kOrderRowMajor"]): "row_major", int(_Q["kOrderColumnMajor"]): "column_major",
           int(_Q["kOrderSwizzled"]): "swizzled"}
GROUP_OF_CALL = int(_Q["kGroupOfCall"])
GROUP_UNIT = int(_Q["kGroupUnit"])
GROUP_SIZES: tuple[int, ...] = tuple(GROUP_UNIT << code
                                     for code in range(1, int(_Q["kGroupCodes"]) + 1))
"""The group sizes of a per-token-group output (32, 64, 128); signature word 1 carries the
code ``log2(size / GROUP_UNIT)``."""
DEFAULT_GROUP_SIZE = int(_Q["kDefaultGroupSize"])
OUTPUT_CODES = int(_Q["kOutputCodes"])
E4M3_MAX = float(_Q["kE4m3Max"])
E2M1_MAX = float(_Q["kE2m1Max"])
SWIZZLE_TILE = (int(_Q["kSwizzleTileRows"]), int(_Q["kSwizzleTileCols"]),
                int(_Q["kSwizzleRowStripe"]))
"""swizzled_128x4's tile: rows, columns, and the rows of a stripe (quant_outputs.h)."""
E2M1_THRESHOLDS: tuple[tuple[float, bool], ...] = tuple(
    (float(at), bool(strict)) for at, strict in ctables.table("quant_outputs.h",
                                                              "kE2m1Thresholds"))
"""(threshold, strict): the e2m1 code of |v| counts those it passes (> strict, >= not)."""
GROUP_SIZES_TEXT = ", ".join(map(str, GROUP_SIZES))


def group_code(group_size: int) -> int:
    """The signature's code of a group size (0: no group)."""
    return GROUP_SIZES.index(group_size) + 1 if group_size in GROUP_SIZES else 0


def check_group_size(group_size: Any, hidden: int) -> int:
    """fp8_group's group size: None is the default (128); else an int of ``GROUP_SIZES``
    that divides ``hidden``."""
    if group_size is None:
        group_size = DEFAULT_GROUP_SIZE
    elif isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be None or an int ({GROUP_SIZES_TEXT} dividing "
                        f"hidden_dim), got {type(group_size).__name__}")
    if group_size not in GROUP_SIZES or hidden % group_size:
        raise ValueError(f"group_size={group_size!r} is not valid with hidden_dim={hidden}; "
                         f"use one of {GROUP_SIZES_TEXT} dividing hidden_dim")
    return int(group_size)


def _round_up(value: int, to: int) -> int:
    return (value + to - 1) // to * to


@dataclass(frozen=True, slots=True)
class QuantOutput:
    """One row of ``kQuantOutputs`` (``arfuse/csrc/quant_outputs.h``, whose comments say what
    each column means): a quantised output, or ``none``."""

    quant: str | None     # the ``quant`` argument that names it (None: no quantised output)
    layout: str | None    # the ``layout`` argument that picks it among its quant's rows
    code: int             # the pattern's output bits, and the shm torch operator's ``quant``
    scale_in: str         # the caller's scale: none, dequant (reciprocal taken), encode
    rule: str             # how codes and scales are made: none, static, amax_over_max,
                          # floor_over_max, power_of_two, encode_block
    floor: float          # the rule's floor, taken as float32 (0: none)
    fp32: bool            # whether fp32 rows can be quantised
    block: int            # hidden must be a multiple of it
    data_dtype: str | None   # quant_out's torch dtype name (None: not made)
    data_pack: int           # values per element of quant_out
    scale_dtype: str | None  # scale_out's torch dtype name (None: not made)
    scale_row_align: int  # rows padded to it (row-major: the shape; column-major: the stride)
    scale_group: int      # 0: one scale per row; GROUP_OF_CALL: per the call's group_size
    scale_col_align: int
    scale_pack: int       # scales per element of scale_out
    scale_order: str      # row_major, column_major, swizzled

    @classmethod
    def of_row(cls, row: tuple[ctables.Cell, ...]) -> QuantOutput:
        (quant, layout, code, scale_in, rule, floor, fp32, block, data_type, data_pack,
         scale_type, row_align, group, col_align, pack, order) = row
        return cls(None if quant == "none" else str(quant), str(layout) or None, int(code),
                   _SCALE_IN[int(scale_in)], _RULES[int(rule)], float(floor), bool(fp32),
                   int(block), _QUANT_TYPES[int(data_type)], int(data_pack),
                   _QUANT_TYPES[int(scale_type)], int(row_align), int(group), int(col_align),
                   int(pack), _ORDERS[int(order)])

    @property
    def grouped(self) -> bool:
        """Whether the call's ``group_size`` picks its groups (fp8_group)."""
        return self.block == GROUP_OF_CALL

    def data_shape(self, tokens: int, hidden: int) -> tuple[int, int] | None:
        """quant_out's shape (``None``: not made)."""
        return None if self.data_dtype is None else (tokens, hidden // self.data_pack)

    def span(self, hidden: int, group_size: int = 0) -> int:
        """The columns one scale covers (the kernel's ``scale_span``): the row, the call's
        ``group_size`` or the row's fixed block."""
        if self.scale_group == 0:
            return hidden
        return group_size if self.scale_group == GROUP_OF_CALL else self.scale_group

    def scale_geometry(self, tokens: int, hidden: int,
                       group_size: int = 0) -> tuple[tuple[int, int], tuple[int, int], int]:
        """scale_out's (shape, strides, elements of its storage), padding included, as the
        kernel's ``scale_geometry`` (quant_outputs.h); ``group_size``: the call's."""
        padded = _round_up(tokens, self.scale_row_align)
        cols = 1 if self.scale_group == 0 else (
            _round_up(hidden // self.span(hidden, group_size), self.scale_col_align)
            // self.scale_pack)
        if self.scale_order == "column_major":
            return (tokens, cols), (1, padded), (cols - 1) * padded + tokens if cols else 0
        return (padded, cols), (cols, 1), padded * cols

    def scale_shape(self, tokens: int, hidden: int,
                    group_size: int = 0) -> tuple[int, int] | None:
        """scale_out's shape, padding included (``None``: not made)."""
        if self.scale_dtype is None:
            return None
        return self.scale_geometry(tokens, hidden, group_size)[0]

    def problem(self, dtype: str, hidden: int, group_size: int | None = None) -> str:
        """Why rows of ``hidden`` elements of ``dtype`` cannot be quantised so ("" when they
        can): the one copy of this rule, which the spec, the call checks and the kernels'
        fast paths (tested against it) all apply. ``group_size``: the call's (None: whether
        some group size fits)."""
        if dtype == "fp32" and not self.fp32:
            return f"quant={self.quant!r} needs dtype bf16 or fp16, not fp32"
        if self.grouped:
            if group_size is None:  # some call's group size can divide hidden
                if hidden % min(GROUP_SIZES):
                    return (f"quant={self.quant!r} needs hidden a multiple of a group size "
                            f"({GROUP_SIZES_TEXT}), got hidden={hidden}")
            elif group_size not in GROUP_SIZES or hidden % group_size:
                return (f"group_size={group_size!r} is not valid for quant={self.quant!r} with "
                        f"hidden_dim={hidden}; use one of {GROUP_SIZES_TEXT} dividing "
                        "hidden_dim")
            return ""
        if hidden % self.block:
            return (f"quant={self.quant!r} needs hidden a multiple of {self.block}, "
                    f"got hidden={hidden}")
        return ""


QUANT_OUTPUTS: tuple[QuantOutput, ...] = tuple(
    QuantOutput.of_row(row) for row in ctables.table("quant_outputs.h", "kQuantOutputs"))
"""Every quantised output, ``none`` first."""
OUTPUTS: dict[tuple[str | None, str | None], int] = {(o.quant, o.layout): o.code
                                                     for o in QUANT_OUTPUTS}
"""(quant, layout) -> output code."""


OUTPUT_OF_CODE: dict[int, QuantOutput] = {o.code: o for o in QUANT_OUTPUTS}
"""Output code -> its row (the kernels' codes, which a checked call's numbers carry)."""


def quant_output_of_code(code: object, name: str = "quant") -> QuantOutput:
    """The row of output code ``code``; another value raises ``ValueError`` naming ``name``."""
    for output in QUANT_OUTPUTS:
        if code == output.code and not isinstance(code, bool):
            return output
    allowed = ", ".join(f"{o.code} ({o.quant or 'none'}{' ' + o.layout if o.layout else ''})"
                        for o in QUANT_OUTPUTS)
    raise ValueError(f"{name}={code!r} is not the code of a quantised output; use one of "
                     f"{allowed}")


@functools.cache
def output_code(quant: str | None, layout: str | None = None) -> int:
    """The code of the output ``quant`` names (with ``layout`` where its rows differ in it):
    the one code the shm kernel takes."""
    return quant_output(quant, layout).code


def quant_output(quant: str | None, layout: str | None = None) -> QuantOutput:
    """The row that ``quant`` names (with ``layout`` where its rows differ in it; ``None``:
    the quant's default, its first row)."""
    rows = [o for o in QUANT_OUTPUTS if o.quant == quant]
    if not rows:
        raise ValueError(f"quant={quant!r} is not valid; use one of "
                         + ", ".join(dict.fromkeys(str(o.quant or "none")
                                                   for o in QUANT_OUTPUTS)))
    if layout is None:
        return rows[0]  # the quant's default: its first row
    for output in rows:
        if output.layout is None or output.layout == layout:
            return output
    raise ValueError(f"layout={layout!r} is not valid for quant={quant!r}; use one of "
                     + ", ".join(str(o.layout) for o in rows))
REDUCTION_SHIFT = int(_S["kReductionShift"])
_EPILOGUE_SHIFT = int(_S["kEpilogueShift"])
_EPILOGUE_TEXT = {"none": "", "rmsnorm": " + RMSNorm", "residual_rmsnorm": " + residual + RMSNorm"}
_REDUCTION_TEXT = {"all_reduce": "all-reduce",
                   "moe_reduce": "MoE expert reduction + all-reduce",
                   "moe_finalize": "MoE finalize + all-reduce"}


@dataclass(frozen=True, slots=True)
class Pattern:
    """One fused pattern. ``quant`` and ``layout`` name a row of ``QUANT_OUTPUTS`` (``None``:
    no quantised output; ``layout`` ``None`` for a quant with several rows: its first). A
    per-token-group output's group size is the call's, not the pattern's (the signature
    carries it)."""

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
        if self.layout is None and (self.quant, None) not in OUTPUTS:
            # a quant with several layouts: its default, the first row (ValueError: no quant)
            object.__setattr__(self, "layout", quant_output(self.quant, None).layout)
        if (self.quant, self.layout) not in OUTPUTS:
            raise ValueError(f"quant={self.quant!r} with layout={self.layout!r} is not a "
                             "quantised output; use " + ", ".join(
                                 f"({q!r}, {lay!r})" for q, lay in OUTPUTS))

    @classmethod
    @functools.cache  # every call asks for its pattern; few patterns exist
    def of_call(cls, norm: bool, residual: bool, quant: str | None,
                layout: str | None, reduction: str = "all_reduce") -> Pattern:
        """The pattern of a call with (``norm``: a weight was given) and ``residual``,
        quantised as ``quant`` (with its scale ``layout``; ``None``: the quant's default)."""
        epilogue = "none" if not norm else "residual_rmsnorm" if residual else "rmsnorm"
        return cls(epilogue, quant, quant_output(quant, layout).layout, reduction)

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
    def output(self) -> QuantOutput:
        """Its quantised output's row (``none`` when not quantised)."""
        return quant_output(self.quant, self.layout)

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
        """Short and unique: ``residual_rmsnorm+nvfp4_linear``, ``allreduce`` (alone): a
        layout by its first word, or whole where that word is another layout's of its quant
        (``fp8_group_fp32``, ``fp8_group_fp32_column_major``)."""
        parts = [] if self.reduction == "all_reduce" else [self.reduction]
        parts.append("allreduce" if self.epilogue == "none" else self.epilogue)
        if self.quant is not None:
            parts.append(self.quant + ("" if self.layout is None
                                       else "_" + _layout_word(self.quant, self.layout)))
        return "+".join(parts)

    def describe(self) -> str:
        """``all-reduce + residual + RMSNorm + nvfp4 (linear)``."""
        text = _REDUCTION_TEXT[self.reduction] + _EPILOGUE_TEXT[self.epilogue]
        if self.quant is not None:
            text += f" + {self.quant}" + (f" ({self.layout})" if self.layout else "")
        return text


K = TypeVar("K")


def _layout_word(quant: str, layout: str) -> str:
    first = layout.split("_")[0]
    others = [o.layout for o in QUANT_OUTPUTS if o.quant == quant and o.layout != layout]
    return layout if any(str(o).split("_")[0] == first for o in others) else first


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
