"""Per-token-group FP8 (``fp8_group``, docs/design.md 3.6): the formula per scale format at its
edges, against hand-computed values and the float64 reference; the shm kernel's bytes against
the torch epilogue's (one rank, two real ranks, one-shot and two-shot); the group size and
format in the call's signature; the group size's checks."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from test_epilogue_bytes import differing, kernel, row_inputs, with_specials

import arfuse
from arfuse import epilogue, reference
from arfuse import quant as q
from arfuse.call_checks import CallArgs
from arfuse.moe import ExpertStep, local_rows
from arfuse.pattern import GROUP_SIZES, Pattern, quant_output

from harness import run_ranks, values

LAYOUTS = ("fp32", "fp32_column_major", "ue8m0_packed")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EPS32 = torch.tensor(1e-10, dtype=torch.float32).item()
SMALLEST_UE8M0 = 127 - 33  # 2^ceil(log2(f32(1e-10))) = 2^-33


def unpacked(scale_out: torch.Tensor, groups: int) -> torch.Tensor:
    """UE8M0 exponent bytes ``[T, groups]`` read straight from the int32 storage by the layout
    rule (group j of token t: byte j % 4 of word (j / 4) * stride + t)."""
    tokens, stride = scale_out.shape[0], scale_out.stride(1)
    flat = torch.as_strided(scale_out, ((scale_out.shape[1] - 1) * stride + tokens,), (1,))
    raw = flat.contiguous().view(torch.uint8)
    return torch.tensor([[int(raw[((j // 4) * stride + t) * 4 + j % 4]) for j in range(groups)]
                         for t in range(tokens)], dtype=torch.uint8)


# --- the formula ---------------------------------------------------------------------------

def edge_rows(dtype: torch.dtype) -> torch.Tensor:
    """One row of 8 groups of 32: zeros; a subnormal amax (the dtype's smallest); amax 448 * 4
    exactly; the next value above it; a NaN among numbers; all NaN; +inf; -inf with NaN."""
    g = 32
    row = torch.linspace(-1, 1, 8 * g, dtype=torch.float32)
    row[0:g] = 0.0
    row[g:2 * g] = torch.finfo(dtype).smallest_normal / 2 ** 3
    row[2 * g:3 * g] *= 448.0 * 4
    row[2 * g + 5] = -448.0 * 4
    top = torch.tensor(448.0 * 4, dtype=dtype)
    above = torch.nextafter(top.float(), torch.tensor(math.inf)).to(dtype)
    if above.item() == top.item():  # 16-bit: the next representable value
        above = (top.view(torch.int16) + 1).view(dtype)
    row[3 * g:4 * g] *= 10.0
    row[3 * g + 3] = above.float()
    row[4 * g + 7] = math.nan
    row[5 * g:6 * g] = math.nan
    row[6 * g + 1] = math.inf
    row[7 * g + 2] = -math.inf
    row[7 * g + 3] = math.nan
    return row.view(1, -1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_scales_at_their_edges(dtype: torch.dtype) -> None:
    """Hand-computed per format: amax 0 and a subnormal amax give eps's scale (UE8M0: 2^-33,
    the smallest); amax 448 * 2^2 gives UE8M0 2^2 exactly, the next value above it 2^3; a NaN
    does not count (an all-NaN group is amax 0); inf gives an infinite scale (UE8M0 0xff)."""
    x = edge_rows(dtype)
    values_f = x.float()[0].view(8, 32)
    codes32, fp32 = q.fp8_group_quantize(x, 32, "fp32")
    codes8, packed = q.fp8_group_quantize(x, 32, "ue8m0_packed")
    eps_scale = torch.tensor(EPS32, dtype=torch.float32) / torch.tensor(448.0)
    assert fp32[0, 0].item() == fp32[0, 5].item() == eps_scale.item()
    subnormal = torch.finfo(dtype).smallest_normal / 2 ** 3  # fp16's is above eps
    assert fp32[0, 1].item() == (torch.tensor(max(subnormal, EPS32), dtype=torch.float32)
                                 / torch.tensor(448.0)).item()
    assert fp32[0, 2].item() == 4.0 and math.isinf(fp32[0, 6].item())
    exponents = unpacked(packed, 8)[0].tolist()
    above_max = values_f[3].abs().max().item()
    assert exponents[0] == exponents[5] == SMALLEST_UE8M0
    assert exponents[1] == 127 + max(math.ceil(math.log2(subnormal / 448.0)), -33)
    assert exponents[2] == 127 + 2
    assert exponents[3] == 127 + math.ceil(math.log2(above_max / 448.0))
    assert exponents[4] == 127 + math.ceil(math.log2(values_f[4].nan_to_num(0).abs().max()
                                                     .item() / 448.0))
    assert exponents[6] == exponents[7] == 0xFF
    # codes: 448 * 4 / 4 is the largest code; zeros stay zero; inf / inf is NaN
    assert codes8.view(torch.uint8)[0, 2 * 32 + 5].item() == 0xFE  # -448
    assert torch.all(codes32.view(torch.uint8)[0, :32] == 0)
    assert codes8.float()[0, 6 * 32 + 1].isnan() and codes8.float()[0, 4 * 32 + 7].isnan()
    assert torch.all(codes8.float()[0, 6 * 32 + 2:7 * 32].abs() == 0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("group", GROUP_SIZES)
def test_the_torch_quantisation_is_the_float64_reference(layout: str, group: int) -> None:
    """Random rows over a wide range: scales within the fp32 rounding of their operations
    (UE8M0: the same powers of two), codes the e4m3 rounding of the float64 quotient."""
    gen = torch.Generator().manual_seed(group)
    x = (torch.randn(33, 512, generator=gen)
         * torch.exp2(torch.randint(-20, 20, (33, 1), generator=gen).float())).bfloat16()
    codes, scale_out = q.fp8_group_quantize(x, group, layout)
    want_values, want_scales = reference.fp8_group(x, group, layout)
    got = q.fp8_group_scale_values(scale_out, 512 // group).double()
    if layout == "ue8m0_packed":
        assert torch.equal(got, want_scales)
    else:
        assert torch.all((got - want_scales).abs() <= want_scales * 2.0**-22)
    close = (codes.float().double() - q.to_e4m3(want_values.float()).double()).abs()
    assert (close > 0).float().mean().item() <= 1e-3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scale_out_has_the_documented_shape_strides_and_padding(layout: str) -> None:
    """fp32 ``[T, G]`` row-major; column-major strides ``(1, T)``; UE8M0 int32
    ``[T, ceil(G/4)]`` strides ``(1, ceil(T/4)*4)`` as FlashInfer checks it, padding zero."""
    tokens, hidden = 5, 640  # G = 5 groups of 128: a partial last word, 3 padding rows
    _, scale_out = q.fp8_group_quantize(torch.randn(tokens, hidden), 128, layout)
    shape, strides, storage = quant_output("fp8_group", layout).scale_geometry(tokens, hidden,
                                                                               128)
    assert tuple(scale_out.shape) == shape and scale_out.stride() == strides
    expected = {"fp32": ((5, 5), (5, 1), 25), "fp32_column_major": ((5, 5), (1, 5), 25),
                "ue8m0_packed": ((5, 2), (1, 8), 13)}[layout]
    assert (shape, strides, storage) == expected
    if layout == "ue8m0_packed":
        raw = torch.as_strided(scale_out, (storage,), (1,)).contiguous().view(torch.uint8)
        words = raw.view(storage, 4)
        assert torch.all(words[tokens:8] == 0)  # padding rows of the first pack
        assert torch.all(words[8:, 1:] == 0)  # groups 5..7 of the second pack
        assert torch.all(words[:tokens] != 0) and torch.all(words[8:, 0] != 0)


# --- the kernel's bytes ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernel_is_the_torch_epilogue_bytes(dtype: torch.dtype) -> None:
    """One rank on private memory: every format and group size, with and without RMSNorm,
    hidden sizes of one group, a partial UE8M0 word and past a pass segment; NaN, infinities
    and saturating rows (``with_specials``); 1 to 300 tokens."""
    failures = []
    for hidden in (128, 640, 1088):
        comm, _memory = kernel(300, hidden, dtype)
        for tokens in (1, 5, 12, 300):
            x, residual, weight = row_inputs(tokens, hidden, dtype, seed=tokens + hidden)
            if tokens == 12:
                x = with_specials(x, seed=3)
            for group in GROUP_SIZES:
                if hidden % group:
                    continue
                for layout in LAYOUTS:
                    for norm in (False, True):
                        call = CallArgs(x, residual if norm else None, weight if norm else None,
                                        1e-6, 0.0, "fp8_group", None, layout, group_size=group)
                        got = comm.call(x, call.residual, call.weight, 1e-6, 0.0, "fp8_group",
                                        None, layout, None, None, 0, group)
                        assert got is not None, (hidden, group, layout)
                        want = epilogue.apply(x.float(), call)
                        bad = differing(got, want)
                        if got.scale_out.stride() != want.scale_out.stride():
                            bad.append("strides")
                        elif layout == "ue8m0_packed" and not torch.equal(
                                unpacked(got.scale_out, hidden // group),
                                unpacked(want.scale_out, hidden // group)):
                            bad.append("storage")
                        if bad:
                            failures.append((hidden, tokens, group, layout, norm, bad))
    assert not failures, failures


@pytest.mark.parametrize("reduction", ["moe_finalize", "moe_reduce"])
def test_after_the_moe_step_the_kernel_is_the_torch_epilogue_bytes(reduction: str) -> None:
    """The kernel's MoE fast path (expert step, then the call) against the torch expert step
    and the torch epilogue, every format."""
    hidden, fan_in, dtype = 1024, 4, torch.bfloat16
    comm, _memory = kernel(64, hidden, dtype)
    failures = []
    for tokens in (1, 7, 64):
        gen = torch.Generator().manual_seed(tokens)
        _, residual, weight = row_inputs(tokens, hidden, dtype, seed=tokens + 1)
        if reduction == "moe_finalize":
            rows = torch.randn(tokens * fan_in, hidden, generator=gen).to(dtype)
            index = torch.randperm(tokens * fan_in, generator=gen).view(tokens, fan_in)
            step = ExpertStep(reduction, rows, torch.rand(tokens, fan_in, generator=gen),
                              index.to(torch.int32), None, 1.5)
        else:
            step = ExpertStep(reduction, torch.randn(fan_in, tokens, hidden, generator=gen)
                              .to(dtype), torch.rand(fan_in, tokens, generator=gen).to(dtype),
                              None, torch.randn(tokens, hidden, generator=gen).to(dtype))
        for layout in LAYOUTS:
            x = local_rows(step, torch.empty(tokens, hidden, dtype=dtype))
            call = CallArgs(x, residual, weight, 1e-6, 0.0, "fp8_group", None, layout,
                            group_size=64)
            got = comm.call_moe(step.rows, step.index, step.scales, step.add, step.routed,
                                residual, weight, 1e-6, 0.0, "fp8_group", None, layout, None,
                                None, 0, 64)
            assert got is not None, layout
            want = epilogue.apply(x.float(), call)
            bad = differing(got, want)
            if bad or got.scale_out.stride() != want.scale_out.stride():
                failures.append((tokens, layout, bad))
    assert not failures, failures


def test_the_torch_operator_takes_the_group_size() -> None:
    """torch.ops.arfuse.shm_fused_allreduce: output code and ``group_size``; scale_out with
    its strides; a group size it does not allow is a ValueError."""
    comm, _memory = kernel(5, 256, torch.bfloat16)
    x = torch.randn(5, 256).bfloat16()
    code = quant_output("fp8_group", "ue8m0_packed").code
    outs = torch.ops.arfuse.shm_fused_allreduce(int(comm.handle), x, None, None, 1e-6, 0.0, code,
                                                0.0, None, None, 64)
    codes, scale_out = q.fp8_group_quantize(outs[0], 64, "ue8m0_packed")
    assert torch.equal(outs[1].view(torch.uint8), codes.view(torch.uint8))
    assert outs[2].stride() == scale_out.stride() == (1, 8)
    assert torch.equal(unpacked(outs[2], 4), unpacked(scale_out, 4))
    for bad in (0, 96, 256):
        with pytest.raises(ValueError, match="group_size"):
            torch.ops.arfuse.shm_fused_allreduce(int(comm.handle), x, None, None, 1e-6, 0.0,
                                                 code, 0.0, None, None, bad)


def test_fp8_dynamic_skips_a_signalling_nan_in_the_kernels_scalar_tail() -> None:
    """fp32, one rank (its sum adds nothing, so a signalling NaN reaches the amax as it is):
    the NaN in the row's scalar tail (hidden not a multiple of the vector width) does not
    count, as in the vector form and the torch epilogue."""
    hidden = 37
    comm, _memory = kernel(4, hidden, torch.float32)
    x = torch.randn(4, hidden)
    x.view(torch.int32)[1, -1] = 0x7F812345  # signalling NaN, in the tail
    x.view(torch.int32)[2, -2] = -0x007EDCBB  # 0xff812345: signalling, negative
    got = comm.call(x, None, None, 1e-6, 0.0, "fp8_dynamic", None, None, None, None)
    codes, scales = q.fp8_dynamic_quantize(x)
    assert torch.equal(got.scale_out, scales), got.scale_out
    assert torch.equal(got.quant_out.view(torch.uint8)[:, :-2], codes.view(torch.uint8)[:, :-2])


# --- two real ranks ------------------------------------------------------------------------

def fp8_group_on_ranks(rank: int, world: int, backend: str, mode: str | None) -> dict[str, Any]:
    """Every format and group size on ``backend`` (shm in ``mode``), rows with NaN and
    infinities on one rank; a call over capacity too: the outputs' bytes, and the torch
    epilogue's on the same sum (x of every rank, regenerated here)."""
    hidden, tokens = 640, 12
    comm = arfuse.FusedAllReduce(max_token_num=tokens, hidden_dim=hidden, dtype=torch.bfloat16,
                                 backend=backend, strict=backend != "torch",
                                 quant="fp8_group", timeout_s=30)
    if mode is not None:
        comm.workspace.set_mode(mode)  # type: ignore[attr-defined]
    xs = []
    for r in range(world):
        gen = torch.Generator().manual_seed(r)
        x = (torch.randn(2 * tokens, hidden, generator=gen) * 3).bfloat16()
        xs.append(with_specials(x, seed=r) if r == 0 else x)
    same = torch.Generator().manual_seed(99)
    residual = torch.randn(2 * tokens, hidden, generator=same).bfloat16()
    weight = (torch.rand(hidden, generator=same) + 0.5).bfloat16()
    acc = epilogue.rank_order_sum(torch.stack(xs))
    report: dict[str, Any] = {"backend": comm.backend, "cases": {}}
    for layout in LAYOUTS:
        for group in GROUP_SIZES:
            for rows in (tokens, 2 * tokens):  # the second over capacity
                res = comm(xs[rank][:rows], residual=residual[:rows], weight=weight,
                           quant="fp8_group", layout=layout, group_size=group)
                want = epilogue.apply(acc[:rows], CallArgs(
                    xs[rank][:rows], residual[:rows], weight, 1e-6, 0.0, "fp8_group", None,
                    layout, group_size=group))
                report["cases"][(layout, group, rows)] = {
                    "bad": differing(res, want) + (
                        [] if res.scale_out.stride() == want.scale_out.stride() else ["strides"]),
                    "codes": res.quant_out.view(torch.uint8).clone(),
                    "scales": unpacked(res.scale_out, hidden // group) if layout ==
                    "ue8m0_packed" else res.scale_out.contiguous()}
    report["stats"] = comm.stats()
    comm.close()
    return report


@pytest.mark.parametrize(("backend", "mode", "env"), [
    ("shm", "oneshot", {}), ("shm", "twoshot", {}), ("shm", None, {"ARFUSE_SHM_PURE_TORCH": "1"}),
    ("torch", None, {})], ids=["shm-oneshot", "shm-twoshot", "shm-pure-torch", "torch"])
def test_two_ranks_write_the_torch_epilogue_bytes(backend: str, mode: str | None,
                                                  env: dict[str, str]) -> None:
    """Fused on shm (two-shot splits the rows between the ranks mid-call), shm's pure-torch
    path, the torch backend, and calls over capacity: on every rank the bytes of the torch
    epilogue on the rank-order sum."""
    reports = values(run_ranks(fp8_group_on_ranks, 2, backend, mode, timeout=180, env=env))
    for report in reports:
        assert report["backend"] == backend
        for key, case in report["cases"].items():
            assert not case["bad"], (key, case["bad"])
    for key, case in reports[0]["cases"].items():
        assert torch.equal(case["codes"], reports[1]["cases"][key]["codes"]), key
        assert torch.equal(case["scales"], reports[1]["cases"][key]["scales"]), key
    if backend == "shm":
        assert reports[0]["stats"]["unfused_over_capacity"] == 9


# --- the call's checks ---------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "error", "text"), [
    ({"group_size": 96}, ValueError, "group_size=96 is not valid with hidden_dim=256; use one "
                                     "of 32, 64, 128 dividing hidden_dim"),
    ({"group_size": 256}, ValueError, "use one of 32, 64, 128 dividing hidden_dim"),
    ({"group_size": 16}, ValueError, "group_size=16"),
    ({"group_size": True}, TypeError, "group_size must be None or an int"),
    ({"group_size": 64.0}, TypeError, "group_size must be None or an int"),
    ({"layout": "linear"}, ValueError, "layout='linear' is not valid for quant='fp8_group'"),
    ({"scale": 1.0}, ValueError, "quant='fp8_group' computes its own scales"),
])
def test_bad_fp8_group_arguments_name_the_argument(kwargs: dict[str, Any], error: type,
                                                   text: str) -> None:
    with arfuse.FusedAllReduce(max_token_num=4, hidden_dim=256, dtype=torch.bfloat16,
                               backend="torch") as comm:
        x = torch.randn(4, 256).bfloat16()
        with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
            comm(x, quant="fp8_group", **kwargs)


