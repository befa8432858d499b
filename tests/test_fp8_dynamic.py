"""Dynamic (per-token) FP8: the torch reference against an independent reading of FlashInfer's
rule (patterns 10/11: scale = max(amax / 448, 1 / (512 * 448)), q = e4m3(v / scale)), and the
same bytes on every CPU path and rank."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import arfuse
from arfuse import quant as q

import ranks_numerics
from harness import run_ranks, values


def independent(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Row by row in numpy float32: the amax skips NaN (fmaxf), a floor for zero rows."""
    v = x.float().numpy()
    amax = np.nan_to_num(np.abs(v), nan=0.0).max(axis=1, keepdims=True).astype(np.float32)
    scale = np.maximum(amax / np.float32(448.0), np.float32(1.0) / np.float32(512.0 * 448.0))
    ratio = torch.from_numpy((v / scale).astype(np.float32))
    codes = ratio.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return codes, scale.astype(np.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_matches_the_rule(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 64, generator=gen) * torch.tensor([1e-3, 1, 10, 300, 0, 1])[:, None])
    x = x.to(dtype)
    x[5, 3] = float("nan")
    codes, scales = q.fp8_dynamic_quantize(x)
    want_codes, want_scales = independent(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (6, 1)
    assert scales.dtype == torch.float32
    assert np.array_equal(scales.numpy(), want_scales)
    assert np.array_equal(codes.view(torch.uint8).numpy(), want_codes)
    assert scales[4, 0].item() == pytest.approx(1 / (512 * 448))  # a zero row: the floor


def test_fp8_dynamic_takes_no_scale() -> None:
    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="scale=None"):
        comm(torch.ones(2, 16), weight=torch.ones(16), quant="fp8_dynamic", scale=1.0)
    res = comm(torch.ones(2, 16), weight=torch.ones(16), quant="fp8_dynamic")
    codes, scales = q.fp8_dynamic_quantize(res.out)
    assert torch.equal(res.quant_out.view(torch.uint8), codes.view(torch.uint8))  # type: ignore[union-attr]
    assert torch.equal(res.scale_out, scales)  # type: ignore[arg-type]
    comm.close()


@pytest.mark.parametrize("backend", ["torch", "shm"])
def test_every_rank_gets_the_reference_bytes(backend: str) -> None:
    results = values(run_ranks(ranks_numerics.fp8_dynamic_call, 2, backend))
    assert results[0]["digest"] == results[1]["digest"]
    for r in results:
        assert r["matches_reference"], r


# --- the shm kernel runs fp8_dynamic itself -----------------------------------------------------

def fp8_dynamic_matrix(rank: int, world: int, mode: str) -> dict[str, Any]:
    """fp8_dynamic through the shm kernel's fast path on every dtype, odd and even hidden sizes,
    with and without RMSNorm, rows of zeros (the scale floor), NaN, infinities and values that
    saturate; returns the outputs' bytes and what the reference makes of the same ``out``."""
    import arfuse
    from arfuse.backends.shm import build as shm_build

    report: dict[str, Any] = {"cases": {}}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for hidden in (37, 1040):
            comm = arfuse.FusedAllReduce(max_token_num=9, hidden_dim=hidden, dtype=dtype,
                                         backend="shm", strict=True, quant="fp8_dynamic",
                                         timeout_s=30)
            comm.workspace.set_mode(mode)  # type: ignore[attr-defined]
            gen = torch.Generator().manual_seed(hidden + rank)
            x = (torch.randn(9, hidden, generator=gen) * 3).to(dtype)
            x[1] = 0.0                                       # a zero row: the floor scale
            x[2, 5] = float("nan") if rank == 0 else 1.0     # NaN does not count to the amax
            x[3, 7] = float("inf") if rank == 1 else 2.0     # inf: scale inf, codes 0 / NaN
            x[4] *= 1000                                      # large: no saturation (scaled)
            x[5, :3] = -0.0
            shared = torch.Generator().manual_seed(hidden)
            residual = torch.randn(9, hidden, generator=shared).to(dtype)
            weight = (torch.rand(hidden, generator=shared) + 0.5).to(dtype)
            for name, kwargs in (("plain", {}), ("norm", {"weight": weight}),
                                 ("residual", {"weight": weight, "residual": residual})):
                res = comm(x, quant="fp8_dynamic", **kwargs)
                codes, scales = q.fp8_dynamic_quantize(res.out)
                report["cases"][(str(dtype), hidden, name)] = {
                    "codes": res.quant_out.view(torch.uint8).clone(),  # type: ignore[union-attr]
                    "scales": res.scale_out.clone(),  # type: ignore[union-attr]
                    "ref_codes": codes.view(torch.uint8), "ref_scales": scales,
                    "out": res.out.clone()}
            stats = comm.stats()
            report["all_fast"] = report.get("all_fast", True) and stats["fused"] == stats["calls"]
            report["path"] = comm.workspace.path  # type: ignore[attr-defined]
            comm.close()
    module = shm_build.load()
    report["isa"] = "pure-torch" if module is None else str(module.isa)
    return report


