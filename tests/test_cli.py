"""The command line: explain on the shipped topologies, clean errors, doctor, run and bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from arfuse.backends.shm import build as shm_build

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = ROOT / "examples" / "topologies"


def arfuse(*args: str, env: dict[str, str] | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "ARFUSE_LOG": "warning", **(env or {})}
    return subprocess.run([sys.executable, "-m", "arfuse.cli", *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout, cwd=ROOT)


def explain_json(*args: str, env: dict[str, str] | None = None) -> dict:
    result = arfuse("explain", "--json", *args, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize(("name", "backend", "fallback", "viable"), [
    ("h200-nvswitch-8.json", "mnnvl", True, ["mnnvl", "trtllm", "torch"]),
    ("h200-nvl-bridges-8.json", "torch", False, ["torch"]),
    ("h100-2nodes-no-fabric.json", "torch", False, ["torch"]),
    ("gb200-2nodes-mnnvl-fabric.json", "mnnvl", False, ["mnnvl", "torch"]),
    ("cpu-host-2.json", "shm", False, ["shm", "torch"]),
    ("cpu-2hosts.json", "hier", False, ["hier", "torch"]),
])
def test_explain_on_shipped_topologies(name: str, backend: str, fallback: bool,
                                       viable: list[str]) -> None:
    plan = explain_json("--topology", str(TOPOLOGIES / name))
    assert set(plan) == {"requested", "explicit", "backend", "candidates", "allow_fallback",
                         "fused", "quant_fusion", "node_count", "workspace_bytes",
                         "max_fused_tokens", "warnings", "local_checks"}
    assert plan["backend"] == backend and plan["allow_fallback"] is fallback
    assert [c["backend"] for c in plan["candidates"] if c["viable"]] == viable
    assert all(c["reason"] for c in plan["candidates"])
    assert (plan["workspace_bytes"] > 0) == (backend != "torch")


def test_explain_quant_and_explicit_backend() -> None:
    plan = explain_json("--topology", str(TOPOLOGIES / "gb200-2nodes-mnnvl-fabric.json"),
                        "--quant", "nvfp4", "--dtype", "torch.float16", "--max-tokens", "128")
    assert plan["quant_fusion"] is True
    plan = explain_json("--topology", str(TOPOLOGIES / "h200-nvswitch-8.json"),
                        "--backend", "trtllm")
    assert plan["explicit"] and plan["backend"] == "trtllm" and not plan["allow_fallback"]


def test_explain_human_output_for_this_machine() -> None:
    result = arfuse("explain")
    assert result.returncode == 0, result.stderr
    assert "candidate" in result.stdout and "chosen:" in result.stdout and "MiB" in result.stdout
    assert "shm kernel here: " in result.stdout  # the path this CPU gets, and why
    from arfuse.backends.shm import build as shm_build

    assert shm_build.isa_reason() in result.stdout or "pure-torch path" in result.stdout


RUN_SMALL = ["--world-size", "2", "--tokens", "1", "--hidden", "64", "--steps", "1"]
HUGE = "99999999999999999999"  # beyond int64


@pytest.mark.parametrize(("args", "env", "message"), [
    (["explain"], {"ARFUSE_BACKEND": "nccl"}, "ARFUSE_BACKEND='nccl' is not valid"),
    (["explain"], {"ARFUSE_STRICT": "yes"}, "ARFUSE_STRICT"),
    (["explain"], {"ARFUSE_TIMEOUT_S": "-1"}, "ARFUSE_TIMEOUT_S"),
    (["explain"], {"ARFUSE_LOG": "loud"}, "ARFUSE_LOG"),
    (["explain", "--topology", "/no/such/file.json"], {}, "cannot read topology file"),
    (["explain", "--topology", str(TOPOLOGIES / "h100-2nodes-no-fabric.json"),
      "--backend", "trtllm"], {}, "use 'mnnvl'"),
    (["explain", "--quant", "int4"], {}, "quant"),
    # run and bench check before starting ranks (each rank used to fail with exit 1)
    (["run", *RUN_SMALL], {"ARFUSE_FAULTS": "bogus"}, "ARFUSE_FAULTS"),
    (["run", *RUN_SMALL], {"ARFUSE_TOPOLOGY": "/no/such/file.json"}, "cannot read topology"),
    (["run", *RUN_SMALL, "--backend", "mnnvl", "--strict"], {}, "ARFUSE_STRICT=1"),
    (["run", *RUN_SMALL, "--device", "cuda"], {}, "--device cuda"),
    (["bench", "--tokens", "1", "--dtype", ","], {}, "names no dtype"),
    (["bench", "--tokens", "1", "--backends", ","], {}, "--backends"),
    (["bench", "--tokens", "1", "--out", __file__], {}, "is a file"),
    (["bench", "--tokens", "1"], {"ARFUSE_TIMEOUT_S": "bogus"}, "ARFUSE_TIMEOUT_S"),
    (["bench", "--tokens", "1"], {"ARFUSE_FAULTS": "bogus"}, "ARFUSE_FAULTS"),
    # sizes no kernel takes, and jobs this machine cannot hold: refused before any rank starts
    (["explain", "--world-size", HUGE], {}, "--world-size: '99999999999999999999' is too large"),
    (["doctor", "--world-size", HUGE], {}, "--world-size: '99999999999999999999' is too large"),
    (["run", *RUN_SMALL, "--world-size", HUGE], {}, "--world-size"),
    (["run", *RUN_SMALL, "--world-size", "65536"], {}, "more ranks than this machine runs"),
    (["bench", "--tokens", "1", "--world-size", "65536"], {}, "more ranks than this machine"),
    (["run", *RUN_SMALL, "--tokens", HUGE], {}, "--tokens: '99999999999999999999' is too large"),
    (["run", *RUN_SMALL, "--tokens", f"1,{HUGE}"], {}, "use 1..2147483647"),
    (["run", *RUN_SMALL, "--hidden", HUGE], {}, "--hidden: '99999999999999999999' is too large"),
    (["run", *RUN_SMALL, "--hidden", "2147483647"], {}, "GiB of memory"),
    (["bench", "--tokens", "1", "--hidden", "2147483647", "--backends", "torch"], {},
     "GiB of memory"),
    (["explain", "--max-tokens", HUGE], {}, "--max-tokens"),
    # each token's pick of its experts: tokens x experts, drawn on every rank
    (["run", *RUN_SMALL, "--pattern", "moe_finalize", "--experts", "1000000000000"], {},
     "--experts 1000000000000 --tokens 1, each token's pick of its experts needs at least "
     "12,000,000,000,000 bytes"),
    (["bench", "--tokens", "1", "--backends", "torch", "--pattern", "moe_finalize",
      "--experts", "1000000000000"], {}, "--experts 1000000000000 --tokens 1, each token's"),
    (["run", *RUN_SMALL, "--pattern", "moe_reduce", "--tokens", "2147483647"], {},
     "--top-k 8 --tokens 2147483647 --hidden 64 (bf16), the expert rows"),
    (["bench", "--tokens", "2147483647", "--hidden", "4096", "--backends", "torch",
      "--pattern", "moe_reduce"], {}, "--top-k 8 --tokens 2147483647 --hidden 4096, the expert"),
    (["run", *RUN_SMALL, "--world-size", "3"],
     {"ARFUSE_TOPOLOGY": str(TOPOLOGIES / "cpu-host-2.json")},
     "ARFUSE_TOPOLOGY describes world_size=2 but the job has 3 ranks"),
    (["bench", "--tokens", "1", "--min-seconds", "-1"], {}, "--min-seconds: '-1' is not valid"),
    (["bench", "--tokens", "1", "--min-seconds", "nan"], {}, "--min-seconds: 'nan' is not valid"),
    (["bench", "--tokens", "1", "--min-seconds", "0"], {}, "--min-seconds: '0' is not valid"),
    (["bench", "--tokens", "1", "--min-seconds", "inf"], {}, "--min-seconds: 'inf' is not valid"),
    # fp8_group's group size and scale format
    (["run", *RUN_SMALL, "--quant", "fp8", "--group-size", "64"], {},
     "--group-size is for --quant fp8_group, got --quant fp8"),
    (["run", *RUN_SMALL, "--quant", "fp8_group", "--group-size", "96"], {},
     "group_size=96 is not valid with hidden_dim=64; use one of 32, 64, 128 dividing hidden_dim"),
    (["run", *RUN_SMALL, "--quant", "fp8_group", "--group-size", "32", "--scale-format",
      "linear"], {},
     "layout='linear' is not valid for quant='fp8_group'"),
    (["bench", "--tokens", "1", "--quant", "nvfp4"], {}, "--quant nvfp4: bench times"),
    (["bench", "--tokens", "1", "--scale-format", "fp32"], {},
     "--scale-format is for a quant with several scale layouts (nvfp4: swizzled_128x4"),
])
def test_bad_settings_exit_2_with_one_line(args: list[str], env: dict[str, str],
                                           message: str) -> None:
    result = arfuse(*args, env=env)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


NO_TORCH = ("import sys\nsys.modules['torch'] = None  # importing torch fails\n"
            "from arfuse.cli import main\nsys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize(("args", "env", "message"), [
    (["explain"], {"ARFUSE_STRICT": "yes"}, "ARFUSE_STRICT"),
    (["explain", "--quant", "int4"], {}, "quant"),
    (["run", *RUN_SMALL, "--tokens", f"1,{HUGE}"], {}, "use 1..2147483647"),
    (["run", *RUN_SMALL, "--quant", "fp8_group", "--group-size", "96"], {}, "group_size=96"),
    (["run", *RUN_SMALL, "--pattern", "moe_finalize", "--experts", "4"], {},
     "--experts 4 is fewer than --top-k 8"),
    (["bench", "--tokens", "1", "--min-seconds", "0"], {}, "--min-seconds"),
    (["bench", "--tokens", "1", "--world-size", "65536"], {}, "more ranks than this machine"),
    (["scenario", "run", "/no/such/dir"], {}, "neither a file nor a directory"),
])
def test_a_bad_flag_is_refused_before_torch_is_imported(args: list[str], env: dict[str, str],
                                                        message: str) -> None:
    """The verbs check what needs no torch first (its import is seconds)."""
    result = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True,
                            text=True, env={**os.environ, **env}, timeout=300, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_the_packages_torch_names_load_on_first_use() -> None:
    import arfuse
    from arfuse import ops, registry, result

    assert arfuse.FusedAllReduce is ops.FusedAllReduce
    assert arfuse.FusedOutput is result.FusedOutput and arfuse.destroy_all is registry.destroy_all
    assert set(arfuse.__all__) <= set(dir(arfuse))
    with pytest.raises(AttributeError, match="no attribute 'FusedAllreduce'"):
        arfuse.FusedAllreduce  # noqa: B018


@pytest.mark.parametrize("content", ['{"device": "tpu"}', "{not json", '{"hosts": "n0"}',
                                     '{"world_size": 2, "hosts": ["a"]}', '{"sm": "90"}',
                                     '{"multicast": "yes"}', '{"gpus": 8}', "[]"])
def test_bad_topology_files_exit_2(tmp_path: Path, content: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(content)
    result = arfuse("explain", "--topology", str(path))
    assert result.returncode == 2, result.stdout
    assert "Traceback" not in result.stderr and "topology file" in result.stderr


def test_doctor() -> None:
    result = arfuse("doctor")
    assert result.returncode == 0, result.stderr
    for word in ("mnnvl", "trtllm", "shm", "torch", "auto picks", "shm kernel"):
        assert word in result.stdout
    fused = result.stdout.split("patterns each fuses here", 1)[1].splitlines()
    assert any(ln.split()[:3] == ["shm", "all", "72"] for ln in fused[1:4]), fused
    assert any(ln.split()[:1] == ["torch"] and "no pattern" in ln for ln in fused[1:4]), fused
    if "shm kernel: compiled for" in result.stdout:  # which instruction set, and why
        assert "the best of" in result.stdout or "ARFUSE_SHM_ISA names it" in result.stdout
        assert "own outputs: " in result.stdout and ("MiB (" in result.stdout
                                                     or "never streams" in result.stdout)


def test_doctor_names_the_settings_it_resolves_with() -> None:
    result = arfuse("doctor", env={"ARFUSE_BACKEND": "torch"})
    assert result.returncode == 0, result.stderr
    assert "with ARFUSE_BACKEND=torch arfuse picks: torch" in result.stdout
    assert "auto picks" not in result.stdout


def test_run_main_job_checks_and_times() -> None:
    result = arfuse("run", "--world-size", "2", "--tokens", "1,9", "--hidden", "256",
                    "--steps", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "negotiated: shm" in result.stdout
    lines = [ln for ln in result.stdout.splitlines() if ln.strip().startswith(("1 ", "9 "))]
    assert len(lines) == 2 and all(ln.rstrip().endswith("ok") for ln in lines)


def test_run_checks_the_replicated_residual_path() -> None:
    """The job's residual is the same on every rank: with the promise, two-shot sizes finish
    the peer's rows from its residual_out, and the reference check still passes."""
    result = arfuse("run", "--world-size", "2", "--tokens", "9,40", "--hidden", "256",
                    "--steps", "2", env={"ARFUSE_REPLICATED_RESIDUAL": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "residual promised the same on every rank" in result.stdout
    lines = [ln for ln in result.stdout.splitlines() if ln.strip().startswith(("9 ", "40 "))]
    assert len(lines) == 2 and all(ln.rstrip().endswith("ok") for ln in lines)


def test_run_with_quantisation_and_unfused_backend() -> None:
    result = arfuse("run", "--world-size", "2", "--tokens", "4", "--hidden", "128",
                    "--steps", "2", "--quant", "nvfp4", "--backend", "torch")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "negotiated: torch" in result.stdout


def test_bench_traffic_of_the_replicated_rows() -> None:
    """With the promise, two-shot reads the residual of its own rows only (1 of world parts);
    one-shot reads all of it, and in place all of its lines come in to be overwritten."""
    from arfuse.bench.floor import traffic

    size = 3000
    plain = traffic("shm", size, 3)
    assert plain is not None
    for world in (2, 3):
        two = traffic("shm-replicated", size, world, "twoshot")
        assert two is not None and two.local == size // world
        assert two.total == plain.total - size + size // world + (world - 3) * size
        assert traffic("shm-replicated", size, world, "oneshot") == traffic("shm", size, world)
        for mode in ("oneshot", "twoshot"):
            assert traffic("shm-inplace-replicated", size, world, mode) == \
                traffic("shm-inplace", size, world)


def test_bench_times_fp8_group_in_every_row(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    result = arfuse("bench", "--tokens", "2", "--hidden", "256", "--dtype", "bf16",
                    "--backends", "shm,torch", "--out", str(out), "--min-seconds", "0.02",
                    "--quant", "fp8_group", "--group-size", "64", "--scale-format",
                    "ue8m0_packed")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "bench.json").read_text())
    assert report["options"]["quant"] == "fp8_group" and report["options"]["group_size"] == 64
    assert {r["backend"] for r in report["results"]} >= {"shm", "torch"}
    assert "every row quantises: fp8_group ue8m0_packed group_size 64" in (
        out / "bench.txt").read_text()


def test_bench_times_arfuses_unfused_paths_against_the_users_two_lines(tmp_path: Path) -> None:
    """``arfuse-torch`` (the torch backend) and ``shm-over`` (a shm call over its capacity of
    one token, so not timed at 1 token) beside the baseline, the user's two lines."""
    out = tmp_path / "bench"
    result = arfuse("bench", "--tokens", "1,4", "--hidden", "256", "--dtype", "fp32",
                    "--backends", "torch,arfuse-torch,shm-over", "--out", str(out),
                    "--min-seconds", "0.02")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "bench.json").read_text())
    rows = {(r["backend"], r["tokens"]) for r in report["results"]}
    assert rows == {("torch", 1), ("torch", 4), ("arfuse-torch", 1), ("arfuse-torch", 4),
                    ("shm-over", 4)}
    assert report["baseline"] == "torch"


