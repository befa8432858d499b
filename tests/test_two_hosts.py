"""Two real hosts on this machine: Linux namespaces, torchrun across them.

Each host is a network + UTS + mount + IPC namespace of its own: its own hostname, its own
/dev/shm (a tmpfs mounted in its private mount namespace), and one end of a veth pair with an
address of a private /30 that exists only inside these two namespaces (no traffic leaves them).
torchrun starts one or two ranks per host (a static rendezvous on host A's address), and the
group must look like what it is: two nodes, which ``auto`` runs on ``hier``. Skips where
namespaces are not allowed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
ADDRESSES = ("10.213.37.1", "10.213.37.2")   # a /30 only inside the namespaces made here
DEVICES = ("arfuse-veth-a", "arfuse-veth-b")
HOSTNAMES = ("arfuse-host-a", "arfuse-host-b")
LIMIT_S = 150.0


def _why_not() -> str:
    """Why two hosts cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and veth pairs)"
    for tool in ("unshare", "nsenter", "ip", "mount"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"{tool} is not installed"
    if not TORCHRUN.exists():
        return f"torchrun not found next to {sys.executable}"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "--ipc", "--fork", "--",
                            "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"namespaces are not allowed here: {probe.stderr.strip()[-200:]}"
    return ""


def _ip() -> str:
    return shutil.which("ip") or "/usr/sbin/ip"


def _in(pid: int, *command: str, spaces: str = "-n") -> None:
    subprocess.run(["nsenter", "-t", str(pid), spaces, "--", *command], check=True,
                   capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def two_hosts(limit_s: float = LIMIT_S, shm_mib: int = 64) -> Iterator[list[int]]:
    """Two hosts, each held by a ``sleep`` in its namespaces, with a ``/dev/shm`` of
    ``shm_mib``; gone (veth pair included) when the holders end (at the latest a minute after
    ``limit_s``, a job's limit)."""
    holders = [subprocess.Popen(["unshare", "--net", "--uts", "--mount", "--ipc", "--fork",
                                 "--", "sleep", str(int(limit_s) + 60)],
                                start_new_session=True) for _ in range(2)]
    try:
        own = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + 10
        while any(os.readlink(f"/proc/{h.pid}/ns/net") == own for h in holders):
            assert time.monotonic() < deadline, "the namespaces were not made"
            time.sleep(0.02)
        pids = [h.pid for h in holders]
        # made inside host A with its peer straight in host B: never in this namespace
        _in(pids[0], _ip(), "link", "add", DEVICES[0], "type", "veth", "peer", "name",
            DEVICES[1], "netns", str(pids[1]))
        for i, pid in enumerate(pids):
            _in(pid, _ip(), "addr", "add", f"{ADDRESSES[i]}/30", "dev", DEVICES[i])
            _in(pid, _ip(), "link", "set", DEVICES[i], "up")
            _in(pid, _ip(), "link", "set", "lo", "up")
            _in(pid, "hostname", HOSTNAMES[i], spaces="-u")
            _in(pid, "mount", "-t", "tmpfs", "-o", f"size={shm_mib}m,mode=1777",
                f"shm-{HOSTNAMES[i]}", "/dev/shm", spaces="-m")
        yield pids
    finally:
        for h in holders:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(h.pid, signal.SIGKILL)
            h.wait(10)


def _run_job(pids: list[int], nproc: int, out: Path) -> list[dict[str, object]]:
    """The two-host rank body (tests/ranks_two_hosts.py) on both hosts; its reports."""
    _torchrun(pids, nproc, [str(ROOT / "tests" / "ranks_two_hosts.py"), "two_hosts",
                            str(out)])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2 * nproc)]