@pytest.mark.parametrize(("world", "mode", "path"), [(2, "oneshot", "c++"), (2, "twoshot", "c++"),
                                                     (3, "twoshot", "c++"),
                                                     (2, "oneshot", "pure-torch")])
def test_shm_fp8_dynamic_is_the_reference_bytes_on_real_ranks(world: int, mode: str,
                                                              path: str) -> None:
    env = {"ARFUSE_SHM_PURE_TORCH": "1"} if path == "pure-torch" else {}
    reports = values(run_ranks(fp8_dynamic_matrix, world, mode, timeout=120, env=env))
    for report in reports:
        assert report["path"] == path and report["all_fast"], report["isa"]
        for key, case in report["cases"].items():
            assert torch.equal(case["codes"], case["ref_codes"]), key
            assert case["scales"].dtype == torch.float32 and case["scales"].shape == (9, 1)
            assert torch.equal(case["scales"], case["ref_scales"]), key
            assert case["scales"][1, 0].item() == q.FP8_DYNAMIC_MIN_SCALE or key[2] != "plain"
    for key in reports[0]["cases"]:  # every rank the same bytes
        first = reports[0]["cases"][key]
        for other in reports[1:]:
            case = other["cases"][key]
            assert torch.equal(case["codes"], first["codes"]), key
            assert torch.equal(case["scales"], first["scales"]), key
            assert torch.equal(case["out"].view(torch.uint8), first["out"].view(torch.uint8))


def test_shm_fast_path_takes_fp8_dynamic_without_a_scale() -> None:
    """One rank on private memory: quant='fp8_dynamic' runs in the kernel's fast path with
    scale=None (a scale makes it decline, and call_checks raises); the torch operator takes
    quant code 4 and returns the float32 [T, 1] scales; the descriptor names it."""
    from arfuse import signature
    from arfuse.backends.shm import build as shm_build
    from arfuse.backends.shm import layout as shm_layout
    from arfuse.pattern import Pattern
    from arfuse.result import FusedOutput

    module = shm_build.load()
    if module is None:
        pytest.skip(f"no compiled kernel here: {shm_build.why_not()}")
    tokens, hidden = 5, 48
    layout = shm_layout.ShmLayout(1, tokens, hidden, 2)
    memory = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    comm = module.ShmComm(memory.data_ptr(), 1, 0, tokens, hidden, 0, shm_layout.HEADER_BYTES,
                          layout.slot_bytes, layout.input_bytes, 10.0, 1 << 40)
    comm.set_result_type(FusedOutput)
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    w = (torch.rand(hidden) + 0.5).to(torch.bfloat16)
    res = comm.call(x, None, w, 1e-6, 0.0, "fp8_dynamic", None, "swizzled_128x4", None, None)
    assert isinstance(res, FusedOutput)
    codes, scales = q.fp8_dynamic_quantize(res.out)
    assert torch.equal(res.quant_out.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(res.scale_out, scales) and res.scale_out.shape == (tokens, 1)
    assert comm.call(x, None, w, 1e-6, 0.0, "fp8_dynamic", 1.0, "swizzled_128x4", None,
                     None) is None
    ops = torch.ops.arfuse.shm_fused_allreduce(int(comm.handle), x, None, w, 1e-6, 0.0, 4, 0.0,
                                               None, None)
    assert len(ops) == 4 and torch.equal(ops[3], scales)
    assert torch.equal(ops[2].view(torch.uint8), codes.view(torch.uint8))
    with pytest.raises(ValueError, match="fp8_dynamic"):
        torch.ops.arfuse.shm_fused_allreduce(int(comm.handle), x, None, w, 1e-6, 0.0, 8, 0.0,
                                             None, None)
    words = [signature.words(tokens, 0, hidden, Pattern("rmsnorm", "fp8_dynamic").code),
             signature.words(tokens, 0, hidden, Pattern("rmsnorm", "fp8").code)]
    assert "quant=fp8_dynamic" in signature.describe(*words[0])
    assert module.describe_signature(*words[0]) == signature.describe(*words[0])
    text = signature.mismatch_message("shm", 7, words)
    assert module.mismatch_message(7, words) == text and "they differ in quant;" in text
