"""What each process checks alone, before any group step: the files and variables it reads
(absurd topology files, malformed faults, paths that are no regular file: refused at once,
naming the source, never blocking on a FIFO), and the backends' local checks, which explain
and run apply as creation does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arfuse import topology

ROOT = Path(__file__).resolve().parent.parent


def _explain(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "arfuse.cli", "explain", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "ARFUSE_LOG": "warning", **(env or {})})


@pytest.mark.parametrize(("content", "message"), [
    (json.dumps({"world_size": 10**8}), "world_size=100000000 is not valid"),
    (json.dumps({"world_size": 10**12}), "is not valid"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (b'{"device": "\xff"}', "not UTF-8"),
    (" " * (5 << 20), "larger than"),
])
def test_absurd_topology_files_fail_at_once_naming_the_file(tmp_path: Path, content: object,
                                                            message: str) -> None:
    path = tmp_path / "topo.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(str(content))
    with pytest.raises(ValueError, match=message) as info:
        topology.load(path)
    assert str(path) in str(info.value)
    result = _explain("--topology", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr


def test_an_empty_hosts_list_is_a_wrong_length_not_one_host() -> None:
    from arfuse.topology import Topology

    with pytest.raises(ValueError, match="hosts has 0 entries but world_size=4"):
        Topology.from_dict({"device": "cpu", "world_size": 4, "hosts": []})
    assert Topology.from_dict({"device": "cpu", "world_size": 4}).node_count == 1  # left out


@pytest.mark.parametrize("faults", ["shm.create", "nccl.create@1=raise", "shm.call@1=null",
                                    "shm.create@x=raise"])
def test_explain_refuses_malformed_faults_as_the_api_does(faults: str) -> None:
    from arfuse.faults import parse

    with pytest.raises(ValueError):
        parse(faults)
    result = _explain(env={"ARFUSE_FAULTS": faults})
    assert result.returncode == 2 and "ARFUSE_FAULTS" in result.stderr, result.stderr


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo.json"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind", ["FIFO", "directory", "character device"])
def test_a_topology_path_that_is_no_regular_file_is_refused_naming_its_source(
        tmp_path: Path, kind: str) -> None:
    """A FIFO blocked open() forever (no writer ever comes); a device or a directory is no
    file of settings either. Each is refused at once, naming the path and where it came from.
    Run in a child process: a blocking open would hang, and the test must fail, not hang."""
    path = {"FIFO": lambda: _fifo(tmp_path), "directory": lambda: tmp_path,
            "character device": lambda: Path("/dev/null")}[kind]()
    code = ("import sys; from arfuse import topology\n"
            "try:\n"
            f"    topology.load({str(path)!r}, '--topology')\n"
            "except ValueError as exc:\n"
            "    print(exc); sys.exit(3)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"topology file {str(path)!r} (--topology) is not a regular file ({'a ' + kind})" \
        in result.stdout


def test_an_arfuse_topology_fifo_fails_creation_instead_of_blocking(tmp_path: Path) -> None:
    path = _fifo(tmp_path)
    code = ("import sys, torch, arfuse\n"
            "try:\n"
            "    arfuse.FusedAllReduce(max_token_num=4, hidden_dim=16, dtype=torch.float32,\n"
            "                          timeout_s=3)\n"
            "except ValueError as exc:\n"
            "    print(exc); sys.exit(3)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=ROOT,
                            env={**os.environ, "ARFUSE_TOPOLOGY": str(path),
                                 "ARFUSE_LOG": "warning"})
    assert result.returncode == 3, result.stdout + result.stderr
    assert "(ARFUSE_TOPOLOGY) is not a regular file (a FIFO)" in result.stdout


@pytest.mark.parametrize("source", ["flag", "variable"])
def test_explain_with_a_fifo_topology_is_one_line_exit_2(tmp_path: Path, source: str) -> None:
    path = _fifo(tmp_path)
    if source == "flag":
        result = _explain("--topology", str(path))
    else:
        result = _explain(env={"ARFUSE_TOPOLOGY": str(path)})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert ("(--topology)" if source == "flag" else "(ARFUSE_TOPOLOGY)") in result.stderr
    assert "not a regular file (a FIFO)" in result.stderr


def test_a_fifo_among_scenario_files_fails_that_scenario_instead_of_blocking(
        tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "blocked.toml")
    result = subprocess.run([sys.executable, "-m", "arfuse.cli", "scenario", "run",
                             str(tmp_path)], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env={**os.environ, "ARFUSE_LOG": "warning"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL" in result.stdout and "is not a regular file (a FIFO)" in result.stdout


def test_the_plan_states_the_shm_kernels_token_limit() -> None:
    from arfuse.backends.shm.layout import MAX_TOKENS

    result = _explain("--topology", str(ROOT / "examples/topologies/cpu-host-2.json"),
                      "--max-tokens", str(2**20), "--hidden", "16", "--json")
    plan = json.loads(result.stdout)
    assert plan["backend"] == "torch", plan
    shm = next(c for c in plan["candidates"] if c["backend"] == "shm")
    assert not shm["viable"] and str(MAX_TOKENS) in shm["reason"], shm


def test_a_full_shm_dir_is_reported_in_kib_not_as_zero_mib(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    """A 64 KiB tmpfs and a ~100 KiB segment: the reason must not say "0 MiB ... 0 MiB"."""
    from types import SimpleNamespace

    from arfuse.backends.shm import backend as shm_backend
    from arfuse.spec import Spec

    monkeypatch.setenv("ARFUSE_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(shm_backend.os, "statvfs",
                        lambda _path: SimpleNamespace(f_bavail=16, f_frsize=4096))
    reason = shm_backend.ShmBackend().local_check(SimpleNamespace(world_size=2),
                                               Spec(max_tokens=64, hidden=256))
    assert reason.startswith(f"{tmp_path} has 64 KiB free, the segment needs ")
    needed = int(reason.split("needs ")[1].split(" KiB")[0])
    assert needed > 64


@pytest.mark.parametrize("machine", ["aarch64", "x86_64"])
def test_the_pure_torch_shm_path_is_offered_only_where_stores_keep_their_order(
        monkeypatch: pytest.MonkeyPatch, machine: str) -> None:
    """Without a compiled kernel, shm runs its pure-torch path, whose flags are plain stores
    after the data: only x86's store order makes the data visible first. Elsewhere the
    candidate says why it is out (the kernel's flags are release stores on every CPU)."""
    from types import SimpleNamespace

    from arfuse.backends.shm import backend as shm_backend
    from arfuse.backends.shm import build as shm_build
    from arfuse.spec import Spec

    monkeypatch.setattr(shm_build, "load", lambda: None)
    monkeypatch.setattr(shm_build, "why_not", lambda: "no C++ compiler")
    monkeypatch.setattr(shm_backend.platform, "machine", lambda: machine)
    reason = shm_backend.ShmBackend().local_check(SimpleNamespace(world_size=2),
                                               Spec(max_tokens=8, hidden=64))
    if machine == "x86_64":
        assert reason == ""
    else:
        assert reason == ("no compiled kernel (no C++ compiler) and the pure-torch path relies "
                          "on x86's store order; this CPU is aarch64")


@pytest.fixture
def shm_dir_without_room(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The shm backend's directory with 64 KiB free: too small for any segment here."""
    from types import SimpleNamespace

    from arfuse.backends.shm import backend as shm_backend

    if torch.cuda.is_available():
        pytest.skip("explain plans for CUDA ranks on this machine: shm is not a candidate")
    for name in ("ARFUSE_TOPOLOGY", "ARFUSE_BACKEND", "ARFUSE_STRICT"):
        monkeypatch.delenv(name, raising=False)
    statvfs = os.statvfs
    monkeypatch.setenv("ARFUSE_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(shm_backend.os, "statvfs", lambda path: SimpleNamespace(
        f_bavail=16, f_frsize=4096) if Path(path) == tmp_path else statvfs(path))
    return tmp_path


def test_explain_for_this_machine_runs_the_local_checks_creation_runs(
        shm_dir_without_room: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """/dev/shm could not hold the segment: explain said shm, negotiation picked torch."""
    from arfuse.cli import main
    from arfuse.cli.explain import LOCAL_CHECKS_NOT_RUN, LOCAL_CHECKS_RUN

    assert main(["explain", "--world-size", "2", "--max-tokens", "64", "--hidden", "256",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["backend"] == "torch" and plan["local_checks"] == LOCAL_CHECKS_RUN, plan
    shm = next(c for c in plan["candidates"] if c["backend"] == "shm")
    assert not shm["viable"] and shm["reason"].startswith(f"{shm_dir_without_room} has 64 KiB")
    # a topology file describes another group: this machine's checks do not apply, and say so
    assert main(["explain", "--topology", str(ROOT / "examples/topologies/cpu-host-2.json")]) == 0
    text = capsys.readouterr().out
    assert "chosen: shm" in text and f"local checks: {LOCAL_CHECKS_NOT_RUN}" in text


def test_run_refuses_before_starting_ranks_what_their_local_checks_refuse(
        shm_dir_without_room: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from arfuse import launch
    from arfuse.cli import main

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("ranks were started"))
    assert main(["run", "--tokens", "64", "--hidden", "256", "--backend", "shm", "--strict"]) == 2
    error = capsys.readouterr().err
    assert "ARFUSE_STRICT=1 and no fused backend can run here" in error
    assert f"{shm_dir_without_room} has 64 KiB free" in error
