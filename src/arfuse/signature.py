"""The call signature (R11): two int64 words that say what one call is, compared across ranks
before any rank reads a peer's data.

``word 0``: tokens, the pattern's code, the mode (one-shot or two-shot) and the dtype, and for
the MoE patterns their fan-in (top_k, or the experts of a reduction), whether a shared expert
is given and a digest of the expanded rows and the routed scaling factor (``moe_bits``);
``word 1``: the hidden size, the op (the group's construction count, the same on every
rank), so calls of two ops never pair, and a per-token-group output's group size. The
numbers are the kernels' (``arfuse/csrc/signature.h``, read by ``arfuse.ctables``). The shm
kernel writes these words itself; the pure-torch shm path and the torch backend write them
here, and all three describe a mismatch in the same text (this module's twin is
``describe_signature`` / ``mismatch_message`` in the shm kernel's ``protocol.cpp``; a
contract test compares them).
"""

from __future__ import annotations

import functools

from . import ctables
from .pattern import GROUP_UNIT, Pattern, group_code

_S = ctables.header("signature.h")
TOKENS_SHIFT = int(_S["kTokensShift"])
PATTERN_SHIFT = int(_S["kPatternShift"])
PATTERN_BITS = int(_S["kPatternBits"])
MODE_SHIFT = int(_S["kModeShift"])
DTYPE_SHIFT = int(_S["kDtypeShift"])
OP_SHIFT = int(_S["kOpShift"])
MAX_HIDDEN = int(_S["kMaxHidden"])
MAX_OP = int(_S["kMaxOp"])
GROUP_SHIFT = int(_S["kGroupShift"])
GROUP_BITS = int(_S["kGroupBits"])
MOE_FAN_IN_SHIFT = int(_S["kMoeFanInShift"])
MOE_FAN_IN_BITS = int(_S["kMoeFanInBits"])
MOE_SHARED_SHIFT = int(_S["kMoeSharedShift"])
MOE_DIGEST_SHIFT = int(_S["kMoeDigestShift"])
MOE_DIGEST_BITS = int(_S["kMoeDigestBits"])
MAX_MOE_FAN_IN = int(_S["kMaxMoeFanIn"])
_MOE_ROWS_MUL = int(_S["kMoeDigestRowsMul"])
_MOE_ROUTED_MUL = int(_S["kMoeDigestRoutedMul"])
_MASK32 = 0xFFFFFFFF

_DTYPE_NAMES = ("bf16", "fp16", "fp32")
_EPILOGUE_NAMES = {"none": "plain", "rmsnorm": "norm", "residual_rmsnorm": "norm+residual"}
_REDUCTION_PREFIX = {"all_reduce": "", "moe_reduce": "moe_reduce+",
                     "moe_finalize": "moe_finalize+"}
_FIELDS = ("tokens", "dtype", "hidden", "pattern", "quant", "layout", "group_size", "mode", "op",
           "fan_in",
           "shared_expert_output", "expanded rows or routed_scaling_factor")


def _signed(word: int) -> int:
    word &= (1 << 64) - 1
    return word - (1 << 64) if word >= 1 << 63 else word


def moe_bits(fan_in: int, shared: bool, rows: int, routed_scaling_bits: int) -> int:
    """The MoE fields of word 0: ``fan_in`` (top_k, or the experts of a reduction; at most
    ``MAX_MOE_FAN_IN``), whether a shared expert is given, and a 10-bit digest of the expanded
    rows and the routed scaling factor's fp32 bits (ranks that differ there fail but for a
    chance of 1 in 1024; the other fields are exact)."""
    mixed = ((rows * _MOE_ROWS_MUL ^ routed_scaling_bits * _MOE_ROUTED_MUL) & (2**64 - 1))
    digest = (mixed >> (64 - MOE_DIGEST_BITS)) & ((1 << MOE_DIGEST_BITS) - 1)
    return (fan_in << MOE_FAN_IN_SHIFT | int(shared) << MOE_SHARED_SHIFT
            | digest << MOE_DIGEST_SHIFT)


