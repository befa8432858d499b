"""The compiled kernel computes exactly the documented formula, bit for bit (kernel header):
the sum of squares in 32 lanes (lane = h % 32, each added up in order, combined by halving:
lane i + lane i + 16 for i < 16, then i + 8, 4, 2, 1), then out = T((r * inv) * (weight_bias + w)).

This pins the order of the fp32 operations, so a faster loop that reorders them fails here
even when it stays within the tolerance the reference tests allow (in float32 outputs; in 16-bit
outputs a reordering mostly vanishes in the final rounding). One rank, no peers: the kernel on
a private buffer."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from arfuse.backends.shm import build as shm_build
from arfuse.backends.shm import layout as shm_layout
from arfuse.pattern import output_code

DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def kernel_on_private_memory(tokens: int, hidden: int, dtype: torch.dtype) -> tuple[object,
                                                                                     torch.Tensor]:
    module = shm_build.load()
    if module is None:
        pytest.skip(f"no compiled kernel here: {shm_build.why_not()}")
    layout = shm_layout.ShmLayout(1, tokens, hidden,
                                  torch.tensor([], dtype=dtype).element_size())
    memory = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    comm = module.ShmComm(memory.data_ptr(), 1, 0, tokens, hidden, DTYPE_CODE[dtype],
                          shm_layout.HEADER_BYTES, layout.slot_bytes, layout.input_bytes,
                          10.0, 1 << 40)
    return comm, memory


def documented_out(residual_out: torch.Tensor, weight: torch.Tensor, eps: float,
                   weight_bias: float) -> torch.Tensor:
    """The formula in float32 numpy, one IEEE operation at a time, in the documented order."""
    r = residual_out.float().numpy()
    gain = np.float32(weight_bias) + weight.float().numpy()
    tokens, hidden = r.shape
    out = np.empty_like(r)
    for t in range(tokens):
        lanes = np.zeros(32, dtype=np.float32)
        for h in range(hidden):
            lanes[h % 32] = lanes[h % 32] + r[t, h] * r[t, h]
        width = 16
        while width >= 1:
            for i in range(width):
                lanes[i] = lanes[i] + lanes[i + width]
            width //= 2
        ss = lanes[0]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(hidden) + np.float32(eps))
        out[t] = (r[t] * inv) * gain
    return torch.from_numpy(out).to(residual_out.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [37, 88, 208, 1040, 1100])
@pytest.mark.parametrize("in_place", [False, True])
def test_out_is_the_documented_formula_bit_for_bit(dtype: torch.dtype, hidden: int,
                                                   in_place: bool) -> None:
    """New outputs and in place (out=x, residual_out=residual), several rows per step, so a
    row's second pass runs between the segments of the next row's first (finish_rows); hidden
    1040 and 1100 span several segments, the last of 1100 both vector and scalar elements."""
    tokens, eps, weight_bias = 64, 1e-6, 0.5
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(tokens, hidden, generator=gen) * 4).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    comm, _memory = kernel_on_private_memory(tokens, hidden, dtype)
    summed = x.float().to(dtype)  # one rank: the sum is x
    if in_place:
        x_work, residual_in = x.clone(), residual.clone()
        out, residual_out, _, _ = comm.run(x_work, residual_in, weight, eps, weight_bias, 0,
                                           0.0, x_work, residual_in)
        assert out.data_ptr() == x_work.data_ptr()
        assert residual_out.data_ptr() == residual_in.data_ptr()
    else:
        out, residual_out, _, _ = comm.run(x, residual, weight, eps, weight_bias, 0, 0.0,
                                           None, None)
    assert torch.equal(residual_out, (summed.float() + residual.float()).to(dtype))
    expected = documented_out(residual_out, weight, eps, weight_bias)
    assert torch.equal(out.view(torch.int16) if dtype != torch.float32 else out.view(torch.int32),
                       expected.view(torch.int16) if dtype != torch.float32
                       else expected.view(torch.int32))


def test_two_builds_load_into_one_process_and_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two builds load into one process (ShmComm is module-local in each), as
    benchmarks/ab_kernels.py loads them; here the host's best ISA and the scalar build, one call
    each on private memory: two distinct modules, the same bytes."""
    if shm_build.load() is None:
        pytest.skip(f"no compiled kernel here: {shm_build.why_not()}")
    src = str(Path(shm_build.__file__).resolve().parents[3])
    paths = [shm_build.build_tree(src)]
    monkeypatch.setenv("ARFUSE_SHM_ISA", "scalar")
    paths.append(shm_build.build_tree(src))
    assert paths[0] != paths[1]
    modules = [shm_build.load_file(p) for p in paths]
    assert modules[1].isa == "scalar" and modules[0] is not modules[1]
    tokens, hidden, dtype = 9, 1100, torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(tokens, hidden, generator=gen) * 4).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    layout = shm_layout.ShmLayout(1, tokens, hidden, 2)
    results = []
    for module in modules:
        memory = torch.zeros(layout.total_bytes, dtype=torch.uint8)
        comm = module.ShmComm(memory.data_ptr(), 1, 0, tokens, hidden, DTYPE_CODE[dtype],
                              shm_layout.HEADER_BYTES, layout.slot_bytes, layout.input_bytes,
                              10.0, 1 << 40)
        results.append(comm.run(x, residual, weight, 1e-6, 0.0, 0, 0.0, None, None))
    for got, want in zip(results[0][:2], results[1][:2], strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def norm_inputs(tokens: int, hidden: int, dtype: torch.dtype,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual and an RMSNorm weight for one call."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    return x, residual, weight


def test_new_outputs_share_buffers_across_nearby_token_counts() -> None:
    """Output buffers come in size classes (comm.cpp, OutputPool): a call a few tokens larger
    takes the buffers the last call returned (no new memory to fault in), its tensors exactly
    its own shape and values; a call far larger takes others."""
    tokens, hidden, dtype = 64, 4096, torch.bfloat16
    x, residual, weight = norm_inputs(tokens, hidden, dtype, seed=3)
    comm, _memory = kernel_on_private_memory(tokens, hidden, dtype)

    def call(n: int) -> Any:
        return comm.run(x[:n], residual[:n], weight, 1e-6, 0.0, 0, 0.0, None, None)

    first = call(33)
    pooled = {first[0].data_ptr(), first[1].data_ptr()}
    del first
    second = call(34)  # 272 KiB per output: the same class as 264 KiB (320 KiB)
    assert {second[0].data_ptr(), second[1].data_ptr()} == pooled
    assert second[0].shape == (34, hidden) and second[1].shape == (34, hidden)
    out, residual_out = x[:34].clone(), residual[:34].clone()
    comm.run(out, residual_out, weight, 1e-6, 0.0, 0, 0.0, out, residual_out)
    assert torch.equal(second[0], out) and torch.equal(second[1], residual_out)
    del second
    third = call(64)  # 512 KiB: another class
    assert not {third[0].data_ptr(), third[1].data_ptr()} & pooled


def int_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


ARM = platform.machine() in ("aarch64", "arm64")
# <fenv.h>'s rounding modes (glibc): x86's, or aarch64's (FPCR.RMode)
FE_TONEAREST, FE_UPWARD = (0x000, 0x400000) if ARM else (0x000, 0x800)


class ArmFloatEnv(ctypes.Structure):  # glibc's fenv_t on aarch64
    _fields_ = [("fpcr", ctypes.c_uint), ("fpsr", ctypes.c_uint)]


FPCR_FZ_DN = (1 << 24) | (1 << 25)  # flush-to-zero, default-NaN mode


def set_flush_to_zero(libm: Any, on: bool) -> None:
    """Flush-to-zero in this thread: torch.set_flush_denormal on x86 (FTZ and DAZ); on aarch64,
    where torch cannot, FPCR's FZ (with DN) through glibc's fesetenv."""
    if not ARM:
        torch.set_flush_denormal(on)
        return
    env = ArmFloatEnv()
    assert libm.fegetenv(ctypes.byref(env)) == 0
    env.fpcr = env.fpcr | FPCR_FZ_DN if on else env.fpcr & ~FPCR_FZ_DN
    assert libm.fesetenv(ctypes.byref(env)) == 0


def tiny_norm_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_inputs scaled so that (in bf16 and fp32) the sums and residual_out are fp32
    denormals, which flush-to-zero would change; fp16 stays in its range (its smallest
    values are normal fp32), where the rounding mode still matters."""
    x, residual, weight = norm_inputs(8, 1040, dtype, seed=5)
    if dtype != torch.float16:
        x, residual = (x.float() * 2.0**-130).to(dtype), (residual.float() * 2.0**-131).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("in_place", [False, True])
def test_the_callers_float_environment_changes_nothing_and_is_given_back(
        dtype: torch.dtype, in_place: bool) -> None:
    """A thread with flush-to-zero and denormals-are-zero (torch.set_flush_denormal(True); on
    aarch64 FPCR's FZ and DN) or another rounding mode (fesetround) gets the bytes of the
    default environment, and its own environment back after the call (float_env.h): ranks
    whose threads differ still agree."""
    if platform.machine() not in ("x86_64", "AMD64", "i686", "aarch64", "arm64"):
        pytest.skip("the floating-point environment here is x86's or aarch64's")
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    x, residual, weight = tiny_norm_inputs(dtype)
    comm, _memory = kernel_on_private_memory(8, 1040, dtype)

    def call() -> list[torch.Tensor]:
        xw, rw = x.clone(), residual.clone()
        outs = comm.run(xw, rw, weight, 1e-6, 0.0, 0, 0.0,
                        xw if in_place else None, rw if in_place else None)
        return [int_bits(t).clone() for t in outs if t is not None]

    expected = call()
    if dtype != torch.float16:  # the inputs reach the denormals that FTZ/DAZ would change
        assert any(bool(((t.float().abs() < 2.0**-126) & (t.float() != 0)).any())
                   for t in (x, residual))
    set_flush_to_zero(libm, True)
    try:
        flushed = call()
        still_flushing = float(torch.tensor([2.0**-140]) * 1.0) == 0.0
    finally:
        set_flush_to_zero(libm, False)
    assert still_flushing, "the call did not give the thread its flush-to-zero back"
    libm.fesetround(FE_UPWARD)
    try:
        upward = call()
        mode_after = libm.fegetround()
    finally:
        libm.fesetround(FE_TONEAREST)
    assert mode_after == FE_UPWARD, "the call did not give the thread its rounding mode back"
    for got in (flushed, upward):
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [1040, 1056, 1100])
def test_streaming_output_stores_give_the_same_bytes(dtype: torch.dtype, hidden: int) -> None:
    """Outputs of their own stored with streaming stores (forced here; auto mode from 8 MiB per
    output): out through the streaming second pass where its rows are whole cache lines (1056
    in every dtype, 1040 in fp32), residual_out through the staging rows (any row size: heads
    and tails of lines stored as usual). The same bytes as cached stores, equal to the
    documented formula: new outputs, outputs the caller gives, and a quantised call (there
    only residual_out streams: quantisation reads out back); and the plain all-reduce, whose
    out streams through a staging row (one rank: out is x)."""
    tokens, eps = 64, 1e-6
    gen = torch.Generator().manual_seed(hidden + 1)
    x = (torch.randn(tokens, hidden, generator=gen) * 4).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    comm, _memory = kernel_on_private_memory(tokens, hidden, dtype)
    assert not comm.streams_outputs(2 * x.nbytes)  # auto: far below the threshold

    def call(out: Any = None, residual_out: Any = None, quant: int = 0) -> Any:
        return comm.run(x, residual, weight, eps, 0.0, quant, 0.25, out, residual_out)

    cached = call()
    cached_fp8 = call(quant=1) if dtype != torch.float32 else None
    comm.set_output_stores(2)
    assert comm.streams_outputs(2 * x.nbytes)
    given = (torch.empty_like(x), torch.empty_like(residual))
    for got in (call(), call(*given)):
        assert torch.equal(int_bits(got[0]), int_bits(cached[0]))
        assert torch.equal(int_bits(got[1]), int_bits(cached[1]))
    assert torch.equal(int_bits(cached[0]),
                       int_bits(documented_out(cached[1], weight, eps, 0.0)))
    if cached_fp8 is not None:
        got = call(quant=1)
        for a, b in zip(got[:3], cached_fp8[:3], strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    given_out = torch.empty_like(x)
    for out in (None, given_out):
        plain = comm.run(x, None, None, eps, 0.0, 0, 0.0, out, None)[0]
        assert torch.equal(int_bits(plain), int_bits(x))


def test_auto_mode_streams_outputs_from_the_builds_threshold() -> None:
    """Auto mode streams once a call's own outputs come to the build's size in all (fp32: 16
    MiB on the vector builds, here out and residual_out of 8 MiB each; never on the scalar
    build) and gives the bytes cached stores give there, as in place (out=x,
    residual_out=residual) does."""
    tokens, hidden, dtype = 2048, 1024, torch.float32
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(tokens, hidden, generator=gen)
    residual = torch.randn(tokens, hidden, generator=gen)
    weight = torch.rand(hidden, generator=gen) + 0.5
    comm, _memory = kernel_on_private_memory(tokens, hidden, dtype)
    module = shm_build.load()
    both = 2 * tokens * hidden * 4  # out and residual_out
    assert not comm.streams_outputs(0)
    if module.isa == "scalar":  # type: ignore[union-attr]
        assert not comm.streams_outputs(both)
    else:
        assert module.stream_output_min_bytes(2) == both  # type: ignore[union-attr]
        assert comm.streams_outputs(both) and not comm.streams_outputs(both - 1)
    auto = comm.run(x, residual, weight, 1e-6, 0.0, 0, 0.0, None, None)
    comm.set_output_stores(1)
    assert not comm.streams_outputs(both)
    cached = comm.run(x, residual, weight, 1e-6, 0.0, 0, 0.0, None, None)
    assert torch.equal(auto[0], cached[0]) and torch.equal(auto[1], cached[1])
    comm.set_output_stores(0)
    x_work, residual_work = x.clone(), residual.clone()
    comm.run(x_work, residual_work, weight, 1e-6, 0.0, 0, 0.0, x_work, residual_work)
    assert torch.equal(x_work, cached[0]) and torch.equal(residual_work, cached[1])


def test_output_pool_holds_at_most_two_calls_at_capacity() -> None:
    """Freed output buffers are kept for the next calls, but at most two calls at capacity
    with out and residual_out (here 4 x 64 x 4096 bf16 = 2 MiB) and 16 buffers: calls of many
    sizes (many size classes) once kept 16 buffers of any size."""
    tokens, hidden, dtype = 64, 4096, torch.bfloat16
    x, residual, weight = norm_inputs(tokens, hidden, dtype, seed=4)
    comm, _memory = kernel_on_private_memory(tokens, hidden, dtype)
    cap = 4 * tokens * hidden * 2
    held = []
    for n in (64, 60, 50, 40, 33, 30, 25, 20, 17, 64, 12, 9, 64):
        got = comm.run(x[:n], residual[:n], weight, 1e-6, 0.0, 0, 0.0, None, None)
        assert torch.equal(got[0], comm.run(x[:n], residual[:n], weight, 1e-6, 0.0, 0, 0.0,
                                            None, None)[0])
        del got
        held.append(comm.pooled_bytes())
        assert 0 < held[-1] <= cap, held
    assert max(held) > cap // 2  # it does keep buffers for reuse


# --- NVFP4 with NaN and infinities: FlashInfer's rule, the same bytes on every path ------------
# The block amax ignores NaN (__hmax2/__hmax return the other operand), so a NaN takes no part
# in the block scale unless all 16 values are NaN (scale 0x7f, the e4m3 NaN); an infinity
# saturates the scale to 448 (0x7e); the e2m1 conversion (cvt.rn.satfinite.e2m1x2.f32)
# saturates +-inf to +-6 and turns NaN into +6 (code 7, no sign). Global scale 6: sf = amax.
NAN, INF = float("nan"), float("inf")
NVFP4_SPECIAL = [  # (block, its 8 code bytes, its scale byte)
    ([NAN, 2, 1, 0.5, 0, -1, -2, 0.25] + [1.0] * 8,          # scale from the others: 2
     [0x77, 0x35, 0xD0, 0x2F, 0x55, 0x55, 0x55, 0x55], 0x40),
    ([NAN] * 16, [0x77] * 8, 0x7F),                           # all NaN
    ([INF, 1.0, -0.5, 0.0] + [0.0] * 12, [0x07, 0x08] + [0x00] * 6, 0x7E),
    ([-INF, NAN] + [0.0] * 14, [0x7F] + [0x00] * 7, 0x7E),
    ([NAN] + [0.0] * 15, [0x07] + [0x00] * 7, 0x00),          # scale 0: NaN * 0 is NaN
    ([-0.0] * 15 + [NAN], [0x88] * 7 + [0x78], 0x00),
]


def nvfp4_special(dtype: torch.dtype, blocks: list[Any] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of the special blocks (rotated per row), their predicted codes and scales."""
    blocks = NVFP4_SPECIAL if blocks is None else blocks
    rows, codes, scales = [], [], []
    count = len(blocks)
    for shift in range(3):
        order = [blocks[(i + shift) % count] for i in range(count)]
        rows.append([v for block, _, _ in order for v in block])
        codes.append([c for _, block_codes, _ in order for c in block_codes])
        scales.append([scale for _, _, scale in order])
    return (torch.tensor(rows).to(dtype), torch.tensor(codes, dtype=torch.uint8),
            torch.tensor(scales, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["linear", "swizzled_128x4"])
def test_nvfp4_nan_and_inf_follow_flashinfer_on_every_path(dtype: torch.dtype,
                                                           layout: str) -> None:
    from arfuse import quant

    x, codes, scales = nvfp4_special(dtype)
    tokens, hidden = x.shape
    comm, _memory = kernel_on_private_memory(tokens, hidden, dtype)
    out, _, q, s = comm.run(x, None, None, 1e-6, 0.0, output_code("nvfp4", layout), 6.0, None,
                            None)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))  # NaN stays NaN
    ref_q, ref_s = quant.nvfp4_quantize(x, 6.0, layout)
    assert torch.equal(q, ref_q) and torch.equal(s, ref_s)
    linear_q, linear_s = quant.nvfp4_quantize(x, 6.0, "linear")
    assert torch.equal(linear_q, codes), (linear_q, codes)
    assert torch.equal(linear_s, scales), (linear_s, scales)
    module = shm_build.load()
    has_vector = module.isa.startswith("avx2") and (dtype == torch.bfloat16
                                                    or "f16c" in module.isa)
    for vector in (True, False) if has_vector else (False,):  # vector and scalar block code
        vq, vs = module.diagnostics.nvfp4_quantize(x, 6.0, vector)
        assert torch.equal(vq, codes) and torch.equal(vs, scales), vector


def test_nvfp4_nan_and_inf_on_real_ranks() -> None:
    from arfuse import quant

    import ranks_numerics
    from harness import run_ranks, values

    # rank 0 passes the blocks, the others zeros: the sum is the blocks, but for -0 (+0 then)
    x, codes, scales = nvfp4_special(torch.bfloat16, NVFP4_SPECIAL[:-1])
    for result in values(run_ranks(ranks_numerics.quant_edges, 2, x, "nvfp4", 6.0, "linear")):
        assert result["backend"] == "shm"
        assert torch.equal(result["quant_out"], codes)
        assert torch.equal(result["scale_out"], scales)
        assert torch.equal(result["quant_out"], quant.nvfp4_quantize(x, 6.0, "linear")[0])
