"""scripts/gpu_check.sh's Python part runs its steps on CPU ranks too (``--device cpu``), so the
script a lent GPU machine gets is known to work before any GPU time is spent on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_runs_its_steps_on_cpu_ranks(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
         "--tokens", "1,8", "--hidden", "128", "--steps", "3", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, "ARFUSE_LOG": "warning"})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(next(tmp_path.glob("gpu-check-*-2.json")).read_text())
    for backend in ("backend:auto", "backend:torch"):
        rows = report[backend]
        assert len(rows) == 6 * 2 and all(r["ok"] for r in rows), rows
    # the SGLang drop-in's rows: on CPU ranks every one declines as SGLang does, without error
    assert [(r["setting"], r["dtype"]) for r in report["sglang"]] == [
        (s, d) for s in ("auto", "mnnvl", "trtllm") for d in ("bfloat16", "float32")]
    assert all(r["ok"] and not r["ready"] for r in report["sglang"]), report["sglang"]
    assert {r["tokens"] for r in report["latency"]} == {1, 8}
    assert all(r["torch_us"] > 0 and r["unfused_us"] > 0 for r in report["latency"])
    assert len(report["facts"]) == 2
