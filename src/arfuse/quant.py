"""The quantised outputs in plain torch, by their rows' scale rules (``csrc/quant_outputs.h``).

``quantize`` makes any output of the table from ``out`` (the values already rounded to the
activation dtype) with the kernel's bytes: the rule says how the codes and each span's scale are
made (every step one fp32 operation; e4m3 and e2m1 rounded to nearest even and saturating), the
row where the scales go (``place_scales``). The rules follow FlashInfer's all-reduce fusion
(0.6.13, ``trtllm_allreduce_fusion.cuh`` / ``quantization_utils.cuh``) and vLLM's
``per_token_group_quant_fp8``:

* ``static`` (fp8): ``scale`` is the *dequantisation* scale: ``q = e4m3(x * (1/scale))``, the
  reciprocal taken once in fp32.
* ``amax_over_max`` (fp8_dynamic), ``floor_over_max`` and ``power_of_two`` (fp8_group's fp32
  and UE8M0 formats): a scale per span of the row from its amax (NaN ignored, as ``fmaxf``
  drops it) and the row's floor; ``q = e4m3(x / s)``.
* ``encode_block`` (NVFP4): blocks of 16; ``scale`` is the *global encode* scale (typically
  ``448*6/amax``) and is multiplied: ``sf = e4m3(scale * (amax * f32(1/6)))``; element scale
  ``scale / sf`` (0 when ``sf`` rounds to 0); values rounded to e2m1 {0,.5,1,1.5,2,3,4,6},
  two codes per byte, the even element in the low nibble. NaN follows FlashInfer
  (``cvt_warp_fp16_to_fp4``): the block amax ignores NaN, as ``__hmax2`` does (it is NaN only
  when all 16 are, and the block scale is then the e4m3 NaN 0x7f); an infinity saturates the
  block scale to 448; the e2m1 conversion saturates +-inf to +-6 and turns NaN into +6.

CUDA kernels built with fast-math may differ from these exact-IEEE rules by one ulp in rare ties.
"""

from __future__ import annotations

import torch

from .pattern import (
    DEFAULT_GROUP_SIZE,
    E2M1_MAX,
    E2M1_THRESHOLDS,
    E4M3_MAX,
    SWIZZLE_TILE,
    QuantOutput,
    quant_output,
)

FP8_MAX = E4M3_MAX
"""The largest finite e4m3 (``kE4m3Max``)."""


def f32(value: float) -> float:
    """``value`` rounded to float32 (as the kernels take a double constant)."""
    return torch.tensor(value, dtype=torch.float32).item()


_SIXTH = f32(1.0 / E2M1_MAX)  # f32(1/6), as the kernels use
_E2M1_NAN_CODE = len(E2M1_THRESHOLDS)  # +6: a NaN's code (e2m1 has no NaN)
FP8_DYNAMIC_MIN_SCALE = f32(quant_output("fp8_dynamic").floor)
FP8_GROUP_EPS = f32(quant_output("fp8_group").floor)
"""fp8_group's eps (1e-10 as float32), vLLM's and FlashInfer's."""