def test_bench_writes_table_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    result = arfuse("bench", "--tokens", "1,4", "--hidden", "256", "--dtype", "bf16",
                    "--backends", "shm,torch", "--out", str(out), "--min-seconds", "0.02")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "bench.json").read_text())
    rows = {(r["backend"], r["tokens"]) for r in report["results"]}
    shm_rows = ("shm", "shm-inplace", "shm-slot", "shm-replicated", "shm-inplace-replicated")
    assert rows == {(b, t) for b in (*shm_rows, "torch") for t in (1, 4)}
    assert all(r["median_us"] > 0 and r["p90_us"] >= r["median_us"] for r in report["results"])
    assert report["machine"]["cores"] and report["python_overhead"]["bf16"]["calls"] > 0
    module = shm_build.load()  # the ISA the figures come from: the kernel the ranks ran
    expected_isa = module.isa if module else f"none ({shm_build.why_not()})"
    assert report["machine"]["kernel_isa"] == expected_isa
    assert f"shm kernel built for {report['machine']['kernel_isa']}" in (out / "bench.txt"
                                                                          ).read_text()
    assert (out / "bench.png").stat().st_size > 1000
    assert "torch median / this median" in (out / "bench.txt").read_text()
    # the memory floor: bytes each row must move, at the copy rate measured in the same run
    for r in report["results"]:
        size = r["tokens"] * 256 * 2
        if r["backend"] == "torch":
            assert "x_floor" not in r
            continue
        assert r["mode"] == "oneshot"  # these sizes: the residual is read whole either way
        expected = {"shm": 5, "shm-inplace": 5, "shm-slot": 4, "shm-replicated": 5,
                    "shm-inplace-replicated": 5}[r["backend"]] * size
        assert r["moved_bytes"] == expected and r["copy_gib_s"] > 0
        assert r["x_floor"] == pytest.approx(r["median_us"] / r["floor_us"])
        # the same bytes by kind, each at its own rate measured in the same run
        fresh = {"shm": 2, "shm-inplace": 0, "shm-slot": 1, "shm-replicated": 2,
                 "shm-inplace-replicated": 0}[r["backend"]] * size
        shared = 0 if r["backend"] == "shm-slot" else size  # x into the slot
        assert r["traffic"] == {"local": expected - size - fresh - shared, "shared": shared,
                                "peer": size, "fresh": fresh}
        assert min(r["peer_read_gib_s"], r["shared_write_gib_s"], r["fresh_write_gib_s"]) > 0
        kinds = (r["traffic"]["local"] / r["copy_gib_s"] + shared / r["shared_write_gib_s"]
                 + size / r["peer_read_gib_s"] + fresh / r["fresh_write_gib_s"]) / 2**30 * 1e6
        assert r["measured_floor_us"] == pytest.approx(kinds)
        assert r["x_measured_floor"] == pytest.approx(r["median_us"] / kinds)
        assert r["page_faults_per_call"] >= 0
    text = (out / "bench.txt").read_text()
    assert "shm-inplace / floor, measured" in text and "peer" in text
    assert not list(Path("/dev/shm").glob("arfuse-bench-*"))  # the rate files are gone


