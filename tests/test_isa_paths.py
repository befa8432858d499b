"""Every instruction-set path of the shm kernel gives the same bytes: AVX-512 (with AVX512_BF16's
vcvtneps2bf16 where the CPU has it, and without it: ``avx512-nobf16``), AVX2 and scalar, each
built by its own process (``ARFUSE_SHM_ISA``), for every path this machine can run.

* the roundings to bf16/fp16 (vector against scalar, on random and special bit patterns);
* the NVFP4 block (vector against scalar, FlashInfer's NaN/inf rule);
* the numerics matrix on real ranks (2, 3 and 4; one-shot and two-shot): every dtype, odd and
  even hidden sizes, every pattern and quantisation, with NaN (quiet, signaling, payloads),
  infinities, -0, denormals and sums that overflow: the bytes of every output are the same on
  every ISA and rank, and equal to the reference for the same inputs: the rank-order fp32
  sum and residual add through torch, ``out`` by the documented formula (numpy float32, one
  operation at a time, 32 lanes), the quantised bytes by ``arfuse.quant``. A NaN is compared
  as a NaN with torch's values (torch makes its NaNs canonical: 0x7fc0 or 0xffff in bf16),
  bit for bit across ISAs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from arfuse import quant
from arfuse.backends.shm import build as shm_build
from arfuse.backends.shm import cache as shm_cache
from arfuse.epilogue import rank_order_sum

from harness import run_ranks, values

ISAS = shm_build.host_isas()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INT_VIEW = {"bf16": torch.int16, "fp16": torch.int16, "fp32": torch.int32}
TOKENS = 7
HIDDENS = (37, 88, 96, 208, 1040)  # 96: whole groups of 32 for fp8_group
# streaming output stores: out streams where its rows are whole cache lines (1056: every dtype)
STREAMING_HIDDENS = (1040, 1056)
EPS = 1e-5
FP8_SCALE = 0.0625
NVFP4_SCALE = 84.0
# raw bit patterns: qNaN, sNaN with a payload, -qNaN with a payload, +-inf, -0, the smallest
# denormal, a negative denormal, the largest denormal, the largest finite value
SPECIALS = {
    "bf16": (0x7FC0, 0x7F81, 0xFFC1, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x8040, 0x007F, 0x7F7F),
    "fp16": (0x7E00, 0x7C01, 0xFE01, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x8200, 0x03FF, 0x7BFF),
    "fp32": (0x7FC00000, 0x7F800001, 0xFFC00001, 0x7F800000, 0xFF800000, 0x80000000,
             0x00000001, 0x80400000, 0x007FFFFF, 0x7F7FFFFF),
}
TINY = {"bf16": 2.0**-130, "fp16": 2.0**-20, "fp32": 2.0**-140}  # row 2: denormal sums
PATTERNS = ("plain", "norm", "residual", "bias", "fp8", "fp8_dynamic", "nvfp4_linear",
            "nvfp4_swizzled", "fp8_group_ue8m0", "fp8_group_column_major")
FP8_GROUP = {"fp8_group_ue8m0": ("ue8m0_packed", 32), "fp8_group_column_major":
             ("fp32_column_major", 32)}  # pattern: (layout, group_size)


def needs(isa: str) -> None:
    if isa not in ISAS:
        pytest.skip(f"this CPU cannot run the {isa} path (it has {', '.join(ISAS)})")


def built_for(isa: str, reported: str) -> bool:
    """Whether the kernel's own name of its instruction set (``module.isa``: avx512+bf16,
    avx512, avx2+f16c, neon+bf16, neon, scalar, ...) is the build ``ARFUSE_SHM_ISA=isa`` asked
    for."""
    if isa.endswith("-nobf16"):
        return reported == isa.removesuffix("-nobf16")
    return reported.split("+")[0] == isa


def patterns(dtype: str, hidden: int) -> list[str]:
    return [p for p in PATTERNS
            if (not p.startswith("nvfp4") or (dtype != "fp32" and hidden % 16 == 0))
            and (p not in FP8_GROUP or hidden % FP8_GROUP[p][1] == 0)]


def _signed(value: int, bits: int) -> int:
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def case_inputs(dtype: str, hidden: int, world: int) -> dict[str, Any]:
    """Every rank's x, the residual and the weight of a (dtype, hidden) case, the same in every
    process: random rows 0-1, denormal sums in row 2, special values in rows 3-6 (rank r puts
    special (k + r) at spot k, so that the ranks' specials meet in the sum)."""
    torch_dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(hidden * 31 + world)
    xs = []
    specials = SPECIALS[dtype]
    bits = 16 if dtype != "fp32" else 32
    for rank in range(world):
        x = (torch.randn(TOKENS, hidden, generator=gen) * (rank + 1)).to(torch_dtype)
        x[2] = (torch.randn(hidden, generator=gen) * TINY[dtype]).to(torch_dtype)
        raw = x.view(INT_VIEW[dtype])
        for k in range(2 * len(specials)):
            value = specials[(k + rank) % len(specials)]
            raw[3 + k % 4, (5 * k + 3) % hidden] = _signed(value, bits)
        xs.append(x)
    residual = torch.randn(TOKENS, hidden, generator=gen).to(torch_dtype)
    residual[2] = (torch.randn(hidden, generator=gen) * TINY[dtype]).to(torch_dtype)
    residual[0, 1] = -0.0
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(torch_dtype)
    return {"xs": xs, "residual": residual, "weight": weight}


def call_kwargs(pattern: str, data: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if pattern != "plain":
        kwargs.update(weight=data["weight"], eps=EPS)
    if pattern not in ("plain", "norm", "nvfp4_swizzled"):
        kwargs["residual"] = data["residual"]
    if pattern == "bias":
        kwargs["weight_bias"] = 0.5
    if pattern == "fp8":
        kwargs.update(quant="fp8", scale=FP8_SCALE)
    elif pattern == "fp8_dynamic":
        kwargs["quant"] = "fp8_dynamic"
    elif pattern.startswith("nvfp4"):
        kwargs.update(quant="nvfp4", scale=NVFP4_SCALE,
                      layout="linear" if pattern == "nvfp4_linear" else "swizzled_128x4")
    elif pattern in FP8_GROUP:
        kwargs.update(quant="fp8_group", layout=FP8_GROUP[pattern][0],
                      group_size=FP8_GROUP[pattern][1])
    return kwargs


def _bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.new_empty(t.shape).copy_(t).view(torch.uint8)


# --- per-process bodies (module level: run_ranks pickles them by name) ------------------------

def kernel_isa(rank: int, world: int) -> str:
    module = shm_build.load()
    return "pure-torch" if module is None else str(module.isa)


def conversions(rank: int, world: int) -> dict[str, Any]:
    """The vector and scalar roundings of random and special fp32 bit patterns, and the NVFP4
    block code both ways, in this process's build."""
    module = shm_build.load()
    assert module is not None, shm_build.why_not()
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(-(2**31), 2**31, (1 << 18,), generator=gen, dtype=torch.int64)
    raw = torch.cat([raw, raw & 0x807FFFFF, raw | 0x7F800000,  # denormals; NaN and infinity
                     torch.tensor([0x7F7FFFFF, 0x477FF000, 0x477FEFFF, 0x387FC000, 0x33000001,
                                   0x3F808000, 0x3F818000, 0x00018000])])
    x = raw.to(torch.int32).view(torch.float32)
    report: dict[str, Any] = {"isa": str(module.isa), "x": x}
    for code, name in ((0, "bf16"), (1, "fp16")):
        round_to = module.diagnostics.round_to
        report[f"{name}_scalar"] = round_to(x, code, False).view(torch.int16)
        try:
            report[f"{name}_vector"] = round_to(x, code, True).view(torch.int16)
        except ValueError:
            report[f"{name}_vector"] = None
    from test_kernel_exact import nvfp4_special

    for dtype in (torch.bfloat16, torch.float16):
        blocks, _, _ = nvfp4_special(dtype)
        for vector in (False, True):
            try:
                report[f"nvfp4 {dtype} {vector}"] = module.diagnostics.nvfp4_quantize(
                    blocks, 6.0, vector)
            except (ValueError, RuntimeError):
                report[f"nvfp4 {dtype} {vector}"] = None
    return report


def matrix(rank: int, world: int, mode: str, stores: str = "auto",
           replicated: bool = False) -> dict[str, Any]:
    """Every case of the matrix on this rank: the raw bytes of every output (``stores``: how
    the kernel stores new outputs, see ShmWorkspace.set_output_stores; ``replicated``: the
    residual promised the same on every rank, as it is here, so that two-shot finishes the
    other owners' rows from their residual_out)."""
    import arfuse

    module = shm_build.load()
    report: dict[str, Any] = {"isa": "pure-torch" if module is None else str(module.isa)}
    for dtype in DTYPES:
        for hidden in STREAMING_HIDDENS if stores == "streaming" else HIDDENS:
            data = case_inputs(dtype, hidden, world)
            comm = arfuse.FusedAllReduce(max_token_num=TOKENS, hidden_dim=hidden,
                                         dtype=DTYPES[dtype], backend="shm", strict=True,
                                         timeout_s=30, replicated_residual=replicated)
            comm.workspace.set_mode(mode)  # type: ignore[attr-defined]
            comm.workspace.set_output_stores(stores)  # type: ignore[attr-defined]
            report["path"] = comm.workspace.path  # type: ignore[attr-defined]
            for pattern in patterns(dtype, hidden):
                res = comm(data["xs"][rank], **call_kwargs(pattern, data))
                report[(dtype, hidden, pattern)] = tuple(_bytes(t) for t in res)
            assert comm.stats()["fused"] == comm.stats()["calls"]
            comm.close()
    return report


# --- the reference ------------------------------------------------------------------------------

def documented_out(residual_out: torch.Tensor, weight: torch.Tensor,
                   weight_bias: float) -> torch.Tensor:
    """out = T((r * inv) * (weight_bias + w)), inv = 1 / sqrt(ss / H + eps), ss summed in 32
    lanes (lane = h % 32, in order) combined by halving (lane i + lane i + 16, then i + 8, 4,
    2, 1): numpy float32, one IEEE operation at a time."""
    r = residual_out.float().numpy()
    tokens, hidden = r.shape
    lanes = np.zeros((32, tokens), dtype=np.float32)
    with np.errstate(all="ignore"):
        for lane in range(min(32, hidden)):
            sq = r[:, lane::32] * r[:, lane::32]
            lanes[lane] = np.cumsum(sq, axis=1, dtype=np.float32)[:, -1]
        width = 16
        while width >= 1:
            lanes[:width] = lanes[:width] + lanes[width:2 * width]
            width //= 2
        ss = lanes[0]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(hidden) + np.float32(EPS))
        gain = np.float32(weight_bias) + weight.float().numpy()
        out = (r * inv[:, None]) * gain
    return torch.from_numpy(out).to(residual_out.dtype)


def same_or_both_nan(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-equal, except that a NaN only has to be a NaN (torch makes its NaNs canonical)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan), f"{what}: NaN in other places"
    view = INT_VIEW[{torch.bfloat16: "bf16", torch.float16: "fp16",
                     torch.float32: "fp32"}[want.dtype]]
    differ = got.view(view)[~nan] != want.view(view)[~nan]
    assert not bool(differ.any()), f"{what}: {int(differ.sum())} values differ"


def nan_codes_by_rule(codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (uint8) with the sign of each NaN code by the kernel's NaN rule
    (conversions.h): an element of ``out`` that is a NaN gives its own sign, a NaN that the
    quantisation made (inf / inf) the default NaN's, negative. torch's NaNs follow the machine
    instead (on aarch64 a made NaN is positive, and fp16 -> fp32 drops a NaN's sign); on x86
    this changes nothing."""
    codes = codes.view(torch.uint8).to(torch.int32)
    view = out.view(INT_VIEW[{torch.bfloat16: "bf16", torch.float16: "fp16",
                              torch.float32: "fp32"}[out.dtype]])
    negative = torch.where(torch.isnan(out.float()), view < 0, True)
    fixed = (codes & 0x7F) | torch.where(negative, 0x80, 0)
    return torch.where((codes & 0x7F) == 0x7F, fixed, codes).to(torch.uint8)


def check_against_reference(dtype: str, hidden: int, world: int, pattern: str,
                            outputs: tuple[Any, ...],
                            data: dict[str, Any] | None = None) -> None:
    """``outputs`` (the raw bytes of a call of ``pattern``) against the reference on ``data``
    (``case_inputs`` by default)."""
    data = case_inputs(dtype, hidden, world) if data is None else data
    torch_dtype = DTYPES[dtype]
    kwargs = call_kwargs(pattern, data)
    out_b, residual_b, quant_b, scale_b = outputs
    out = out_b.view(torch_dtype).view(TOKENS, hidden)
    summed = rank_order_sum(torch.stack(data["xs"])).to(torch_dtype)
    what = f"{dtype} hidden {hidden} {pattern}"
    if pattern == "plain":
        same_or_both_nan(out, summed, what + " out")
    else:
        pre = summed.float()
        if "residual" in kwargs:
            pre = pre + data["residual"].float()
        residual_out = residual_b.view(torch_dtype).view(TOKENS, hidden)
        same_or_both_nan(residual_out, pre.to(torch_dtype), what + " residual_out")
        want = documented_out(residual_out, data["weight"], kwargs.get("weight_bias", 0.0))
        same_or_both_nan(out, want, what + " out")
    q = kwargs.get("quant")
    if q == "fp8":
        codes = nan_codes_by_rule(quant.fp8_quantize(out, FP8_SCALE), out)
        assert torch.equal(quant_b, codes), what
    elif q == "fp8_dynamic":
        codes, scales = quant.fp8_dynamic_quantize(out)
        assert torch.equal(quant_b, nan_codes_by_rule(codes, out)), what
        assert torch.equal(scale_b, scales.view(torch.uint8)), what
    elif q == "nvfp4":
        codes, scales = quant.nvfp4_quantize(out, NVFP4_SCALE, kwargs["layout"])
        assert torch.equal(quant_b, codes) and torch.equal(scale_b, scales), what
    elif q == "fp8_group":
        codes, scales = quant.fp8_group_quantize(out, kwargs["group_size"], kwargs["layout"])
        assert torch.equal(quant_b, nan_codes_by_rule(codes, out)), what
        assert torch.equal(scale_b, _bytes(scales)), what


# --- the tests ----------------------------------------------------------------------------------

def in_cache(isa: str) -> bool:
    """Whether the kernel cache holds a binary of ``isa``'s kernel (not checked: the loader
    checks it, and builds it again if it fails)."""
    key = shm_build.build_key(isa)
    return (shm_cache.cache_root() / f"shm-{key}" / f"arfuse_shm_{key}.so").exists()


@pytest.fixture(scope="module", autouse=True)
def every_isa_built() -> None:
    """Each path's kernel is built (or found in the cache) before any test gives its ranks a
    deadline: a cold build on a loaded machine can take longer than a rank's deadline, and
    building is not what these tests check. One process builds them all (``_build`` each,
    as ``load`` would; they import side by side), side by side (a thread each, each compile
    a process of its own); none when all are in the cache already (test.sh and
    scripts/arm_check.sh build them first): a process costs most of the time under
    emulation."""
    if all(in_cache(isa) for isa in ISAS):
        return
    build = ("import sys\nfrom concurrent.futures import ThreadPoolExecutor\n"
             "from arfuse.backends.shm import build\n"
             "with ThreadPoolExecutor(len(sys.argv) - 1) as pool:\n"
             "    built = list(pool.map(build._build, sys.argv[1:]))\n"
             "for isa, (module, why) in zip(sys.argv[1:], built, strict=True):\n"
             "    assert module is not None, f'{isa}: {why}'\n")
    subprocess.run([sys.executable, "-c", build, *ISAS], check=True, timeout=1800)


def test_every_isa_builds_from_its_own_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler here: the ISA chosen, its -m flags, its build key; a name the CPU cannot
    run is refused (not built: a binary it cannot run would die of SIGILL)."""
    assert ISAS[-1] == "scalar" and [i for i in shm_build.ISAS if i in ISAS] == ISAS
    keys = set()
    for isa in ISAS:
        monkeypatch.setenv("ARFUSE_SHM_ISA", isa)
        assert shm_build.target_isa() == isa and shm_build.isa_problem(isa) == ""
        flags = shm_build.compile_flags()
        assert ("-mavx512f" in flags) == isa.startswith("avx512")
        assert "-mavx512bf16" not in flags or isa == "avx512"
        assert ("-mavx2" in flags) == (isa not in ("scalar", "neon", "neon-nobf16"))
        assert f"-DARFUSE_ISA_{isa.split('-')[0].upper()}" in flags  # vec.h picks by it alone
        keys.add(shm_build.build_key())
    assert len(keys) == len(ISAS), "each ISA must have its own cache entry"
    monkeypatch.delenv("ARFUSE_SHM_ISA")
    assert shm_build.target_isa() == ISAS[0]
    assert "not one of" in shm_build.isa_problem("sse9")
    if shm_build.ARCH != "x86_64":
        return  # an Arm CPU's: test_an_arm_cpu_gets_neon_from_its_features
    monkeypatch.setattr(shm_build, "cpu_flags", lambda: {"avx2", "f16c", "fma"})
    assert shm_build.host_isas() == ["avx2", "scalar"]
    assert "lacks avx512f" in shm_build.isa_problem("avx512-nobf16")
    assert "lacks avx512f" in shm_build.isa_problem("avx512")


def test_an_arm_cpu_gets_neon_from_its_features(monkeypatch: pytest.MonkeyPatch) -> None:
    """aarch64 (no compiler needed): NEON, with +bf16 only where /proc/cpuinfo's Features has
    bf16; neon-nobf16 and scalar stay buildable (scalar named explicitly: the compiler defines
    __ARM_NEON whatever the target); x86's names are refused there."""
    monkeypatch.setattr(shm_build, "ARCH", "aarch64")
    monkeypatch.setattr(shm_build, "ISAS", ("neon", "neon-nobf16", "scalar"))
    monkeypatch.setattr(shm_build, "cpu_flags", lambda: {"fp", "asimd", "bf16"})
    monkeypatch.delenv("ARFUSE_SHM_ISA", raising=False)
    assert shm_build.host_isas() == ["neon", "neon-nobf16", "scalar"]
    assert shm_build.target_isa() == "neon"
    assert shm_build.compile_flags("neon")[-2:] == ["-DARFUSE_ISA_NEON", "-march=armv8.2-a+bf16"]
    assert shm_build.compile_flags("neon-nobf16")[-1] == "-DARFUSE_ISA_NEON"
    assert shm_build.compile_flags("scalar")[-1] == "-DARFUSE_ISA_SCALAR"
    assert "uses bf16" in shm_build.isa_reason("neon")
    assert "not one of neon, neon-nobf16, scalar" in shm_build.isa_problem("avx2")
    monkeypatch.setattr(shm_build, "cpu_flags", lambda: {"fp", "asimd"})  # Neoverse N1
    assert shm_build.compile_flags("neon")[-1] == "-DARFUSE_ISA_NEON"
    assert "lacks bf16" in shm_build.isa_reason("neon")
    monkeypatch.setattr(shm_build, "cpu_flags", lambda: {"fp"})
    assert shm_build.host_isas() == ["scalar"] and "lacks asimd" in shm_build.isa_problem("neon")
    monkeypatch.setenv("ARFUSE_SHM_ISA", "scalar")
    assert "ARFUSE_SHM_ISA names it" in shm_build.isa_reason()


@pytest.mark.parametrize("isa", shm_build.ISAS)
def test_one_rank_with_nan_and_inf_is_the_torch_epilogues_bytes_on_every_isa(isa: str) -> None:
    """``test_epilogue_bytes``'s comparison with NaN and infinities on each path, not only on
    the one this CPU runs by default: with one rank the sum adds nothing, so a signaling NaN
    reaches each rounding as it came (an output it was not rounded for kept it signaling)."""
    needs(isa)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    str(Path(__file__).with_name("test_epilogue_bytes.py")), "-k",
                    "test_torch_epilogue_is_the_kernel_bytes_with_nan_and_inf"],
                   env={**os.environ, "ARFUSE_SHM_ISA": isa}, check=True, timeout=600)


