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

* FP8 per token and group (``fp8_group``, docs/design.md 3.6): ``fp8_group_quantize``.

Inputs are the values already rounded to the activation dtype, as in FlashInfer. CUDA kernels
built with fast-math may differ from these exact-IEEE rules by one ulp in rare ties.
"""

from __future__ import annotations

import torch

from . import ctables
from .pattern import DEFAULT_GROUP_SIZE, quant_output
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


FP8_GROUP_EPS = torch.tensor(ctables.float_constant("signature.h", "kFp8GroupEps"),
                             dtype=torch.float32).item()
"""fp8_group's eps (1e-10 as float32), vLLM's and FlashInfer's."""


def _amax_ignoring_nan(values: torch.Tensor) -> torch.Tensor:
    magnitude = values.abs()
    return torch.where(torch.isnan(magnitude), torch.zeros_like(magnitude),
                       magnitude).amax(dim=-1)


def fp8_group_scales(amax: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 group amaxes -> (the fp32 scales, their UE8M0 exponent bytes as int32): for
    ``fp32`` and ``fp32_column_major`` ``max(amax, eps) / 448`` (vLLM's
    ``per_token_group_quant_fp8``); for ``ue8m0_packed`` ``s = max(amax / 448, eps)`` rounded
    up to a power of two by its bits (FlashInfer's ``compute_ue8m0_scale``: mantissa bits
    set -> exponent + 1, mantissa cleared). Each step one fp32 operation."""
    fp8_max = torch.tensor(FP8_MAX, dtype=torch.float32, device=amax.device)
    if layout != "ue8m0_packed":
        scale = torch.clamp_min(amax, FP8_GROUP_EPS) / fp8_max
        return scale, (scale.view(torch.int32) >> 23) & 0xFF
    bits = torch.clamp_min(amax / fp8_max, FP8_GROUP_EPS).view(torch.int32)
    bits = torch.where((bits & 0x7FFFFF) != 0, (bits + 0x800000) & 0x7F800000, bits)
    return bits.view(torch.float32), (bits >> 23) & 0xFF


def fp8_group_quantize(x: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                       layout: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and group of ``group_size`` columns: amax of ``f32(x)`` over the group (a
    NaN does not count), its scale (``fp8_group_scales``), ``q = e4m3(x / scale)`` (an IEEE
    division, nearest-even, saturating). Returns codes ``[T, H]`` and ``scale_out`` in
    ``layout``: ``fp32`` float32 ``[T, H/g]``; ``fp32_column_major`` the same values with
    strides ``(1, T)``; ``ue8m0_packed`` int32 ``[T, ceil(G/4)]`` with strides
    ``(1, ceil(T/4)*4)``, the exponent byte of group j in byte ``j % 4`` of word ``j / 4``
    (little-endian), padding bytes zero (FlashInfer's patterns 8/9)."""
    made = quant_output("fp8_group", layout)  # a layout of fp8_group's, or ValueError
    tokens, hidden = x.shape
    if made.problem("fp32", hidden, group_size):
        raise ValueError(made.problem("fp32", hidden, group_size))
    groups = hidden // group_size
    values = x.float().reshape(tokens, groups, group_size)
    scale, exponent = fp8_group_scales(_amax_ignoring_nan(values), layout)
    codes = to_e4m3(values / scale.unsqueeze(-1)).reshape(tokens, hidden)
    shape, strides, storage = made.scale_geometry(tokens, hidden, group_size)
    if layout == "fp32":
        return codes, scale
    if layout == "fp32_column_major":
        flat = torch.empty(storage, dtype=torch.float32, device=x.device)
        out = torch.as_strided(flat, shape, strides)
        out.copy_(scale)
        return codes, out
    padded, packs = strides[1], shape[1]
    words = torch.zeros(max(packs * padded, 1), 4, dtype=torch.uint8, device=x.device)
    by_pack = torch.zeros(tokens, packs * 4, dtype=torch.uint8, device=x.device)
    by_pack[:, :groups] = exponent.to(torch.uint8)
    words.view(packs, padded, 4)[:, :tokens] = by_pack.view(tokens, packs, 4).transpose(0, 1)
    flat = words.view(torch.int32).view(-1)[:max(storage, 1)]
    return codes, torch.as_strided(flat, shape, strides)


def fp8_group_scale_values(scale_out: torch.Tensor, groups: int) -> torch.Tensor:
    """fp8_group's ``scale_out`` in any layout -> float32 ``[T, groups]`` (a UE8M0 byte e is
    ``2^(e - 127)``; 0xff is +inf)."""
    if scale_out.dtype == torch.float32:
        return scale_out.contiguous()
    tokens = scale_out.shape[0]
    exponents = torch.stack([((scale_out >> (8 * byte)) & 0xFF) for byte in range(4)], dim=-1)
    exponents = exponents.reshape(tokens, -1)[:, :groups]
    return (exponents.to(torch.int32) << 23).view(torch.float32)


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

