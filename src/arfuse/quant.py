"""FP8 and NVFP4 formats with FlashInfer's all-reduce-fusion semantics, in plain torch.

The rules (FlashInfer 0.6.13, ``trtllm_allreduce_fusion.cuh`` / ``quantization_utils.cuh``):

* FP8 (e4m3): ``scale`` is the *dequantisation* scale: ``q = e4m3(x * (1/scale))``, the
  reciprocal taken once in fp32, round-to-nearest-even, saturating to +-448.
* NVFP4: blocks of 16 along a row; ``scale`` is the *global encode* scale (typically
  ``448*6/amax``) and is multiplied: ``sf = e4m3(scale * (amax * f32(1/6)))``; element scale
  ``scale / sf`` (0 when ``sf`` rounds to 0); values rounded to e2m1 {0,.5,1,1.5,2,3,4,6}
  nearest-even, saturating to +-6; two codes per byte, the even element in the low nibble.
  Block scales are e4m3 bytes in the ``linear`` ``[T, H/16]`` or the ``swizzled_128x4``
  layout ``[round_up(T,128), round_up(H/16,4)]`` (padding zero).

Inputs are the values already rounded to the activation dtype, as in FlashInfer. CUDA kernels
built with fast-math may differ from these exact-IEEE rules by one ulp in rare ties.
"""

from __future__ import annotations

import torch

from .pattern import quant_output
from .sizing import round_up
from .spec import NVFP4_BLOCK

FP8_MAX = 448.0
_SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()  # f32(1/6), as the kernels use
# Magnitude code thresholds: code = number of thresholds passed. Ties go to the even code,
# hence alternating strict (>) and non-strict (>=) comparisons.
_E2M1_STRICT = (0.25, 1.25, 2.5, 5.0)
_E2M1_LOOSE = (0.75, 1.75, 3.5)


def to_e4m3(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, nearest-even, saturating (torch's cast alone does not saturate)."""
    return values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``e4m3(x * (1/scale))`` with ``scale`` the dequantisation scale."""
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)
    return to_e4m3(x.float() * inv.to(x.device))


FP8_DYNAMIC_MIN_SCALE = torch.tensor(1.0 / (512.0 * 448.0), dtype=torch.float32).item()


def fp8_dynamic_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8: ``scale = max(amax / 448, 1 / (512 * 448))`` per row in fp32 (a NaN does
    not count towards the amax, as ``fmaxf`` drops it), ``q = e4m3(x / scale)`` (a division,
    nearest-even, saturating). Returns codes ``[T, H]`` and the dequantisation scales
    ``[T, 1]`` float32 (FlashInfer's patterns 10/11; its fast-math division may differ by an
    ulp in rare ties)."""
    values = x.float()
    magnitude = values.abs()
    amax = torch.where(torch.isnan(magnitude), torch.zeros_like(magnitude),
                       magnitude).amax(dim=-1, keepdim=True)
    scale = torch.clamp_min(amax / torch.tensor(FP8_MAX, dtype=torch.float32),
                            FP8_DYNAMIC_MIN_SCALE)
    return to_e4m3(values / scale), scale


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit e2m1 codes (uint8 0..15), nearest-even, saturating to +-6."""
    mag = values.abs()
    code = torch.zeros(values.shape, dtype=torch.uint8, device=values.device)
    for threshold in _E2M1_STRICT:
        code += (mag > threshold).to(torch.uint8)
    for threshold in _E2M1_LOOSE:
        code += (mag >= threshold).to(torch.uint8)
    return code | (torch.signbit(values).to(torch.uint8) << 3)


def nvfp4_quantize(x: torch.Tensor, global_scale: float,
                   layout: str = "swizzled_128x4") -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, H]`` -> (packed codes ``[T, H/2]`` uint8, block scales uint8 in ``layout``).

    NaN and infinities follow FlashInfer (``cvt_warp_fp16_to_fp4`` in
    ``trtllm_allreduce_fusion.cuh``): the block amax ignores NaN, as ``__hmax2``/``__hmax`` do
    (it is NaN only when all 16 values are, and the block scale is then the e4m3 NaN 0x7f);
    an infinity saturates the block scale to 448; the e2m1 conversion
    (``cvt.rn.satfinite.e2m1x2.f32``) saturates +-inf to +-6 and turns NaN into +6 (code 7,
    sign dropped), since e2m1 has no NaN."""
    quant_output("nvfp4", layout)  # a layout of nvfp4's, or ValueError naming layout
    tokens, hidden = x.shape
    if hidden % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 needs hidden a multiple of {NVFP4_BLOCK}, got {hidden}")
    gs = torch.tensor(global_scale, dtype=torch.float32, device=x.device)
    blocks = x.float().reshape(tokens, hidden // NVFP4_BLOCK, NVFP4_BLOCK)
    magnitude = blocks.abs()
    nan = magnitude.isnan()
    amax = magnitude.masked_fill(nan, 0.0).amax(dim=-1, keepdim=True)
    amax = amax.masked_fill(nan.all(dim=-1, keepdim=True), float("nan"))
    sf = to_e4m3(gs * (amax * _SIXTH))
    sf_f = sf.float()
    elem_scale = torch.where(sf_f != 0, gs / sf_f, torch.zeros_like(sf_f))
    scaled = blocks * elem_scale
    codes = e2m1_codes(scaled).masked_fill(scaled.isnan(), 7).reshape(tokens, hidden)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = sf.reshape(tokens, hidden // NVFP4_BLOCK).view(torch.uint8)
    return packed, (swizzle_128x4(scales) if layout == "swizzled_128x4" else scales)


def swizzle_128x4(linear: torch.Tensor) -> torch.Tensor:
    """Linear ``[T, K]`` scale bytes -> the ``[round_up(T,128), round_up(K,4)]`` swizzled tile
    layout: ``offset = (m//128)*Kp*128 + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4``."""
    rows, cols = linear.shape
    rows_p, cols_p = round_up(rows, 128), round_up(cols, 4)
    padded = torch.zeros((rows_p, cols_p), dtype=linear.dtype, device=linear.device)
    padded[:rows, :cols] = linear
    tiles = padded.view(rows_p // 128, 4, 32, cols_p // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(rows_p, cols_p)

