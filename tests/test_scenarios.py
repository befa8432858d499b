"""Every scenario in scenarios/ (the field's failures, docs/design.md section 1), each under its
own hard limit; and the runner itself: a hang fails instead of blocking, an overrun is killed
with everything it started, a wrong expectation fails."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from arfuse import scenarios
from arfuse.cli import main
from arfuse.cli import scenario as scenario_cli
from arfuse.scenarios import runner

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((ROOT / "scenarios").glob("*.toml"))


def test_every_design_row_has_a_scenario() -> None:
    rows = {row for path in SCENARIOS for row in scenarios.load_scenario(path).rows}
    assert rows == set(range(1, 13)), sorted(set(range(1, 13)) - rows)


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_scenario(path: Path) -> None:
    outcome = scenarios.run_one(path)
    if outcome.status == "skip":
        assert outcome.summary, "a skip must say why"
        pytest.skip(outcome.summary)
    assert outcome.status == "pass", "\n".join(outcome.problems)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(textwrap.dedent(text))
    return path


# rank 1 sleeps past the limit while rank 0 waits for it in a creation
ONE_RANK_HANGS = """
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
    """


def _fails_naming_the_hung_rank(path: Path, scale: float = 1.0) -> None:
    outcome = scenarios.run_one(path, scale)
    assert outcome.status == "fail"
    assert any("had to be killed (hung)" in p for p in outcome.problems), outcome.problems


def test_an_unexpected_hang_fails_within_the_limit(tmp_path: Path) -> None:
    _fails_naming_the_hung_rank(_write(tmp_path, ONE_RANK_HANGS))


def test_a_slow_job_start_does_not_turn_a_hang_into_an_overrun(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks' deadline counts from the runner's start of the job, not from the moment the
    job's process got going: a start slowed by 4 s still ends with the hung rank named, within
    the limit. The limit is doubled (20 s) so that, after the 4 s, the job keeps more time to
    import torch and fork its ranks than the plain hang above has on a busy machine; counted
    from the job's own start, the ranks' deadline would still fall past the kill."""
    monkeypatch.setattr(runner, "JOB_ENTRY", "import time; time.sleep(4); " + runner.JOB_ENTRY)
    _fails_naming_the_hung_rank(_write(tmp_path, ONE_RANK_HANGS), scale=2.0)


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
    monkeypatch.setattr(runner, "JOB_ENTRY", "import subprocess, time; "
                        "subprocess.Popen(['sleep', '300']); time.sleep(300)")
    outcome = scenarios.run_one(path)
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
    outcome = scenarios.run_one(path)
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
    outcome = scenarios.run_one(path)
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


