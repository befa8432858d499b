"""The quantised outputs are rows of one table (``csrc/quant_outputs.h``): a name is looked up,
and refused, in one place (``pattern.quant_output``), and the torch quantisation follows the
row's rule, so a row with a rule the table already has needs no code of its own."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from arfuse import quant as q
from arfuse.cli import args as cli_args
from arfuse.pattern import E4M3_MAX, QUANT_OUTPUTS, Pattern, quant_output
from arfuse.spec import QUANTS


def test_an_unknown_quant_is_refused_where_names_are_looked_up() -> None:
    with pytest.raises(ValueError, match=r"quant='int4' is not valid; use one of none, fp8"):
        quant_output("int4")
    with pytest.raises(ValueError, match=r"quant='int4' is not valid"):
        Pattern("rmsnorm", "int4")
    with pytest.raises(Exception, match=r"int4"):
        cli_args.quant("int4")


def test_every_quant_of_the_table_is_one_the_cli_and_the_spec_take() -> None:
    names = tuple(dict.fromkeys(o.quant for o in QUANT_OUTPUTS if o.quant))
    assert names == QUANTS
    for name in names:
        assert cli_args.quant(name) == name


def test_codes_fit_the_pattern_code_output_field() -> None:
    from arfuse.pattern import OUTPUT_CODES

    assert all(0 <= o.code < OUTPUT_CODES for o in QUANT_OUTPUTS)
    assert len({o.code for o in QUANT_OUTPUTS}) == len(QUANT_OUTPUTS)
    for pattern in (Pattern("residual_rmsnorm", o.quant, o.layout) for o in QUANT_OUTPUTS):
        assert Pattern.from_code(pattern.code) == pattern


def mxfp8() -> q.QuantOutput:
    """MXFP8 on paper: blocks of 32 with power-of-two scales, one exponent byte each in
    swizzled_128x4 tiles: a row of rules the table has (no code of its own)."""
    ue8m0 = quant_output("fp8_group", "ue8m0_packed")
    nvfp4 = quant_output("nvfp4", "swizzled_128x4")
    return dataclasses.replace(ue8m0, quant="mxfp8", layout="swizzled_128x4", code=8,
                               floor=0.0, fp32=False, block=32, scale_dtype="uint8",
                               scale_row_align=nvfp4.scale_row_align, scale_group=32,
                               scale_col_align=nvfp4.scale_col_align, scale_pack=1,
                               scale_order="swizzled")


def test_a_new_row_of_an_existing_rule_quantises_without_code_of_its_own() -> None:
    row = mxfp8()
    torch.manual_seed(0)
    out = (torch.randn(5, 96) * torch.logspace(-3, 3, 96)).bfloat16()
    codes, scales = q.quantize(out, row, None)
    assert codes is not None and scales is not None
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (5, 96)
    assert scales.dtype == torch.uint8 and scales.shape == (128, 4)  # rows and blocks padded
    values = out.float().reshape(5, 3, 32)
    amax = values.abs().amax(-1)
    want = torch.tensor([[2.0 ** math.ceil(math.log2(a / E4M3_MAX)) for a in row_]
                         for row_ in amax.tolist()])
    # the exponent bytes where swizzled_128x4 puts (row m, block k): m * 16 + k for m < 32
    flat = scales.reshape(-1)
    got = torch.stack([flat[m * 16: m * 16 + 3] for m in range(5)]).to(torch.int32)
    assert torch.equal((got << 23).view(torch.float32), want)
    assert int(flat.count_nonzero()) == 15  # the padding reads zero
    assert torch.equal(codes.view(torch.uint8), q.to_e4m3(
        (values / want.unsqueeze(-1)).reshape(5, 96)).view(torch.uint8))
