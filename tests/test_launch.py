"""Joining ranks a launcher such as torchrun started: what the environment must say, and a
rendezvous whose peers never arrive ending in one line within ARFUSE_TIMEOUT_S."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ["run", "--tokens", "1", "--hidden", "64", "--steps", "1"]
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _arfuse(env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    return subprocess.run([sys.executable, "-m", "arfuse.cli", *RUN], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={**base, "ARFUSE_LOG": "warning", "OMP_NUM_THREADS": "1", **env})


@pytest.mark.parametrize(("rank", "expected"), [
    (0, "1 of 2 ranks arrived, rank(s) 1 missing"),
    (1, "no store answered there"),
])
def test_a_rank_whose_peers_never_arrive_fails_within_the_settings_timeout(
        rank: int, expected: str) -> None:
    """Rank 0 hosts the store and waits for rank 1; rank 1 finds no store to join. Each ends
    after ARFUSE_TIMEOUT_S (not torch's own 120 s) with one line naming the phase, the
    address and who is missing, and no traceback."""
    port = _free_port()
    result = _arfuse({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                      "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": str(port), "ARFUSE_TIMEOUT_S": "3"}, timeout=90)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"arfuse: rank {rank}: RendezvousTimeout: "), lines[0]
    for words in ("after 3s in phase 'rendezvous'", f"at 127.0.0.1:{port}", expected):
        assert words in lines[0], lines[0]


def test_a_rendezvous_timeout_is_a_collective_timeout_that_survives_pickling() -> None:
    from arfuse.errors import CollectiveTimeout, RendezvousTimeout

    exc = RendezvousTimeout("10.0.0.1:29500", 4, [2, 3], 5.0, "gloo")
    again = pickle.loads(pickle.dumps(exc))
    assert isinstance(again, CollectiveTimeout) and isinstance(again, TimeoutError)
    assert str(again) == str(exc) and again.silent == (2, 3) and again.phase == "rendezvous"
    assert "2 of 4 ranks arrived, rank(s) 2, 3 missing" in str(exc)


@pytest.mark.parametrize("given", [
    {"RANK": "0", "WORLD_SIZE": "2"},
    {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
    {"WORLD_SIZE": "2", "MASTER_PORT": "29500"},
])
def test_a_launcher_environment_without_its_master_is_refused(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        given: dict[str, str]) -> None:
    """RANK and WORLD_SIZE without MASTER_ADDR made ``arfuse run`` start ranks of its own, as
    if no launcher had started it; now it says what is missing and starts nothing."""
    from arfuse import launch
    from arfuse.cli import main

    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("ranks were started"))
    assert main(RUN) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in given]
    assert f"but {', '.join(missing)} not" in err, err