@pytest.mark.parametrize("isa", shm_build.ISAS)
def test_each_process_runs_the_isa_it_asked_for(isa: str) -> None:
    needs(isa)
    got = values(run_ranks(kernel_isa, 1, init=False, env={"ARFUSE_SHM_ISA": isa}))[0]
    assert built_for(isa, got), got


def test_conversions_and_nvfp4_blocks_are_the_same_on_every_isa() -> None:
    reports = {isa: values(run_ranks(conversions, 1, init=False,
                                     env={"ARFUSE_SHM_ISA": isa}))[0] for isa in ISAS}
    first = reports[ISAS[0]]
    x = first["x"]
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    nan = torch.isnan(x)
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        scalar = first[f"{name}_scalar"]
        torch_bits = x.to(dtype).view(torch.int16)
        assert torch.equal(scalar[~nan], torch_bits[~nan]), f"{name}: scalar rounding != torch"
        # NaN: quiet, sign and top of the payload kept (vcvtneps2bf16's and vcvtps2ph's rule)
        if name == "bf16":
            want_nan = ((u >> 16) | 0x40)[nan]
        else:
            want_nan = ((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF)
            want_nan = want_nan[nan]
        assert torch.equal(scalar[nan].to(torch.int64) & 0xFFFF, want_nan), name
        for isa, report in reports.items():
            assert torch.equal(report[f"{name}_scalar"], scalar), (isa, name)
            if isa != "scalar":
                assert report[f"{name}_vector"] is not None, (isa, name)
                assert torch.equal(report[f"{name}_vector"], scalar), (isa, name, "vector")
    from test_kernel_exact import nvfp4_special

    for dtype in (torch.bfloat16, torch.float16):
        _, codes, scales = nvfp4_special(dtype)
        for isa, report in reports.items():
            for vector in (False, True) if isa != "scalar" else (False,):
                got = report[f"nvfp4 {dtype} {vector}"]
                assert got is not None and torch.equal(got[0], codes), (isa, dtype, vector)
                assert torch.equal(got[1], scales), (isa, dtype, vector)


@pytest.mark.parametrize(("world", "mode", "stores", "replicated"),
                         [(2, "oneshot", "auto", False), (2, "twoshot", "auto", False),
                          (3, "twoshot", "auto", False), (4, "oneshot", "auto", False),
                          (2, "twoshot", "streaming", False), (2, "twoshot", "auto", True),
                          (3, "twoshot", "streaming", True)])
def test_numerics_matrix_gives_the_same_bytes_on_every_isa(world: int, mode: str,
                                                           stores: str, replicated: bool) -> None:
    """stores=streaming: new outputs with streaming stores (auto mode streams only from 8 MiB
    per output, beyond the matrix's sizes). replicated: replicated_residual=True, which
    changes what two-shot's result slot holds, not the bytes."""
    reports: dict[str, list[dict[str, Any]]] = {}
    for isa in ISAS:
        reports[isa] = values(run_ranks(matrix, world, mode, stores, replicated, timeout=240,
                                        env={"ARFUSE_SHM_ISA": isa}))
        for report in reports[isa]:
            assert built_for(isa, report["isa"]) and report["path"] == "c++", report["isa"]
    first = reports[ISAS[0]][0]
    cases = [key for key in first if isinstance(key, tuple)]
    hiddens = STREAMING_HIDDENS if stores == "streaming" else HIDDENS
    assert len(cases) == sum(len(patterns(d, h)) for d in DTYPES for h in hiddens)
    for key in cases:
        for isa, ranks in reports.items():
            for rank, report in enumerate(ranks):
                for name, a, b in zip(("out", "residual_out", "quant_out", "scale_out"),
                                      report[key], first[key], strict=True):
                    assert (a is None) == (b is None), (key, isa, rank, name)
                    assert a is None or torch.equal(a, b), \
                        f"{key} {name}: {isa} rank {rank} differs from {ISAS[0]} rank 0"
        check_against_reference(*key[:2], world, key[2], first[key])


def test_the_isa_switch_is_documented_in_the_build_module() -> None:
    doc = shm_build.__doc__ or ""
    assert "ARFUSE_SHM_ISA" in doc and all(isa in doc for isa in shm_build.ISAS)