def test_explain_shows_unknown_facts_of_a_topology_file(tmp_path: Path) -> None:
    data = json.loads((TOPOLOGIES / "h200-nvswitch-8.json").read_text())
    data.update(multicast=None, unknown={"multicast": "rank 5: NVML init failed: Unknown Error"})
    path = tmp_path / "unknown.json"
    path.write_text(json.dumps(data))
    plan = explain_json("--topology", str(path))
    assert plan["unknown_facts"] == {"multicast": "rank 5: NVML init failed: Unknown Error"}
    assert plan["backend"] == "trtllm"          # multicast taken as absent: mnnvl is out
    text = arfuse("explain", "--topology", str(path)).stdout
    assert "multicast: rank 5: NVML init failed: Unknown Error" in text


def test_bench_rates_split_a_copy_into_its_two_sides() -> None:
    from arfuse.bench.floor import PeerRates, Rates, Traffic, _one_side_rate, traffic

    # a copy of 1000 bytes that took 3 s, where the other side alone takes 1 s at the copy rate
    assert _one_side_rate(1000, 3.0, copy_rate=1000.0) == pytest.approx(500.0)
    # faster than the local copy in total: the side is taken as nearly free, not negative
    assert _one_side_rate(1000, 0.5, copy_rate=1000.0) > 1000.0 * 100
    rates = Rates(copy=100.0, peer=PeerRates(read=10.0, shared_write=20.0), fresh_write=50.0)
    moved = Traffic(local=200, shared=40, peer=30, fresh=100)
    assert rates.floor_s(moved) == pytest.approx(3.7)
    assert rates.measured_floor_s(moved) == pytest.approx(2.0 + 2.0 + 3.0 + 2.0)
    assert Rates(copy=100.0, peer=None, fresh_write=50.0).measured_floor_s(moved) is None
    assert traffic("torch", 10, 2) is None
    assert traffic("deepspeed", 10, 4) == Traffic(local=10, shared=10, peer=30, fresh=0)