def _torchrun(pids: list[int], nproc: int, target: list[str],
              limit_s: float = LIMIT_S) -> list[str]:
    """torchrun on both hosts, one rendezvous; every process killed past ``limit_s``."""
    procs = []
    for node, pid in enumerate(pids):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": DEVICES[node], "ARFUSE_LOG": "warning",
               "ARFUSE_TIMEOUT_S": "20", "OMP_NUM_THREADS": "1"}
        env = {k: v for k, v in env.items() if k not in ("ARFUSE_BACKEND", "ARFUSE_TOPOLOGY",
                                                          "ARFUSE_FAULTS", "ARFUSE_SHM_DIR")}
        command = ["nsenter", "-t", str(pid), "-n", "-u", "-m", "-i", "--", str(TORCHRUN),
                   "--nnodes", "2", "--nproc-per-node", str(nproc), "--node-rank", str(node),
                   "--master-addr", ADDRESSES[0], "--master-port", "29511",
                   "--max-restarts", "0", *target]
        procs.append(subprocess.Popen(command, env=env, cwd=ROOT, start_new_session=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    deadline = time.monotonic() + limit_s
    try:
        for p in procs:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(text)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the two-host job overran {limit_s:g} s (killed)")
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"torchrun exit codes {codes}:\n" + "\n".join(
        o[-3000:] for o in outputs)
    return outputs


pytestmark = pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "-")


def test_two_hosts_one_rank_each(tmp_path: Path) -> None:
    with two_hosts() as pids:
        reports = _run_job(pids, 1, tmp_path)
    assert [r["hostname"] for r in reports] == list(HOSTNAMES)
    for r in reports:
        # each host has its own /dev/shm: only its own marker is there
        assert r["dev_shm"] == [f"two-hosts-marker-rank{r['rank']}"], r["dev_shm"]
        auto = r["auto"]
        assert auto["node_count"] == 2 and auto["world_size"] == 2, auto
        assert auto["backend"] == "hier" and auto["viable"] == ["hier", "torch"], auto
        assert "single node only" in auto["reasons"]["shm"], auto
        assert auto["max_ratio"] <= 1.0 and auto["calls"] == 20, auto
        forced = r["forced_shm"]
        assert forced["backend"] == "torch" and forced["node_count"] == 2, forced
        assert "single node only" in forced["reasons"]["shm"], forced
        assert forced["max_ratio"] <= 1.0, forced
        # a topology that says one host: shm is tried, fails on every rank, all move on
        lying = r["forced_shm_one_host_topology"]
        assert lying["plan_backend"] == "shm" and lying["node_count"] == 1, lying
        assert lying["backend"] == "torch", lying
        assert lying["attempts"][0].startswith("shm: failed"), lying
        assert "rank 1" in lying["attempts"][0], lying
        assert lying["max_ratio"] <= 1.0, lying
        assert r["leaks"] == [] and r["segments_left"] == [], r
    attempts = {r["forced_shm_one_host_topology"]["attempts"][0] for r in reports}
    assert len(attempts) == 1, attempts  # the same verdict on both hosts


def test_two_hosts_two_ranks_each_node_local_groups(tmp_path: Path) -> None:
    """R6 on real hosts: the world group spans two nodes (torch); each host's TP group of two
    ranks is one node and gets shm."""
    with two_hosts() as pids:
        reports = _run_job(pids, 2, tmp_path)
    assert [r["hostname"] for r in reports] == [HOSTNAMES[0]] * 2 + [HOSTNAMES[1]] * 2
    for r in reports:
        assert r["auto"]["node_count"] == 2 and r["auto"]["backend"] == "hier", r["auto"]
        assert r["auto"]["max_ratio"] <= 1.0
        local = r["node_local_group"]
        assert local["node_count"] == 1 and local["world_size"] == 2, local
        assert local["backend"] == "shm", local
        assert local["max_ratio"] <= 1.0 and local["stats"]["fused"] == 20, local
        assert r["leaks"] == [] and r["segments_left"] == [], r


def test_arfuse_run_across_two_hosts() -> None:
    """The README's "Several machines" command: ``arfuse run`` joins torchrun's ranks, checks
    every result against its float64 reference, and exits 0 only if all match."""
    with two_hosts() as pids:
        outputs = _torchrun(pids, 1, ["-m", "arfuse.cli", "run", "--tokens", "1,8,100",
                                      "--hidden", "64", "--dtype", "fp32", "--steps", "2"])
    report = outputs[0]  # rank 0 prints
    assert "nodes=2" in report and "negotiated: hier" in report, report
    assert report.count(" ok\n") == 3 and "MISMATCH" not in report, report


def test_a_link_that_goes_down_mid_run_makes_every_rank_raise(tmp_path: Path) -> None:
    """hier on 2 hosts x 2 ranks; after 12 good calls host B's end of the link goes down. Every
    rank on both hosts raises within the call's timeout (6 s) and the store's grace, host B's
    too, although the store is on host A and no longer reachable."""
    with two_hosts(LIMIT_S) as pids:
        procs = []
        for node, pid in enumerate(pids):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": DEVICES[node], "ARFUSE_LOG": "warning",
                   "OMP_NUM_THREADS": "1"}
            env = {k: v for k, v in env.items() if k not in (
                "ARFUSE_BACKEND", "ARFUSE_TOPOLOGY", "ARFUSE_FAULTS", "ARFUSE_SHM_DIR")}
            procs.append(subprocess.Popen(
                ["nsenter", "-t", str(pid), "-n", "-u", "-m", "-i", "--", str(TORCHRUN),
                 "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
                 "--master-addr", ADDRESSES[0], "--master-port", "29511", "--max-restarts",
                 "0", str(ROOT / "tests" / "ranks_two_hosts.py"), "link_down", str(tmp_path)],
                env=env, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
        try:
            deadline = time.monotonic() + LIMIT_S / 2
            while len(list(tmp_path.glob("ready-rank*"))) < 4:
                assert time.monotonic() < deadline, "the job never made its 12 calls"
                assert all(p.poll() is None for p in procs), "the job ended before its calls"
                time.sleep(0.1)
            _in(pids[1], _ip(), "link", "set", DEVICES[1], "down")
            down = time.monotonic()
            while len(list(tmp_path.glob("rank*.json"))) < 4:
                assert time.monotonic() < down + 60, sorted(p.name for p in tmp_path.iterdir())
                time.sleep(0.1)
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    for r in range(4):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["backend"] == "hier", got
        assert got["type"] in ("CallTimeout", "WorkspaceBroken"), got
        assert got["seconds"] < 6 + 2.5 + 10, got  # the timeout, the store's grace, room
