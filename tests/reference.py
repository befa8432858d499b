"""An independent float64 reference and independent quantisers, written apart from arfuse's own
code (element-wise loops over the e2m1 table, offsets from the layout formula) so that a bug in
``arfuse.quant`` or ``arfuse.epilogue`` cannot hide behind itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from arfuse.pattern import Pattern
from arfuse.reference import expected

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@dataclass(frozen=True)
class Case:
    dtype: str
    tokens: int
    hidden: int
    pattern: str  # plain | norm | norm_bias | fp8 | nvfp4_linear | nvfp4_swizzled
    residual: bool = True

    @property
    def weight_bias(self) -> float:
        return 1.0 if self.pattern == "norm_bias" else 0.0

    @property
    def quant(self) -> str | None:
        if self.pattern == "fp8":
            return "fp8"
        return "nvfp4" if self.pattern.startswith("nvfp4") else None

    @property
    def layout(self) -> str:
        return "linear" if self.pattern == "nvfp4_linear" else "swizzled_128x4"

    @property
    def fused(self) -> Pattern:
        return Pattern.of_call(self.pattern != "plain", self.residual, self.quant, self.layout)


PATTERNS = ("plain", "norm", "norm_bias", "fp8", "nvfp4_linear", "nvfp4_swizzled")
EPS = 1e-5
FP8_SCALE = 0.0625  # dequantisation scale: values up to ~28 fit e4m3 without saturating much
NVFP4_SCALE = 448.0 * 6.0 / 8.0  # global encode scale for |values| up to ~8


def inputs(case: Case, world: int, seed: int = 1234) -> dict[str, Any]:
    """Every rank's input plus the shared residual and weight, the same in every process."""
    gen = torch.Generator().manual_seed(seed + 7919 * case.tokens + 31 * case.hidden)
    dtype = DTYPES[case.dtype]
    xs = [(torch.randn(case.tokens, case.hidden, generator=gen) * (r + 1) * 0.5).to(dtype)
          for r in range(world)]
    residual = torch.randn(case.tokens, case.hidden, generator=gen).to(dtype)
    weight = (torch.rand(case.hidden, generator=gen) * 1.5 + 0.25).to(dtype)
    return {"xs": xs, "residual": residual, "weight": weight}


def reference(case: Case, data: dict[str, Any]) -> dict[str, torch.Tensor]:
    """float64, no intermediate rounding (``arfuse.reference``)."""
    want = expected(data["xs"], case.fused, data["residual"], data["weight"], EPS,
                    case.weight_bias)
    if case.pattern == "plain":
        return {"out": want.out, "abs_sum": want.abs_sum}
    return {"out": want.out, "residual_out": want.residual_out, "sum": want.sum,
            "abs_sum": want.abs_sum}


def ulp_eps(dtype: str) -> float:
    return {"bf16": 2.0**-7, "fp16": 2.0**-10, "fp32": 2.0**-23}[dtype]


def fp8_codes_independent(values: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3 by search over the finite codes of the value's sign (float64): nearest, ties to
    the even code, saturating at 448; the sign of zero is kept."""
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    codes = torch.arange(256)
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)
    v = (values.float() * inv).double().flatten()  # the product is an fp32 one, as in the kernels
    negative = torch.signbit(v)
    mag = v.abs().clamp(max=448.0)
    candidates = torch.isfinite(table) & (torch.signbit(table) == False)  # noqa: E712
    pos_codes, pos_vals = codes[candidates], table[candidates]
    dist = (mag[:, None] - pos_vals[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    tie = dist == best
    prefer_even = torch.where(tie & ((pos_codes[None, :] & 1) == 0), 2, tie.int())
    picked = pos_codes[prefer_even.argmax(dim=1)]
    return (picked | (negative.long() << 7)).to(torch.uint8).view(values.shape)


def nvfp4_independent(values: torch.Tensor, global_scale: float) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """(codes [T, H] uint8 unpacked, scale bytes [T, H/16]) by the written rules, element-wise."""
    t, h = values.shape
    vals = values.float()
    codes = torch.zeros((t, h), dtype=torch.uint8)
    sfs = torch.zeros((t, h // 16), dtype=torch.uint8)
    gs = torch.tensor(global_scale, dtype=torch.float32)
    sixth = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(6.0, dtype=torch.float32)
    for row in range(t):
        for blk in range(h // 16):
            block = vals[row, blk * 16:(blk + 1) * 16]
            amax = block.abs().max()
            sf_f = gs * (amax * sixth)
            sf_byte = sf_f.clamp(max=448.0).to(torch.float8_e4m3fn)
            sfs[row, blk] = sf_byte.view(torch.uint8)
            sf_q = sf_byte.float()
            es = gs / sf_q if sf_q.item() != 0 else torch.tensor(0.0)
            for i in range(16):
                v = float((block[i] * es).item())
                mag = min(abs(v), 6.0)
                best = min(range(8), key=lambda k: (abs(E2M1[k] - mag), k % 2))
                code = best | (8 if math.copysign(1.0, v) < 0 else 0)
                codes[row, blk * 16 + i] = code
    return codes, sfs


def swizzle_offset(m: int, k: int, cols: int) -> int:
    """The 128x4 layout's byte offset, straight from the formula."""
    k_tiles = (cols + 3) // 4
    return (m // 128) * k_tiles * 512 + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 \
        + (k % 4)


