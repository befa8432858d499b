"""Dynamic (per-token) FP8: the torch reference against an independent reading of FlashInfer's
rule (patterns 10/11: scale = max(amax / 448, 1 / (512 * 448)), q = e4m3(v / scale)), and the
same bytes on every CPU path and rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import arfuse
from arfuse import quant as q

import defect_workers as dw
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
    results = values(run_ranks(dw.fp8_dynamic_call, 2, backend))
    assert results[0]["digest"] == results[1]["digest"]
    for r in results:
        assert r["matches_reference"], r