@pytest.mark.parametrize("blocked", [None, 1])
def test_bench_peer_rates_are_measured_or_skipped_on_every_rank(tmp_path: Path,
                                                                   blocked: int | None) -> None:
    from harness import run_ranks, values
    from ranks_cli import peer_rates

    got = values(run_ranks(peer_rates, 2, blocked, str(tmp_path), timeout=60))
    if blocked is None:
        # rates of real copies (the worker counts a local side at 1 TB/s): not the clamp
        assert all(g["rate"] is not None and all(1e8 < r < 1e13 for r in g["rate"]) for g in got)
    else:  # one rank could not reserve its buffer: no rank measures, none waits for it
        assert all(g["rate"] is None for g in got)
    assert all(g["left"] == [] for g in got)  # every rate file is gone


@pytest.mark.parametrize("read_ahead", [False, True])
def test_exchange_copy_moves_every_byte_and_refuses_mismatched_buffers(read_ahead: bool) -> None:
    """The kernel's copy the bench's shared rates are measured with: exact at any length
    (a tail shorter than a line included), and a clear refusal for buffers it cannot copy."""
    module = shm_build.load()
    if module is None:
        pytest.skip(f"no compiled kernel here: {shm_build.why_not()}")
    for n in (0, 1, 63, 64, 65, 4096 + 17):
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dst = torch.zeros(n, dtype=torch.uint8)
        module.diagnostics.exchange_copy(dst, src, read_ahead)
        assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="one size"):
        module.diagnostics.exchange_copy(torch.empty(3, dtype=torch.uint8),
                                         torch.empty(4, dtype=torch.uint8), read_ahead)
    with pytest.raises(ValueError, match="uint8"):
        module.diagnostics.exchange_copy(torch.empty(4), torch.empty(4), read_ahead)


