"""The runner: one job per scenario in a process session of its own, killed whole when its
hard limit is over, so a hang fails and never blocks; the table and coverage of the outcomes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .job import pgid_members, segments_of
from .language import Scenario, load_scenario

JOB_ENTRY = "from arfuse.scenarios.job import job_main; job_main()"


# --- the runner ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    scenario: Scenario
    status: str
    seconds: float
    summary: str
    problems: list[str]


_NS_PREFIXES = (["unshare", "--mount", "--propagation", "private", "--"],
                ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private",
                 "--"])


def private_mount_prefix() -> tuple[list[str] | None, str]:
    """How to start a job in a private mount namespace here, or why it cannot be done."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return None, "unshare(1) or mount(8) is not installed"
    why = ""
    for prefix in _NS_PREFIXES:
        probe = subprocess.run([*prefix, "sh", "-c", "d=$(mktemp -d) && mount -t tmpfs -o "
                                "size=64k x \"$d\" && umount \"$d\"; r=$?; rmdir \"$d\"; "
                                "exit $r"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return prefix, ""
        why = probe.stderr.strip()[-200:]
    return None, f"mount namespaces are not allowed here ({why})"


def _job_env() -> dict[str, str]:
    """Hermetic: the caller's ARFUSE_* settings do not leak into a scenario; what concerns the
    installation does (the kernel's cache, or running without it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARFUSE_")
           or k in ("ARFUSE_CACHE_DIR", "ARFUSE_SHM_PURE_TORCH")}
    env["ARFUSE_LOG"] = "warning"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _stop_session(proc: subprocess.Popen[str]) -> None:
    """Kill the job's whole session (it runs in one of its own) and wait until none of it is
    left, so that nothing writes into the job's folder once it is removed."""
    if proc.poll() is None or pgid_members(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    end = time.monotonic() + 5.0
    while pgid_members(proc.pid) and time.monotonic() < end:
        time.sleep(0.02)


@dataclass
class _JobRun:
    """How the job's process ended: its code and output, whether it overran (and the processes
    its session had then), and the processes of its session still there after it ended."""

    returncode: int | None
    output: str
    overran: bool
    seen: set[int]
    remaining: list[int]


def _run_job_process(path: Path, out: Path, scale: float, prefix: list[str],
                     env: dict[str, str], limit: float) -> _JobRun:
    """The job in a session of its own, killed whole at ``limit``. Its folder is made and
    removed here: a job killed (overrun, Ctrl-C) cannot clean up after itself."""
    job_tmp = tempfile.mkdtemp(prefix="arfuse_scenario_")
    proc: subprocess.Popen[str] | None = None
    try:
        kill_at = time.monotonic() + limit
        proc = subprocess.Popen([*prefix, sys.executable, "-c", JOB_ENTRY, str(path),
                                 str(out), repr(scale), job_tmp, repr(kill_at)],
                                env=env, start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        seen: set[int] = set()
        overran = False
        try:
            output, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            overran = True
            seen.update(pgid_members(proc.pid))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        time.sleep(0.05)
        return _JobRun(proc.returncode, output, overran, seen, pgid_members(proc.pid))
    finally:  # also on Ctrl-C: the job's session goes, then its folder
        if proc is not None:
            _stop_session(proc)
        shutil.rmtree(job_tmp, ignore_errors=True)


def run_one(path: Path, scale: float = 1.0) -> Outcome:
    """One scenario under its hard limit (times ``scale``): the job's whole session is
    killed when it overruns, and what it left is checked either way."""
    started = time.monotonic()
    try:
        scn = load_scenario(path).scaled(scale)
    except ValueError as exc:
        return Outcome(Scenario(path, {}), "fail", 0.0, "", [str(exc)])
    env = _job_env()
    prefix: list[str] = []
    if scn.needs_tmpfs:
        found, why = private_mount_prefix()
        if found is None:
            return Outcome(scn, "skip", 0.0, f"/dev/shm full needs a tmpfs: {why}", [])
        prefix = found
        env["ARFUSE_SCENARIO_PRIVATE_MOUNTS"] = "1"
    with tempfile.TemporaryDirectory(prefix="arfuse_scenario_out_") as out_dir:
        out = Path(out_dir) / "result.json"
        job = _run_job_process(path, out, scale, prefix, env, scn.limit_s)
        seconds = time.monotonic() - started
        if job.overran:
            left = segments_of(job.seen, [Path("/dev/shm")])
            return Outcome(scn, "fail", seconds, "", [
                f"overran its limit of {scn.limit_s:g} s: killed (a hang fails, it never blocks)"]
                + ([f"segments left: {left}"] if left else []))
        try:
            result = json.loads(out.read_text())
        except (OSError, json.JSONDecodeError):
            return Outcome(scn, "fail", seconds, "", [
                f"the job ended (code {job.returncode}) without a result: {job.output[-800:]}"])
    problems = list(result.get("problems", []))
    if job.remaining:
        problems.append(f"processes of the job outlived it: {job.remaining}")
    left = segments_of(result.get("pids", []), [Path("/dev/shm")])
    if left:
        problems.append(f"segments left in /dev/shm: {left}")
    status = "fail" if problems else str(result.get("status", "fail"))
    return Outcome(scn, status, seconds, str(result.get("summary", "")), problems)


def format_table(outcomes: list[Outcome]) -> str:
    width = max([len(o.scenario.name) for o in outcomes] + [8])
    lines = [f"{'scenario':<{width}}  {'rows':<8} {'level':<8} {'result':<6} {'s':>6}  detail"]
    for o in outcomes:
        rows = ",".join(map(str, o.scenario.rows)) or "-"
        detail = o.problems[0] if o.problems else o.summary
        lines.append(f"{o.scenario.name:<{width}}  {rows:<8} {o.scenario.level:<8} "
                     f"{o.status.upper():<6} {o.seconds:>6.1f}  {detail[:160]}")
        for extra in o.problems[1:4]:
            lines.append(f"{'':<{width}}  {'':<8} {'':<8} {'':<6} {'':>6}  {extra[:160]}")
    passed = sum(o.status == "pass" for o in outcomes)
    failed = sum(o.status == "fail" for o in outcomes)
    skipped = sum(o.status == "skip" for o in outcomes)
    lines.append(f"\n{passed} passed, {failed} failed, {skipped} skipped, "
                 f"{sum(o.seconds for o in outcomes):.1f} s")
    return "\n".join(lines)


def coverage(outcomes: list[Outcome]) -> str:
    """DESIGN 1 row -> scenarios -> level -> result, as markdown (docs/reliability.md)."""
    lines = ["| design row | scenario | level | result |", "|---|---|---|---|"]
    for row in range(1, 13):
        for o in outcomes:
            if row in o.scenario.rows:
                level = "decision" if o.scenario.level == "decision" else "real ranks"
                lines.append(f"| {row} | `{o.scenario.name}` | {level} | {o.status} |")
    cases = [(c, o) for o in outcomes for c in o.scenario.cases]
    if cases:
        lines += ["", "| case | scenario | level | result |", "|---|---|---|---|"]
        for case, o in sorted(cases, key=lambda item: item[0]):
            level = "decision" if o.scenario.level == "decision" else "real ranks"
            lines.append(f"| {case} | `{o.scenario.name}` | {level} | {o.status} |")
    return "\n".join(lines)
