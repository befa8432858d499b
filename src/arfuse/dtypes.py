"""The one table of activation dtypes: canonical name, element size, torch's name, kernel code.

Pure (no torch import): the spec and the policy use it as data; ``torch_types`` maps the names to
``torch.dtype`` values; the code is the kernels' (``arfuse/csrc/signature.h``), which call
signatures carry.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import ctables


@dataclass(frozen=True)
class DType:
    name: str          # canonical: bf16, fp16, fp32
    size: int          # bytes per element
    torch_name: str    # attribute of the torch module
    code: int          # the kernel's code (arfuse/csrc/signature.h)
    aliases: tuple[str, ...] = ()


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("bf16", 2, "bfloat16", ctables.int_constant("signature.h", "kBF16"), ("bfloat16",)),
    DType("fp16", 2, "float16", ctables.int_constant("signature.h", "kFP16"),
          ("float16", "half")),
    DType("fp32", 4, "float32", ctables.int_constant("signature.h", "kFP32"),
          ("float32", "float")),
)}
_BY_ALIAS: dict[str, str] = {alias: d.name for d in DTYPES.values()
                             for alias in (d.name, *d.aliases)}


def parse_dtype(value: object, name: str = "dtype") -> str:
    """Canonical name (``bf16``, ``fp16``, ``fp32``) of a dtype given by name or ``torch.dtype``."""
    text = str(value).strip().lower().removeprefix("torch.")
    if text not in _BY_ALIAS:
        raise ValueError(
            f"{name}={value!r} is not supported; use bf16, fp16 or fp32 "
            "(or torch.bfloat16, torch.float16, torch.float32)"
        )
    return _BY_ALIAS[text]