@functools.lru_cache(maxsize=4096)  # every call computes its words; decode repeats them
def words(tokens: int, dtype_code: int, hidden: int, pattern: int, twoshot: bool = False,
          op: int = 0, moe: int = 0, group_size: int = 0) -> tuple[int, int]:
    """The two words of a call, as signed int64 like the segment holds them (``moe``: the
    MoE fields, ``moe_bits``; ``group_size``: a per-token-group output's, else 0)."""
    word0 = ((tokens & _MASK32) << TOKENS_SHIFT | pattern << PATTERN_SHIFT
             | int(twoshot) << MODE_SHIFT | dtype_code << DTYPE_SHIFT | moe)
    return _signed(word0), _signed((hidden & _MASK32) | (op & MAX_OP) << OP_SHIFT
                                   | group_code(group_size) << GROUP_SHIFT)


def _fields(word0: int, word1: int) -> tuple[object, ...]:
    """(tokens, dtype, hidden, pattern, quant, layout, group_size, mode, op, fan_in, shared,
    digest) of a signature, as its text names them (a pattern code that is none gives ``?``;
    group_size 0: none)."""
    word0 &= (1 << 64) - 1
    word1 &= (1 << 64) - 1
    code = (word0 >> PATTERN_SHIFT) & ((1 << PATTERN_BITS) - 1)
    try:
        pattern: Pattern | None = Pattern.from_code(code)
    except ValueError:
        pattern = None
    dtype = (word0 >> DTYPE_SHIFT) & 3
    code_of_group = (word1 >> GROUP_SHIFT) & ((1 << GROUP_BITS) - 1)
    return ((word0 >> TOKENS_SHIFT) & _MASK32,
            _DTYPE_NAMES[dtype] if dtype < len(_DTYPE_NAMES) else "?",
            word1 & _MASK32,
            "?" if pattern is None else (_REDUCTION_PREFIX[pattern.reduction]
                                         + _EPILOGUE_NAMES[pattern.epilogue]),
            "?" if pattern is None else pattern.quant or "none",
            "?" if pattern is None else pattern.layout or "",
            GROUP_UNIT << code_of_group if code_of_group else 0,
            "twoshot" if (word0 >> MODE_SHIFT) & 1 else "oneshot",
            (word1 >> OP_SHIFT) & MAX_OP,
            (word0 >> MOE_FAN_IN_SHIFT) & MAX_MOE_FAN_IN,
            (word0 >> MOE_SHARED_SHIFT) & 1,
            (word0 >> MOE_DIGEST_SHIFT) & ((1 << MOE_DIGEST_BITS) - 1))


def describe(word0: int, word1: int) -> str:
    """``tokens=1 dtype=fp32 hidden=64 pattern=plain quant=none mode=oneshot op=3``; a MoE
    pattern adds ``top_k=8`` (``experts=`` for a reduction), ``shared=`` and ``rows_digest=``;
    a per-token-group output ``group_size=128``."""
    tokens, dtype, hidden, pattern, quant, layout, group, mode, op, fan_in, shared, digest = \
        _fields(word0, word1)
    text = f"tokens={tokens} dtype={dtype} hidden={hidden} pattern={pattern} quant={quant}"
    if layout and layout != "?":
        text += f" layout={layout}"
    if group:
        text += f" group_size={group}"
    text += f" mode={mode} op={op}"
    if isinstance(pattern, str) and pattern.startswith("moe_"):
        text += (f" {'top_k' if pattern.startswith('moe_finalize') else 'experts'}={fan_in}"
                 f" shared={shared} rows_digest={digest:#x}")
    return text


def mismatch_message(backend: str, call: int, signatures: list[tuple[int, int]]) -> str:
    """The ``MismatchedCall`` text for one signature per rank (the kernel's, word for word,
    for ``backend`` shm)."""
    fields = [_fields(*pair) for pair in signatures]
    differ = [name for i, name in enumerate(_FIELDS) if len({f[i] for f in fields}) > 1]
    if "fan_in" in differ:
        finalize = any(str(f[3]).startswith("moe_finalize") for f in fields)
        differ[differ.index("fan_in")] = "top_k" if finalize else "experts"
    ranks = "".join(f"; rank {r}: {describe(*pair)}" for r, pair in enumerate(signatures))
    return (f"arfuse {backend}: the ranks of the group called with different arguments (call "
            f"{call}; every rank raises this before any rank reads a peer's data, so the "
            f"workspace stays usable for calls that match): they differ in "
            f"{', '.join(differ)}{ranks}")