def test_group_size_must_divide_hidden_and_belongs_to_fp8_group_only() -> None:
    with arfuse.FusedAllReduce(max_token_num=4, hidden_dim=96, dtype=torch.float32,
                               backend="torch") as comm:
        x = torch.randn(4, 96)
        with pytest.raises(ValueError, match="group_size=128 is not valid with hidden_dim=96"):
            comm(x, quant="fp8_group")  # the default, 128, does not divide 96
        with pytest.raises(ValueError, match="group_size=64 is not valid"):
            comm(x, quant="fp8_group", group_size=64)
        res = comm(x, quant="fp8_group", group_size=32, layout="fp32_column_major")
        assert res.scale_out.shape == (4, 3) and res.scale_out.stride() == (1, 4)
        with pytest.raises(ValueError, match="group_size=32 is only for quant='fp8_group'"):
            comm(x, quant="fp8_dynamic", group_size=32)
        with pytest.raises(ValueError, match="only for quant='fp8_group'"):
            comm(x, group_size=32)


def test_the_pattern_names_and_the_default_layout() -> None:
    names = {Pattern("rmsnorm", "fp8_group", layout).name for layout in LAYOUTS}
    assert names == {"rmsnorm+fp8_group_fp32", "rmsnorm+fp8_group_fp32_column_major",
                     "rmsnorm+fp8_group_ue8m0"}
    assert Pattern.of_call(True, False, "fp8_group", None).layout == "fp32"
    assert Pattern.of_call(True, False, "nvfp4", None).layout == "swizzled_128x4"