def test_limit_scale_reaches_the_ranks_deadline(tmp_path: Path) -> None:
    """The job reads the file again: unless it gets the scale too, its ranks are killed at the
    unscaled deadline (3 s - 0.6 - 1 here) while the runner waits for the scaled limit."""
    path = _write(tmp_path, """
        ranks = 1
        limit_s = 3
        [[steps]]
        do = "sleep"
        seconds = 2
        """)
    outcome = scenarios.run_one(path, scale=5.0)
    assert outcome.status == "pass", outcome.problems
    assert outcome.scenario.limit_s == 15.0


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "0", "-1", "1e400", "1e300", "two"])
def test_a_bad_limit_scale_is_one_line(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """0 or a negative failed every scenario, inf and nan ended in a traceback."""
    with pytest.raises(SystemExit) as exc:
        main(["scenario", "run", str(ROOT / "scenarios"), f"--limit-scale={value}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "--limit-scale" in err and "> 0" in err, err


def test_the_command_line_prints_only_what_it_ran(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Run on scenarios/, the command also printed docs/reliability.md's recorded figures
    (two hosts, soak, fuzzing) after the live ones, as if this run had measured them."""
    def passed(path: Path, scale: float = 1.0) -> scenarios.Outcome:
        return scenarios.Outcome(scenarios.load_scenario(path), "pass", 0.1, "", [])

    monkeypatch.setattr(scenario_cli, "run_one", passed)
    monkeypatch.setenv("ARFUSE_SHM_PURE_TORCH", "1")  # no build either
    assert main(["scenario", "run", str(ROOT / "scenarios")]) == 0
    out = capsys.readouterr().out
    outcomes = [passed(path) for path in SCENARIOS]
    assert out.splitlines() == [
        *(f"PASS  {o.scenario.name} (0.1 s)" for o in outcomes), "",
        *runner.format_table(outcomes).splitlines(), "",
        *runner.coverage(outcomes).splitlines()], out


@pytest.mark.parametrize("where", ["missing/x.json", "."])
def test_a_bad_json_path_fails_before_any_scenario(where: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A typo in --json must not cost a whole run and then end in a traceback."""
    def never(path: Path, scale: float = 1.0) -> scenarios.Outcome:
        raise AssertionError(f"{path} ran although --json cannot be written")

    monkeypatch.setattr(scenario_cli, "run_one", never)
    monkeypatch.setenv("ARFUSE_SHM_PURE_TORCH", "1")  # no build either
    target = tmp_path / where
    code = main(["scenario", "run", str(ROOT / "scenarios"), "--json", str(target)])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "--json" in err, err


def test_an_interrupted_run_leaves_no_job_folder(tmp_path: Path) -> None:
    """Ctrl-C reaches the runner only (the job has a session of its own) and the job dies by
    its parent-death signal, so its own cleanup never runs: the runner must do it."""
    path = _write(tmp_path, """
        ranks = 1
        limit_s = 120
        [[steps]]
        do = "sleep"
        seconds = 110
        """)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    # SIGINT raises KeyboardInterrupt even where the caller's shell ignores it
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from arfuse.cli import main; sys.exit(main(sys.argv[1:]))")
    runner = subprocess.Popen([sys.executable, "-c", code, "scenario", "run", str(path)],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(3000):  # until the rank runs (it opens its report first)
            if list(tmpdir.glob("arfuse_scenario_*/rank0.jsonl")) or runner.poll() is not None:
                break
            time.sleep(0.02)
        assert runner.poll() is None, runner.communicate()[0]
        assert list(tmpdir.glob("arfuse_scenario_*/rank0.jsonl")), "the rank never started"
        runner.send_signal(signal.SIGINT)
        output, _ = runner.communicate(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.communicate()
    assert runner.returncode == 130, output
    assert not list(tmpdir.glob("arfuse_scenario_*")), sorted(os.listdir(tmpdir))
    for _ in range(250):  # the rank and the job die by SIGKILL: give them a moment
        if not _processes_with(f"TMPDIR={tmpdir}"):
            break
        time.sleep(0.02)
    assert not _processes_with(f"TMPDIR={tmpdir}"), "the job or its rank outlived the runner"


def _processes_with(entry: str) -> list[int]:
    """Live processes whose environment holds ``entry`` (the job's and its ranks')."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(int(pid))
    return found


def test_the_leak_check_counts_what_only_a_garbage_collection_would_free(
        tmp_path: Path) -> None:
    """A descriptor held by a reference cycle stays open until the collector happens to run:
    the leak check looks before it collects, and says so."""
    import gc

    class Holder:
        pass

    baseline = scenarios.LeakBaseline()
    gc.disable()
    try:
        holder = Holder()
        holder.me = holder  # type: ignore[attr-defined]
        holder.file = open(tmp_path / "held-by-a-cycle", "w")  # type: ignore[attr-defined]  # noqa: SIM115
        del holder
        leaks = baseline.leaks()
    finally:
        gc.enable()
    assert any("descriptors opened and not closed" in leak and "held-by-a-cycle" in leak
               and leak.endswith("(until a cyclic garbage collection)") for leak in leaks), leaks
    assert baseline.leaks() == []  # and the collection did free it
