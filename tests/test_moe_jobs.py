"""The MoE patterns in the jobs: the inputs they make, ``arfuse run --pattern moe_*`` against
the float64 reference on real ranks, ``arfuse bench --pattern moe_finalize``'s rows, floor and
targets, and their flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cli import arfuse

from arfuse.bench.floor import moe_traffic
from arfuse.bench.targets import MOE_SPEEDUP_ROWS, moe_verdicts
from arfuse.moe_workload import (
    check_moe_sizes,
    expert_step_float64,
    make_expert_rows,
    torch_expert_step,
)


@pytest.mark.parametrize("none_every", [0, 3])
def test_finalize_inputs_are_a_grouped_gemms_layout(none_every: int) -> None:
    """Each (token, k) entry has its own row, the rows are in expert order, a token's experts
    are distinct, and every ``none_every``-th entry is -1."""
    tokens, top_k, experts = 7, 3, 5
    gen = torch.Generator().manual_seed(3)
    rows = make_expert_rows("moe_finalize", tokens, 16, top_k, experts, torch.float32, gen,
                            none_every=none_every)
    assert rows.index is not None and rows.index.dtype == torch.int32
    assert rows.rows.shape == (tokens * top_k, 16) and rows.scales.shape == (tokens, top_k)
    flat = rows.index.flatten()
    kept = flat[flat >= 0]
    assert sorted(kept.tolist()) == sorted(set(kept.tolist()))  # no row read twice
    if none_every:
        assert (flat[none_every - 1::none_every] == -1).all()
        assert int((flat == -1).sum()) == len(flat) // none_every
    else:
        assert sorted(flat.tolist()) == list(range(tokens * top_k))
    assert torch.allclose(rows.scales.sum(dim=1), torch.ones(tokens))


@pytest.mark.parametrize("pattern", ["moe_finalize", "moe_reduce"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_expert_step_is_the_float64_step_rounded(pattern: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    rows = make_expert_rows(pattern, 9, 64, 4, 8, dtype, gen,
                            none_every=4 if pattern == "moe_finalize" else 0, routed=2.5)
    want = expert_step_float64(rows)
    got = torch_expert_step(rows)
    assert got.dtype == dtype and got.shape == (9, 64)
    tolerance = 8 * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-23)
    assert ((got.double() - want).abs() <= tolerance * want.abs().max()).all()
    if pattern == "moe_finalize":  # the -1 entries count for nothing
        assert rows.index is not None and (rows.index == -1).any()
        dropped = rows.scales * (rows.index >= 0)
        assert torch.allclose(want, expert_step_float64(
            type(rows)(pattern, rows.rows, dropped, rows.index.clamp(min=0), rows.add,
                       rows.routed)))


def test_moe_job_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="--experts 4 is fewer than --top-k 8"):
        check_moe_sizes("moe_finalize", 8, 4)
    with pytest.raises(ValueError, match=r"--top-k 256 is not valid; use 1\.\.255"):
        check_moe_sizes("moe_reduce", 256, 64)
    with pytest.raises(ValueError, match="not a MoE pattern"):
        check_moe_sizes("residual_rmsnorm", 8, 64)
    result = arfuse("run", "--pattern", "moe_finalize", "--top-k", "8", "--experts", "4")
    assert result.returncode == 2 and "--experts 4 is fewer than --top-k 8" in result.stderr
    result = arfuse("bench", "--pattern", "moe_sum")
    assert result.returncode == 2 and "--pattern" in result.stderr


@pytest.mark.parametrize(("pattern", "dtype"), [("moe_finalize", "bf16"),
                                                ("moe_reduce", "fp32")])
def test_run_checks_a_moe_call_against_the_float64_reference(pattern: str, dtype: str) -> None:
    """On two ranks (shm): one- and two-shot sizes, the index with -1 entries, a shared
    expert and a routed scaling factor; outputs within the dtype's rounding of the float64
    reference, bytes identical on the ranks."""
    result = arfuse("run", "--world-size", "2", "--pattern", pattern, "--tokens", "1,40",
                    "--hidden", "128", "--top-k", "4", "--experts", "16", "--dtype", dtype,
                    "--steps", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "negotiated: shm" in result.stdout and pattern in result.stdout
    lines = [ln.split() for ln in result.stdout.splitlines()
             if ln.strip().startswith(("1 ", "40 "))]
    assert len(lines) == 2
    assert all(cols[3] == "yes" and cols[-1] == "ok" for cols in lines)


def test_run_a_moe_call_with_fp8_on_the_torch_backend() -> None:
    result = arfuse("run", "--world-size", "2", "--pattern", "moe_finalize", "--tokens", "3",
                    "--hidden", "64", "--top-k", "2", "--experts", "4", "--steps", "2",
                    "--quant", "fp8", "--backend", "torch", "--dtype", "fp32")
    assert result.returncode == 0, result.stdout + result.stderr
    row = next(ln.split() for ln in result.stdout.splitlines() if ln.strip().startswith("3 "))
    assert row[4] == "ok" and row[-1] == "ok"


def test_bench_times_the_fused_moe_call_against_torchs_step(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    result = arfuse("bench", "--pattern", "moe_finalize", "--tokens", "1,4", "--hidden", "128",
                    "--top-k", "4", "--experts", "8", "--dtype", "fp32", "--backends",
                    "shm,torch", "--out", str(out), "--min-seconds", "0.02")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "bench.json").read_text())
    assert report["options"]["pattern"] == "moe_finalize"
    rows = {(r["backend"], r["tokens"]) for r in report["results"]}
    assert rows == {(b, t) for b in ("shm", "torch-step+shm", "torch") for t in (1, 4)}
    for r in report["results"]:
        if r["backend"] != "shm":
            assert "x_floor" not in r
            continue
        size = r["tokens"] * 128 * 4
        # expert rows (top_k per token) and the shared expert read, then a plain call's bytes
        assert r["traffic"] == {"local": 4 * size + size + size, "shared": size, "peer": size,
                                "fresh": 2 * size}
    text = (out / "bench.txt").read_text()
    assert "moe_finalize (top_k 4 of 8 experts, a shared expert)" in text
    assert "torch step + fused AR / fused" in text and "(>= 3x: " in text
    assert "python overhead" not in text  # a plain call's figure: not this bench's


def test_moe_traffic_and_verdicts() -> None:
    moved = moe_traffic(100, 800, 100, 3)
    assert (moved.local, moved.shared, moved.peer, moved.fresh) == (1000, 100, 200, 200)
    report = {"results": [
        {"dtype": "bf16", "tokens": 1, "backend": "shm", "median_us": 10.0},
        {"dtype": "bf16", "tokens": 1, "backend": "torch-step+shm", "median_us": 35.0},
        {"dtype": "bf16", "tokens": 1, "backend": "torch-step+deepspeed+norm", "median_us": 30.0},
    ]}
    found = {v.target: v for v in moe_verdicts([report, report], (1,), ("bf16",))}
    assert set(found) == {name for name, _, _ in MOE_SPEEDUP_ROWS}
    fused_ar, deepspeed = (found[name] for name, _, _ in MOE_SPEEDUP_ROWS)
    assert fused_ar.per_run == [3.5, 3.5] and fused_ar.met is True
    assert deepspeed.median == 3.0 and deepspeed.met is False
    assert moe_verdicts([report], (2,), ("bf16",))[0].met is None  # not measured


def test_a_miss_is_out_of_reach_only_when_a_call_at_its_floor_would_miss_too() -> None:
    def report(floor_us: float) -> dict[str, Any]:
        return {"results": [
            {"dtype": "fp32", "tokens": 8, "backend": "shm", "median_us": 10.0,
             "floor_us": floor_us},
            {"dtype": "fp32", "tokens": 8, "backend": "torch-step+shm", "median_us": 25.0},
            {"dtype": "fp32", "tokens": 8, "backend": "torch-step+deepspeed+norm",
             "median_us": 45.0},
        ]}
    # the fused call at 1.25x its floor: 3x would need 8.33 us, the floor is 8 us (reachable)
    fused_ar, deepspeed = moe_verdicts([report(8.0)], (8,), ("fp32",))
    assert fused_ar.met is False and fused_ar.at_floor == [25.0 / 8.0]
    assert not fused_ar.out_of_reach and fused_ar.met_words() == "no (0/1)"
    assert deepspeed.met is True and not deepspeed.out_of_reach
    # at 1.1x its floor: even a call at the floor would be 2.75x (out of reach here)
    fused_ar, _ = moe_verdicts([report(10.0 / 1.1)], (8,), ("fp32",))
    assert fused_ar.out_of_reach
    assert fused_ar.met_words() == "no (0/1); 2.75x at the floor"
    # no floor recorded: a miss is just a miss
    bare = {"results": [{k: v for k, v in row.items() if k != "floor_us"}
                        for row in report(8.0)["results"]]}
    assert not moe_verdicts([bare], (8,), ("fp32",))[0].out_of_reach
