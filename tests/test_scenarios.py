"""Every scenario in scenarios/ (the field's failures, docs/design.md section 1), each under its
own hard limit; and the runner itself: a hang fails instead of blocking, an overrun is killed
with everything it started, a wrong expectation fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from arfuse.cli import scenario

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((ROOT / "scenarios").glob("*.toml"))


def test_every_design_row_has_a_scenario() -> None:
    rows = {row for path in SCENARIOS for row in scenario.load_scenario(path).rows}
    assert rows == set(range(1, 13)), sorted(set(range(1, 13)) - rows)


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_scenario(path: Path) -> None:
    outcome = scenario.run_one(path)
    if outcome.status == "skip":
        assert outcome.summary, "a skip must say why"
        pytest.skip(outcome.summary)
    assert outcome.status == "pass", "\n".join(outcome.problems)
    assert outcome.seconds <= outcome.scenario.limit_s + 2.0


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_an_unexpected_hang_fails_within_the_limit(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        ranks = 2
        limit_s = 10
        [[steps]]
        do = "sleep"
        ranks = [1]
        seconds = 120
        [[steps]]
        do = "create"
        ranks = [0]
        timeout_s = 60
        """)
    started = time.monotonic()
    outcome = scenario.run_one(path)
    assert outcome.status == "fail"
    assert any("had to be killed (hung)" in p for p in outcome.problems), outcome.problems
    assert time.monotonic() - started < 10 + 3


def test_an_overrunning_job_is_killed_with_what_it_started(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    path = _write(tmp_path, """
        level = "decision"
        limit_s = 2
        [[reuse]]
        have = { max_tokens = 8, hidden = 16 }
        want = { max_tokens = 8, hidden = 16 }
        reuse = true
        """)
    # a job that never ends and has a child of its own
    monkeypatch.setattr(scenario, "_JOB_ENTRY", "import subprocess, time; "
                        "subprocess.Popen(['sleep', '300']); time.sleep(300)")
    started = time.monotonic()
    outcome = scenario.run_one(path)
    assert time.monotonic() - started < 2 + 3
    assert outcome.status == "fail" and "overran its limit" in outcome.problems[0]
    leftover = subprocess.run(["pgrep", "-f", "^sleep 300$"], capture_output=True, text=True)
    mine = [p for p in leftover.stdout.split() if _parent_gone_or_ours(int(p))]
    assert not mine, f"processes of the killed job survive: {mine}"


def _parent_gone_or_ours(pid: int) -> bool:
    """A ``sleep 300`` of ours: reparented (its job was killed) and started in this test."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    ppid = int(stat[stat.rindex(")") + 2:].split()[1])
    return ppid in (1, os.getpid())


def test_a_wrong_expectation_fails(tmp_path: Path) -> None:
    """The checks are not vacuous: the same group with a wrong expected backend fails."""
    path = _write(tmp_path, """
        ranks = 2
        limit_s = 30
        [[steps]]
        do = "create"
        expect = { backend = "torch" }
        [[steps]]
        do = "call"
        tokens = 3
        """)
    outcome = scenario.run_one(path)
    assert outcome.status == "fail"
    assert any("backend='shm', expected 'torch'" in p for p in outcome.problems), outcome.problems


def test_a_wrong_decision_expectation_fails(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        level = "decision"
        [[decide]]
        topology = { device = "cpu", world_size = 2 }
        spec = { max_tokens = 8, hidden = 16 }
        expect = { backend = "torch", node_count = 3 }
        """)
    outcome = scenario.run_one(path)
    assert outcome.status == "fail", outcome
    assert {p.split(":")[1].strip() for p in outcome.problems} == {
        "backend='shm', expected 'torch'", "node_count=1, expected 3"}


def test_the_command_line_prints_the_table(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "arfuse.cli", "scenario", "run",
                           str(ROOT / "scenarios" / "gpu-row03-triple-buffer-capacity.toml")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu-row03-triple-buffer-capacity" in proc.stdout and "PASS" in proc.stdout
    bad = _write(tmp_path, "level = 'nope'\n")
    proc = subprocess.run([sys.executable, "-m", "arfuse.cli", "scenario", "run", str(bad)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1 and "level='nope'" in proc.stdout, proc.stdout
    proc = subprocess.run([sys.executable, "-m", "arfuse.cli", "scenario", "run",
                           str(tmp_path / "missing")], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
