"""benchmarks/peers.py's pure parts, without the peers' sources: the summary over runs and its
ratios to arfuse's row, the table, the correctness bound, and the files it asks a source root
for."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parent.parent


def _peers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("peers_script", ROOT / "benchmarks" /
                                                  "peers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_script"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _row(row: str, us: float, tokens: int = 1, dtype: str = "bf16") -> dict[str, object]:
    return {"dtype": dtype, "tokens": tokens, "row": row, "slowest_rank_median_us": us}


def test_summary_takes_the_median_over_runs_and_divides_by_arfuse() -> None:
    peers = _peers()
    runs = [[_row("shm-inplace", 10.0), _row("vllm", 9.0), _row("vllm+norm", 30.0)],
            [_row("shm-inplace", 12.0), _row("vllm", 15.0), _row("vllm+norm", 24.0)],
            [_row("shm-inplace", 11.0), _row("vllm", 12.0), _row("vllm+norm", 27.0)]]
    by = {r["row"]: r for r in peers.summarise(runs)}
    assert by["shm-inplace"]["median_us"] == 11.0 and by["shm-inplace"]["x_arfuse"] == 1.0
    assert by["vllm"]["per_run_us"] == [9.0, 15.0, 12.0]
    assert abs(by["vllm"]["x_arfuse"] - 12.0 / 11.0) < 1e-12
    assert abs(by["vllm+norm"]["x_arfuse"] - 27.0 / 11.0) < 1e-12


def test_a_size_without_arfuse_row_has_no_ratio_and_the_table_shows_a_dash() -> None:
    peers = _peers()
    summary = peers.summarise([[_row("vllm", 5.0, tokens=8), _row("shm-inplace", 4.0),
                                _row("vllm", 2.0), _row("sglang", 3.0, dtype="fp32")]])
    assert {r["x_arfuse"] for r in summary if r["tokens"] == 8} == {None}
    text = peers.table(summary, {"cpu": "test cpu"}, 1)
    lines = text.splitlines()
    assert lines[0].startswith("test cpu")
    one = next(line for line in lines if line.split()[:1] == ["1"])
    assert "4.0" in one and "(" in one and "0.50x" in one
    eight = next(line for line in lines if line.split()[:1] == ["8"])
    assert eight.split()[1] == "-" and "5.0" in eight
    assert "fp32" in lines and "sglang" in text


def test_the_bound_tells_rounding_from_a_wrong_sum() -> None:
    peers = _peers()
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 64, generator=gen).bfloat16() for _ in range(2)]
    residual = torch.randn(4, 64, generator=gen).bfloat16()
    weight = torch.rand(64, generator=gen).bfloat16() + 0.5
    total, new_residual, out = peers.reference(xs, residual, weight)
    # what a peer does: the sum rounded to bf16, then the add and the norm in fp32
    summed = (xs[0].float() + xs[1].float()).bfloat16()
    res = (residual.float() + summed.float()).bfloat16()
    normed = (res.float() * torch.rsqrt(res.float().pow(2).mean(-1, keepdim=True) + peers.EPS)
              * weight.float()).bfloat16()
    assert peers.worst_error(summed, total, "bf16") <= 1.0
    assert peers.worst_error(res, new_residual, "bf16") <= 1.0
    assert peers.worst_error(normed, out, "bf16") <= 1.0
    assert peers.worst_error(xs[0], total, "bf16") > 1.0  # one rank's data only
    checks = [{"dtype": "bf16", "tokens": 4,
               "worst_error_in_tolerances": {"vllm": 0.2, "sglang": 7.0}}]
    assert peers.failed_checks(checks) == ["bf16 4 tokens: sglang off by 7 tolerances"]


def test_a_source_root_is_asked_for_the_peers_files(tmp_path: Path) -> None:
    peers = _peers()
    vllm = peers.vllm_peer(tmp_path, avx512=True)
    assert [Path(f).name for f in peers.missing_files(vllm)] == ["shm.cpp", "layernorm.cpp"]
    # without AVX-512 vLLM builds no shm all-reduce: its norm alone, with its AVX2 flags
    avx2 = peers.vllm_peer(tmp_path, avx512=False)
    assert [Path(f).name for f in peers.missing_files(avx2)] == ["layernorm.cpp"]
    assert "-mavx2" in avx2.flags and not any("avx512" in f for f in avx2.flags)
    assert "-DPEER_VLLM_SHM" in vllm.flags and "-DPEER_VLLM_SHM" not in avx2.flags
    cpu = tmp_path / "csrc" / "cpu"
    cpu.mkdir(parents=True)
    for name in ("shm.cpp", "layernorm.cpp"):
        (cpu / name).write_text("")
    assert peers.missing_files(vllm) == []
    sglang = peers.sglang_peer(tmp_path)
    assert {Path(f).name for f in peers.missing_files(sglang)} == {"interface.cpp", "shm.cpp",
                                                                   "norm.cpp"}
    (tmp_path / "COMMIT").write_text("abc123\n")
    assert peers.source_commit(str(tmp_path)) == "abc123"