def test_launched_ranks_run_their_exit_handlers(tmp_path: Path) -> None:
    """Ranks end with os._exit (no waits at interpreter shutdown), which skipped atexit: the
    kernel build's temporary folder stayed in /tmp after every run with an unusable cache."""
    from arfuse.launch import launch

    import ranks_cli

    assert launch(ranks_cli.rank_with_an_exit_handler, 2, str(tmp_path)) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_a_closed_output_stops_the_ranks_before_any_leaves_the_group(tmp_path: Path) -> None:
    """The rank that found the output closed tells the launcher before its teardown could make
    a peer fail: the job ends with 0, the peer stopped by the launcher, not failed."""
    from arfuse.launch import launch

    import ranks_cli

    assert launch(ranks_cli.rank_whose_output_closes_while_a_peer_watches, 2,
                  str(tmp_path)) == 0
    assert not (tmp_path / "rank0-teardown").exists()


def test_sigterm_to_a_job_stops_its_ranks(tmp_path: Path) -> None:
    """kill, timeout or a CI cancel send SIGTERM to the job: its ranks must go with it (they
    used to run on, re-parented to init)."""
    import signal

    script = ("import sys; sys.path.insert(0, 'tests'); import ranks_cli\n"
              "from arfuse.launch import launch\n"
              "try:\n"
              f"    sys.exit(launch(ranks_cli.rank_that_sleeps, 2, {str(tmp_path)!r}))\n"
              "except KeyboardInterrupt:\n"
              "    sys.exit(130)\n")
    job = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        for _ in range(600):  # until both ranks have started
            if len(list(tmp_path.iterdir())) == 2:
                break
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.iterdir()]
        assert len(pids) == 2
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=30) == 130
        for _ in range(200):
            if not any(os.path.exists(f"/proc/{pid}") for pid in pids):
                break
            time.sleep(0.1)
        assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    finally:
        if job.poll() is None:
            job.kill()


