"""One scenario job: a fresh interpreter that forks the ranks, then checks the outcome and what
is left behind (segments, processes), in a private mount namespace when it mounts a tmpfs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..launch import die_with_parent, store_listener
from .decision import run_decision
from .language import Scenario, load_scenario, mentions, resolve_path, step_expect

# --- one job (one scenario) -------------------------------------------------------------------


def pgid_members(pgid: int) -> list[int]:
    """Live processes of a process group (zombies excluded), from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = Path(f"/proc/{entry}/stat").read_text()
            fields = text[text.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def segments_of(pids: Iterable[int], directories: Iterable[Path]) -> list[str]:
    left = []
    for directory in directories:
        with contextlib.suppress(OSError):
            for name in os.listdir(directory):
                if name.startswith("arfuse-") and any(name.startswith(f"arfuse-{p}-")
                                                     for p in pids):
                    left.append(str(directory / name))
    return left


def _substitute(value: Any, tmp: Path) -> str:
    return str(value).replace("{tmp}", str(tmp))


def _rank_envs(scn: Scenario, tmp: Path, tmpfs: Path | None) -> list[dict[str, str]]:
    data = scn.data
    common = {k: _substitute(v, tmp) for k, v in data.get("settings", {}).items()}
    if data.get("faults"):
        common["ARFUSE_FAULTS"] = str(data["faults"])
    if tmpfs is not None:
        common.setdefault("ARFUSE_SHM_DIR", str(tmpfs))
    if "topology" in data:
        path = tmp / "topology.json"
        path.write_text(json.dumps(data["topology"]))
        common["ARFUSE_TOPOLOGY"] = str(path)
    elif "topology_file" in data:
        common["ARFUSE_TOPOLOGY"] = str(resolve_path(scn, str(data["topology_file"])))
    envs = []
    for r in range(int(data["ranks"])):
        env = dict(common)
        env.update({k: _substitute(v, tmp) for k, v in
                    data.get("env_by_rank", {}).get(str(r), {}).items()})
        envs.append(env)
    return envs


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def _check_step(step: dict[str, Any], recs: dict[int, dict[str, Any]],
                ops_ws: dict[tuple[int, str], str], index: int) -> list[str]:
    """The step's expectations on every rank that ran it (``expect``, with a rank's own keys
    from ``expect_by_rank`` over it); numerics and identical bytes."""
    problems: list[str] = []
    for rank, rec in sorted(recs.items()):
        expect = step_expect(step, rank)
        where = f"step {index} ({step['do']}) rank {rank}"
        if expect.get("error"):
            if rec.get("ok"):
                problems.append(f"{where}: expected {expect['error']}, the step succeeded")
            else:
                if expect["error"] not in rec.get("error_mro", []):
                    problems.append(f"{where}: raised {rec.get('error_type')}, expected "
                                    f"{expect['error']}: {rec.get('error', '')[:400]}")
                problems += [f"{where}: message lacks {f!r}: {rec.get('error', '')[:400]}"
                             for f in expect.get("message", [])
                             if not mentions(rec.get("error", ""), f)]
        elif not rec.get("ok"):
            problems.append(f"{where}: raised {rec.get('error_type')}: "
                            f"{rec.get('error', '')[:400]}")
            continue
        for key in ("backend", "plan_backend", "node_count", "capacity", "fused",
                    "unfused_over_capacity", "live", "modes", "viable", "path"):
            if key in expect and rec.get(key) != expect[key]:
                problems.append(f"{where}: {key}={rec.get(key)!r}, expected {expect[key]!r}")
        if "within_s" in expect and rec["seconds"] > float(expect["within_s"]):
            problems.append(f"{where}: took {rec['seconds']:.2f} s, limit {expect['within_s']}")
        attempts = " | ".join(rec.get("attempts", []))
        if "attempt_failed" in expect and f"{expect['attempt_failed']}: failed" not in attempts:
            problems.append(f"{where}: no failed {expect['attempt_failed']} attempt: {attempts}")
        problems += [f"{where}: attempts lack {f!r}: {attempts}"
                     for f in expect.get("attempts_mention", []) if f not in attempts]
        for name, fragment in expect.get("reasons", {}).items():
            reason = rec.get("candidates", {}).get(name, "")
            if fragment not in reason:
                problems.append(f"{where}: reason for {name} {reason!r} lacks {fragment!r}")
        if "same_workspace_as" in expect and expect["same_workspace_as"] not in rec.get(
                "same_as", []):
            problems.append(f"{where}: not the workspace of op {expect['same_workspace_as']}")
        if expect.get("new_workspace") and rec.get("same_as"):
            problems.append(f"{where}: reused the workspace of {rec['same_as']}")
        if step["do"] == "create" and rec.get("backend") == "shm":
            modes = rec.get("segment_modes", [])
            if not modes or any(m != 0o600 for m in modes):
                problems.append(f"{where}: segment modes {[oct(m) for m in modes]}, expected "
                                "0o600 owned by this user")
        if step["do"] == "call" and rec.get("max_ratio", 0.0) > 1.0:
            problems.append(f"{where}: result off the float64 reference: {rec['max_ratio']:.3g} "
                            "x the tolerance")
    if step["do"] == "call" and step.get("expect", {}).get("identical", True):
        by_group: dict[str, set[str]] = {}
        for rec in recs.values():
            if rec.get("ok") and "digest" in rec:
                by_group.setdefault(str(rec["group"]), set()).add(rec["digest"])
        for group, digests in by_group.items():
            if len(digests) > 1:
                problems.append(f"step {index}: ranks {group} got different bytes")
    return problems


def evaluate(scn: Scenario, per_rank: dict[int, list[dict[str, Any]]],
             exitcodes: dict[int, int | None], hung: list[int]) -> tuple[list[str], str]:
    """Compare what every rank reported with the scenario's expectations."""
    data = scn.data
    expect = data.get("expect", {})
    world = int(data["ranks"])
    problems: list[str] = []
    want_hung = sorted(int(r) for r in expect.get("hung", []))
    if sorted(hung) != want_hung:
        problems.append(f"ranks {sorted(hung)} had to be killed (hung); expected {want_hung}")
    want_codes = {int(k): int(v) for k, v in expect.get("exit_codes", {}).items()}
    for r in range(world):
        if r in hung:
            continue
        want = want_codes.get(r, 0)
        if exitcodes.get(r) != want:
            fatal = [rec["fatal"] for rec in per_rank.get(r, []) if "fatal" in rec]
            problems.append(f"rank {r} exited with {exitcodes.get(r)}, expected {want}"
                            + (f": {fatal[0][:400]}" if fatal else ""))
    ops_ws: dict[tuple[int, str], str] = {}
    for index, step in enumerate(data.get("steps", [])):
        runs_on = [r for r in step.get("ranks", range(world))]
        recs = {r: rec for r in runs_on for rec in per_rank.get(r, [])
                if rec.get("step") == index}
        missing = [r for r in runs_on if r not in recs and r not in want_hung
                   and want_codes.get(r, 0) == 0]
        if missing:
            problems.append(f"step {index} ({step['do']}): no report from rank(s) {missing} "
                            "(an earlier step diverged, or the rank died or hung)")
        problems += _check_step(step, recs, ops_ws, index)
    for r in range(world):
        finals = [rec for rec in per_rank.get(r, []) if rec.get("final")]
        if finals and finals[-1]["leaks"]:
            problems.append(f"rank {r} leaks after destroy_all: {finals[-1]['leaks']}")
        elif not finals and r not in hung and want_codes.get(r, 0) == 0:
            problems.append(f"rank {r} never reached its leak check")
    return problems, _summary(per_rank)


def _summary(per_rank: dict[int, list[dict[str, Any]]]) -> str:
    backends: dict[str, set[int]] = {}
    errors: dict[str, set[int]] = {}
    for rank, recs in per_rank.items():
        for rec in recs:
            if rec.get("do") == "create" and rec.get("ok"):
                backends.setdefault(str(rec["backend"]), set()).add(rank)
            if rec.get("ok") is False:
                errors.setdefault(str(rec.get("error_type")), set()).add(rank)
    parts = [f"{b} on ranks {sorted(rs)}" for b, rs in backends.items()]
    parts += [f"{e} on ranks {sorted(rs)}" for e, rs in errors.items()]
    return "; ".join(parts)


def _mount_tmpfs(target: Path, size: str) -> str:
    """Mount a tmpfs of ``size`` at ``target``; "" or why it could not be done."""
    target.mkdir(parents=True, exist_ok=True)
    if os.environ.get("ARFUSE_SCENARIO_PRIVATE_MOUNTS") != "1":
        return "not in a private mount namespace"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777",
                           "arfuse-scenario", str(target)], capture_output=True, text=True)
    return "" if proc.returncode == 0 else f"mount failed: {proc.stderr.strip()}"