def to_e4m3(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, nearest-even, saturating (torch's cast alone does not saturate)."""
    return values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit e2m1 codes (uint8 0..15), nearest-even, saturating to +-6."""
    mag = values.abs()
    code = torch.zeros(values.shape, dtype=torch.uint8, device=values.device)
    for threshold, strict in E2M1_THRESHOLDS:
        code += (mag > threshold if strict else mag >= threshold).to(torch.uint8)
    return code | (torch.signbit(values).to(torch.uint8) << 3)


def amax_ignoring_nan(values: torch.Tensor) -> torch.Tensor:
    """The largest magnitude along the last dimension, a NaN not counting (0 when all are)."""
    magnitude = values.abs()
    return torch.where(torch.isnan(magnitude), torch.zeros_like(magnitude),
                       magnitude).amax(dim=-1)


def quantize(out: torch.Tensor, output: QuantOutput, scale: float | None,
             group_size: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``out`` ``[T, H]`` -> (quant_out, scale_out) as ``output``'s row says (None where the
    row makes none); ``scale``: the caller's (rules ``static`` and ``encode_block``);
    ``group_size``: the call's (0: the default of a row with groups)."""
    if output.rule == "none":
        return None, None
    if output.scale_in != "none" and scale is None:
        raise ValueError(f"quant={output.quant!r} needs scale")
    tokens, hidden = out.shape
    group_size = group_size or (DEFAULT_GROUP_SIZE if output.grouped else 0)
    problem = output.problem("bf16", hidden, group_size if output.grouped else None)
    if problem:
        raise ValueError(problem)
    values = out.float()
    if output.rule == "static":
        assert scale is not None
        inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)
        return to_e4m3(values * inv.to(out.device)), None
    span = output.span(hidden, group_size)
    spans = values.reshape(tokens, hidden // span, span)
    if output.rule == "encode_block":
        assert scale is not None
        codes, stored = _encode_blocks(spans, scale)
    else:
        scales, stored = span_scales(output, amax_ignoring_nan(spans))
        codes = to_e4m3(spans / scales.unsqueeze(-1)).reshape(tokens, hidden)
        if output.scale_dtype == "float32":
            stored = scales
    return codes, place_scales(output, stored, tokens, hidden, group_size)


def span_scales(output: QuantOutput, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 span amaxes -> (the fp32 scales, their exponent bytes as uint8) by the row's rule,
    each step one fp32 operation (quant_outputs.h)."""
    fp8_max = torch.tensor(FP8_MAX, dtype=torch.float32, device=amax.device)
    floor = f32(output.floor)
    if output.rule == "amax_over_max":
        scale = torch.clamp_min(amax / fp8_max, floor)
    elif output.rule == "floor_over_max":
        scale = torch.clamp_min(amax, floor) / fp8_max
    elif output.rule == "power_of_two":
        bits = torch.clamp_min(amax / fp8_max, floor).view(torch.int32)
        bits = torch.where((bits & 0x7FFFFF) != 0, (bits + 0x800000) & 0x7F800000, bits)
        scale = bits.view(torch.float32)
    else:
        raise ValueError(f"rule {output.rule!r} makes no scale from an amax")
    return scale, ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def _encode_blocks(blocks: torch.Tensor, global_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The encode-block rule on fp32 ``[T, blocks, 16]``: packed e2m1 codes ``[T, H/2]`` and
    the e4m3 block scales' bytes ``[T, blocks]``."""
    tokens, count, size = blocks.shape
    gs = torch.tensor(global_scale, dtype=torch.float32, device=blocks.device)
    magnitude = blocks.abs()
    nan = magnitude.isnan()
    amax = magnitude.masked_fill(nan, 0.0).amax(dim=-1, keepdim=True)
    amax = amax.masked_fill(nan.all(dim=-1, keepdim=True), float("nan"))
    sf = to_e4m3(gs * (amax * _SIXTH))
    sf_f = sf.float()
    elem_scale = torch.where(sf_f != 0, gs / sf_f, torch.zeros_like(sf_f))
    scaled = blocks * elem_scale
    codes = e2m1_codes(scaled).masked_fill(scaled.isnan(), _E2M1_NAN_CODE)
    codes = codes.reshape(tokens, count * size)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, sf.reshape(tokens, count).view(torch.uint8)


def scale_elements(output: QuantOutput, tokens: int, spans: int, hidden: int,
                   group_size: int = 0) -> torch.Tensor:
    """``[T, spans]``: the element of scale_out that holds each scale (the kernel's
    ``scale_element``; a byte-wide one's byte is the span's index % ``scale_pack``)."""
    shape, strides, _ = output.scale_geometry(tokens, hidden, group_size)
    rows = torch.arange(tokens).unsqueeze(1)
    cols = (torch.arange(spans) // output.scale_pack).unsqueeze(0)
    if output.scale_order != "swizzled":
        return rows * strides[0] + cols * strides[1]
    tile_rows, tile_cols, stripe = SWIZZLE_TILE
    tile = tile_rows * tile_cols
    return ((rows // tile_rows) * (shape[1] // tile_cols) * tile + (cols // tile_cols) * tile
            + (rows % stripe) * (tile // stripe) + (rows % tile_rows) // stripe * tile_cols
            + cols % tile_cols)


def place_scales(output: QuantOutput, stored: torch.Tensor, tokens: int, hidden: int,
                 group_size: int = 0) -> torch.Tensor:
    """``[T, spans]`` float32 scales (a float32 scale_out) or scale bytes (a byte-wide one)
    -> scale_out in the row's dtype, shape, strides and order, padding zero."""
    shape, strides, storage = output.scale_geometry(tokens, hidden, group_size)
    spans = stored.shape[1]
    element = scale_elements(output, tokens, spans, hidden, group_size).to(stored.device)
    if output.scale_dtype == "float32":
        flat = torch.zeros(max(storage, 1), dtype=torch.float32, device=stored.device)
        flat[element.reshape(-1)] = stored.reshape(-1).to(torch.float32)
    else:
        pack = output.scale_pack
        raw = torch.zeros(max(storage, 1) * pack, dtype=torch.uint8, device=stored.device)
        byte = element * pack + (torch.arange(spans, device=stored.device) % pack)
        raw[byte.reshape(-1)] = stored.reshape(-1).to(torch.uint8)
        flat = raw.view(getattr(torch, str(output.scale_dtype)))
    return torch.as_strided(flat, shape, strides)


# The named forms, each one row's ``quantize`` (tests, the CLI's checks).

def fp8_quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``e4m3(x * (1/scale))`` with ``scale`` the dequantisation scale."""
    codes, _ = quantize(x, quant_output("fp8"), scale)
    assert codes is not None
    return codes


def fp8_dynamic_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8: codes ``[T, H]`` and the dequantisation scales ``[T, 1]`` float32."""
    codes, scales = quantize(x, quant_output("fp8_dynamic"), None)
    assert codes is not None and scales is not None
    return codes, scales


def fp8_group_quantize(x: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                       layout: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and group of ``group_size`` columns: codes ``[T, H]`` and ``scale_out`` in
    ``layout`` (``fp32`` ``[T, H/g]``; ``fp32_column_major`` strides ``(1, T)``;
    ``ue8m0_packed`` int32 ``[T, ceil(G/4)]``, strides ``(1, ceil(T/4)*4)``, the exponent
    byte of group j in byte ``j % 4`` of word ``j / 4``)."""
    codes, scales = quantize(x, quant_output("fp8_group", layout), None, group_size)
    assert codes is not None and scales is not None
    return codes, scales


def fp8_group_scale_values(scale_out: torch.Tensor, groups: int) -> torch.Tensor:
    """fp8_group's ``scale_out`` in any layout -> float32 ``[T, groups]``."""
    if scale_out.dtype == torch.float32:
        return scale_out.contiguous()
    tokens = scale_out.shape[0]
    exponents = torch.stack([((scale_out >> (8 * byte)) & 0xFF) for byte in range(4)], dim=-1)
    exponents = exponents.reshape(tokens, scale_out.shape[1] * 4)[:, :groups]
    return (exponents.to(torch.int32) << 23).view(torch.float32)


def nvfp4_quantize(x: torch.Tensor, global_scale: float,
                   layout: str = "swizzled_128x4") -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, H]`` -> (packed codes ``[T, H/2]`` uint8, block scales uint8 in ``layout``)."""
    codes, scales = quantize(x, quant_output("nvfp4", layout), global_scale)
    assert codes is not None and scales is not None
    return codes, scales


def caller_scale(output: QuantOutput, amax: float) -> float | None:
    """The scale a caller would pass for values of magnitude up to ``amax``: a dequantisation
    scale ``amax / 448``, an encode scale ``448 * 6 / amax`` (NVFP4's usual global scale), or
    None for an output that makes its own."""
    if output.scale_in == "dequant":
        return amax / FP8_MAX
    if output.scale_in == "encode":
        return FP8_MAX * E2M1_MAX / amax
    return None