def test_a_world_size_beyond_what_the_cpus_run_is_refused_with_the_rule(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from arfuse import launch

    monkeypatch.setattr(launch, "usable_cpus", lambda: 8)
    assert launch.max_cpu_ranks() == 32
    launch.check_ranks(launch.JobRanks(32, 32, True), "cpu")
    with pytest.raises(ValueError, match=r"--world-size 33 is more ranks than this machine "
                       r"runs: at most 32 on the CPU \(4 per usable CPU, 8 here, and never "
                       r"fewer than 16"):
        launch.check_ranks(launch.JobRanks(33, 33, True), "cpu")
    launch.check_ranks(launch.JobRanks(33, 1, False), "cpu")  # torchrun started them
    monkeypatch.setattr(launch, "usable_cpus", lambda: 1)
    assert launch.max_cpu_ranks() == 16  # the shm backend's whole range, on any machine


def test_bench_refuses_more_ranks_than_its_shm_rows_can_use(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from arfuse import launch
    from arfuse.cli import main

    monkeypatch.setattr(launch, "usable_cpus", lambda: 8)  # 17 ranks are allowed here
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("ranks were started"))
    assert main(["bench", "--tokens", "1", "--world-size", "17", "--backends", "shm"]) == 2
    assert "world size 17 not in 2..16" in capsys.readouterr().err


LAUNCHED = {"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.mark.parametrize(("env", "gpus", "device"), [
    ({"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}, 1, "cuda"),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"}, 4, "cuda"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1"}, 2, "cpu"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}, 0, "cpu"),
])
def test_under_torchrun_the_device_follows_the_launchers_ranks(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], gpus: int, device: str) -> None:
    """The device was derived from --world-size's default (2), not from the ranks torchrun
    started on this host: one rank per GPU of a 1-GPU host ran on the CPU, four ranks on a
    2-GPU host on CUDA."""
    from arfuse import launch
    from arfuse.cli import build_parser
    from arfuse.cli import run as run_verb

    for name, value in {**LAUNCHED, **env}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    ranks = launch.job_ranks(None)
    assert ranks == launch.JobRanks(int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"]), False)
    assert launch.default_device(ranks) == device
    seen: dict[str, str] = {}
    monkeypatch.setattr(launch, "launch", lambda body, world, opts, **kw: seen.update(
        device=opts.device, world=str(world)) or 0)
    monkeypatch.setattr("arfuse.cli.explain.check_job", lambda *a: None)
    parsed = build_parser().parse_args(["run", "--tokens", "1", "--hidden", "64"])
    assert run_verb.run(parsed) == 0
    assert seen == {"device": device, "world": env["WORLD_SIZE"]}


def test_under_torchrun_a_world_size_other_than_the_launchers_is_refused() -> None:
    env = {**LAUNCHED, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    result = arfuse("run", *RUN_SMALL, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--world-size 2, but the launcher started 1 ranks (WORLD_SIZE)" in result.stderr


def test_run_under_torchrun_joins_the_ranks_it_started() -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed here")
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "arfuse.cli", "run",
         "--tokens", "1", "--hidden", "64", "--steps", "1"], capture_output=True, text=True,
        timeout=300, cwd=ROOT, env={**os.environ, "ARFUSE_LOG": "warning",
                                    "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world size 2, hidden 64" in result.stdout and "negotiated: shm" in result.stdout


TORCHRUN_RANK_SCRIPT = """
import os, socket, sys
import torch, torch.distributed as dist
import arfuse
from arfuse import registry
from arfuse.launch import launch

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})

def body(rank, world, options):
    dist.init_process_group("gloo")
    op = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=64, dtype=torch.float32,
                               backend="torch")
    op(torch.ones(2, 64), torch.ones(2, 64), torch.ones(64))
    return 3

code = launch(body, 1, None)
print(code, dist.is_initialized(), len(registry.REGISTRY.workspaces()))
"""


def test_a_rank_torchrun_started_leaves_no_group_nor_op_to_the_interpreters_exit() -> None:
    """Under torchrun the body runs in the rank's own process, which then ends as a script
    does: a process group still alive at the interpreter's exit had its C++ threads torn down
    in no set order (a rank aborted with std::terminate after its work was done)."""
    result = subprocess.run([sys.executable, "-c", TORCHRUN_RANK_SCRIPT], capture_output=True,
                            text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "ARFUSE_LOG": "warning"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["3", "False", "0"], result.stdout + result.stderr


def test_the_job_store_port_is_held_before_any_rank_starts(tmp_path: Path) -> None:
    """A port found free and closed again (then bound by rank 0 later) could go to another
    job started at the same moment: the launcher holds its store's port from the moment the
    system picked it. Rank 1 looks while rank 0 has not started."""
    from arfuse.launch import launch

    import ranks_cli

    assert launch(ranks_cli.rank_finds_the_store_port_taken_before_rank0_starts, 2,
                  str(tmp_path)) == 0
    assert (tmp_path / "verdict").read_text() == "held"


def test_a_store_listener_holds_its_port_until_rank_0_lets_it_go() -> None:
    """How the scenario runner and the test harness start ranks whose rank 0 hosts the store
    (as a plain init_process_group does): the port is bound and listening before any rank
    starts, and goes with rank 0."""
    import gc
    import socket

    from arfuse.launch import rank_store, store_listener

    listener = store_listener()
    port = listener.getsockname()[1]
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    host = rank_store(0, 2, port, listener, 10.0)
    client = rank_store(1, 2, port, None, 10.0)
    client.set("key", "value")
    assert host.get("key") == b"value"
    del host, client
    gc.collect()
    with socket.socket() as other, pytest.raises(ConnectionRefusedError):
        other.connect(("127.0.0.1", port))


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text()
        found.update(int(p) for p in text.split())
    return found


def test_a_closed_output_ends_the_job_quietly_with_every_rank() -> None:
    """``arfuse run | head``: rank 0's print found the pipe closed (BrokenPipeError, exit 1 and
    a line per rank); now the job stops every rank and exits 0, saying nothing."""
    job = subprocess.Popen([sys.executable, "-m", "arfuse.cli", "run", *RUN_SMALL],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                           env={**os.environ, "ARFUSE_LOG": "warning"})
    try:
        assert job.stdout is not None and job.stderr is not None
        assert job.stdout.readline().startswith("arfuse plan:")
        started = _children(job.pid)
        job.stdout.close()  # as head does once it has its lines
        assert job.wait(timeout=120) == 0
        assert job.stderr.read() == ""
    finally:
        if job.poll() is None:
            job.kill()
    for _ in range(200):
        if not [p for p in started if os.path.exists(f"/proc/{p}")]:
            break
        time.sleep(0.05)
    assert not [p for p in started if os.path.exists(f"/proc/{p}")]


def test_benchs_default_output_folder_is_one_git_ignores() -> None:
    """``./bench-out`` was left in a checkout for anyone to commit by mistake."""
    import shutil

    from arfuse.cli import build_parser

    out = build_parser().parse_args(["bench"]).out
    assert not Path(out).is_absolute() and not out.startswith("benchmarks")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{out}/bench.json"], cwd=ROOT)
    assert ignored.returncode == 0, f"{out}/bench.json is not ignored by git"


def test_no_documented_command_writes_over_recorded_results() -> None:
    """docs/reliability.md's soak command wrote straight over the recorded Xeon figures on
    whatever machine ran it. Commands in the docs write under ``out/`` (ignored by git)."""
    import re

    written = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", doc.read_text(), re.S):
            written += [(doc.name, path) for path in
                        re.findall(r"--(?:out|json)[ =]([^\s\]]+)", block)
                        if path not in ("DIR", "FILE")]  # placeholders of a synopsis
    assert written, "no documented command writes a file: the check reads nothing"
    for doc, path in written:
        assert path.startswith("out/"), f"{doc}: a command writes to {path}, not under out/"


@pytest.mark.parametrize(("steps", "rounds"), [(1, (1, 1)), (2, (2, 1)), (5, (5, 1)),
                                               (7, (5, 1)), (50, (5, 10))])
def test_run_times_at_most_the_steps_asked_for(steps: int, rounds: tuple[int, int]) -> None:
    from arfuse.cli.run_checks import rounds_of

    assert rounds_of(steps) == rounds
    assert rounds[0] * rounds[1] <= steps


def test_bench_says_when_its_ranks_cannot_be_pinned(tmp_path: Path) -> None:
    """More ranks x threads than the cores this process may use: the run goes on unpinned and
    says so (the figures then include the ranks' contention)."""
    cores = len(os.sched_getaffinity(0))
    result = arfuse("bench", "--tokens", "1", "--hidden", "256", "--dtype", "fp32",
                    "--backends", "torch", "--threads", str(cores), "--out", str(tmp_path),
                    "--min-seconds", "0.02")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"ranks not pinned: 2 ranks x {cores} threads need {2 * cores} cores" in (
        result.stderr), result.stderr