def _prepare_ranks(envs: list[dict[str, str]]) -> None:
    """Import torch and build (or load) the kernel once in the parent, so the forked ranks share
    them and no rank's timed step pays for either."""
    import torch  # noqa: F401

    if not any(e.get("ARFUSE_SHM_PURE_TORCH") == "1" for e in envs):
        from ..backends.shm import build as shm_build

        shm_build.load()


def _wait_for_ranks(procs: list[Any], want_hung: set[int], end: float) -> list[int]:
    """Wait until every rank exits, or only the ranks expected to hang are left, or ``end``;
    then kill what still runs. Returns the ranks that were still running."""
    while time.monotonic() < end and any(p.is_alive() for p in procs):
        others = [p for r, p in enumerate(procs) if r not in want_hung]
        if want_hung and not any(p.is_alive() for p in others):
            time.sleep(0.3)  # the expected hang must still be hanging, not exiting late
            break
        time.sleep(0.02)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    return hung


def _leftovers(pids: list[int], dirs: set[Path]) -> list[str]:
    """What the job left behind: rank processes, other processes of its group, segments."""
    problems = []
    left = [p for p in pids if Path(f"/proc/{p}").exists()
            and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[-1][:3]]
    if left:
        problems.append(f"rank processes still alive: {left}")
    stray = [p for p in pgid_members(os.getpgrp()) if p != os.getpid()
             and p not in (os.getppid(),)]
    if stray:
        problems.append(f"processes of the job still running: {stray}")
    segs = segments_of(pids, dirs)
    private = [d for d in dirs if d != Path("/dev/shm")]
    segs += [str(d / n) for d in private for n in os.listdir(d) if n.startswith("arfuse-")]
    if segs:
        problems.append(f"segments left behind: {sorted(set(segs))}")
    return problems


def run_job(scn: Scenario, deadline_s: float, tmp: Path | None = None) -> dict[str, Any]:
    """Fork the ranks, wait for them within ``deadline_s``, and check outcome and leaks. ``tmp``
    is the job's folder (the runner's, so that it can remove it when it has to kill the job)."""
    import multiprocessing as mp

    started = time.monotonic()
    data = scn.data
    world = int(data["ranks"])
    if tmp is None:
        tmp = Path(tempfile.mkdtemp(prefix="arfuse_scenario_"))
    tmpfs: Path | None = None
    try:
        if scn.needs_tmpfs:
            tmpfs = tmp / "tmpfs"
            why = _mount_tmpfs(tmpfs, str(data["shm_tmpfs"]))
            if why:
                return {"status": "skip", "problems": [], "summary": f"no tmpfs: {why}"}
        envs = _rank_envs(scn, tmp, tmpfs)
        dirs = {Path("/dev/shm")} | {Path(e["ARFUSE_SHM_DIR"]) for e in envs
                                     if "ARFUSE_SHM_DIR" in e}
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        _prepare_ranks(envs)
        # imported here, in the job before it forks (each rank inherits torch), not by the
        # runner, which starts jobs and needs no torch
        from .ranks import rank_main

        ctx = mp.get_context("fork")
        reports = [tmp / f"rank{r}.jsonl" for r in range(world)]
        with store_listener() as listener:  # rank 0 serves the store on it; forks inherit it
            procs = [ctx.Process(target=rank_main, args=(data, r, world, listener, envs[r],
                                                          str(reports[r]), deadline_s))
                     for r in range(world)]
            for p in procs:
                p.start()
        pids = [int(p.pid or 0) for p in procs]
        want_hung = {int(r) for r in data.get("expect", {}).get("hung", [])}
        hung = _wait_for_ranks(procs, want_hung, started + deadline_s)
        exitcodes = {r: p.exitcode for r, p in enumerate(procs)}
        per_rank = {r: _records(reports[r]) for r in range(world)}
        problems, summary = evaluate(scn, per_rank, exitcodes, hung)
        problems += _leftovers(pids, dirs)
        return {"status": "fail" if problems else "pass", "problems": problems,
                "summary": summary, "pids": pids, "hung": hung,
                "exitcodes": {str(k): v for k, v in exitcodes.items()}}
    finally:
        if tmpfs is not None:
            subprocess.run(["umount", "-l", str(tmpfs)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def job_main(argv: list[str] | None = None) -> None:
    """``python -c 'from arfuse.scenarios.job import job_main; job_main()' FILE OUT [SCALE
    [TMP [KILL_AT]]]``: the file is read again here, so the runner's ``--limit-scale`` comes as
    SCALE (else the ranks' deadline would be the unscaled one), its folder for the job as TMP,
    and as KILL_AT the ``time.monotonic()`` (one clock for every process of the machine) at
    which it kills the job: the ranks' deadline is counted from there, so the time this
    process takes to start on a loaded machine cannot push the job past the runner's kill."""
    argv = sys.argv[1:] if argv is None else argv
    path, out = argv[0], argv[1]
    scale = float(argv[2]) if len(argv) > 2 else 1.0
    tmp = Path(argv[3]) if len(argv) > 3 else None
    die_with_parent()
    started = time.monotonic()
    try:
        scn = load_scenario(path).scaled(scale)
        kill_at = float(argv[4]) if len(argv) > 4 else started + scn.limit_s
        margin = min(3.0, 0.2 * scn.limit_s)  # to stop the ranks, check leaks, report
        if scn.level == "decision":
            result = run_decision(scn)
        else:
            result = run_job(scn, max(0.5, kill_at - margin - 1.0 - time.monotonic()), tmp)
    except Exception as exc:
        result = {"status": "fail", "problems": [f"{type(exc).__name__}: {exc}"], "summary": ""}
    result["seconds"] = round(time.monotonic() - started, 3)
    Path(out).write_text(json.dumps(result, default=str))
    sys.stdout.flush()
    os._exit(0)
