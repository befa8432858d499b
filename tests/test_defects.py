"""Each input gives the right answer or a clear error, on every rank (the Python-side items of
the adversarial probe; the kernel's own items are in test_mismatched_calls.py,
test_shm_kernel_contract.py and test_kernel_cache.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import arfuse
from arfuse import topology
from arfuse.call_checks import OpShape, check_call

import ranks_call_pairing
import ranks_calls
import ranks_negotiation
import ranks_registry
from harness import run_ranks, values

ROOT = Path(__file__).resolve().parent.parent
SHAPE = OpShape(hidden=16, dtype=torch.float32, dtype_name="fp32", device=torch.device("cpu"))


def check(**kwargs: object) -> object:
    args = {"x": torch.ones(2, 16), "residual": None, "weight": torch.ones(16), "eps": 1e-6,
            "weight_bias": 0.0, "quant": None, "scale": None, "layout": "swizzled_128x4",
            "out": None, "residual_out": None, "shared": None, "slot_start": None}
    args.update(kwargs)
    return check_call(SHAPE, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["cuda:0", "cuda:1"])
def test_x_on_another_device_than_the_workspace_is_refused(device: str) -> None:
    """The workspace's device with its index: x on cuda:1 for a workspace on cuda:0 was let
    through when only the device type was compared (here: the CPU against a CUDA shape)."""
    from dataclasses import replace

    with pytest.raises(ValueError, match=f"x is on cpu; this op's workspace is on {device}"):
        check_call(replace(SHAPE, device=torch.device(device)), torch.ones(2, 16), None,
                   torch.ones(16), 1e-6, 0.0, None, None, "linear", None, None, None, None)


# --- item 5: values float64 carries but fp32 cannot ---

@pytest.mark.parametrize(("kwargs", "name"), [
    ({"eps": 1e39}, "eps"), ({"eps": 1e-50}, "eps"), ({"eps": float("inf")}, "eps"),
    ({"eps": 10**400}, "eps"), ({"weight_bias": 1e39}, "weight_bias"),
    ({"weight_bias": -(10**400)}, "weight_bias"), ({"weight_bias": float("nan")}, "weight_bias"),
    ({"quant": "fp8", "scale": 1e-300}, "scale"), ({"quant": "fp8", "scale": 1e39}, "scale"),
    ({"quant": "fp8", "scale": 1e-39}, "scale"), ({"quant": "fp8", "scale": 10**400}, "scale"),
])
def test_values_outside_fp32_are_refused_naming_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        check(**kwargs)


def test_values_at_the_edge_of_fp32_are_accepted_and_compute_finite_results() -> None:
    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=16, dtype=torch.float32)
    zero = torch.zeros(2, 16)
    out = comm(zero, weight=torch.ones(16), eps=1.5e-45).out  # subnormal eps: still > 0
    assert torch.equal(out, zero)  # not NaN (0 * rsqrt(eps) with eps > 0)
    big = comm(torch.ones(2, 16), weight=torch.ones(16), eps=3e38).out
    assert torch.all(torch.isfinite(big)) and torch.all(big > 0)
    q = comm(torch.ones(2, 16), weight=torch.ones(16), quant="fp8", scale=3e-39).quant_out
    assert q is not None and not torch.any(torch.isnan(q.float()))
    comm.close()


# --- item 6: any real scalar is a number ---

@pytest.mark.parametrize("eps", [np.float32(1e-5), np.float64(1e-5), np.int64(1),
                                 torch.tensor(1e-5), torch.tensor([1e-5])])
def test_numpy_and_tensor_scalars_are_numbers(eps: object) -> None:
    call = check(eps=eps, weight_bias=np.float32(0.5))
    assert isinstance(call.eps, float) and isinstance(call.weight_bias, float)  # type: ignore[attr-defined]


@pytest.mark.parametrize("eps", [True, np.bool_(True), "1e-5", torch.tensor(True), [1e-5]])
def test_non_numbers_are_type_errors(eps: object) -> None:
    with pytest.raises(TypeError, match="eps"):
        check(eps=eps)


# --- items 7 and R11 on the torch backend ---

def test_torch_backend_keeps_the_timeout_and_names_the_silent_rank() -> None:
    results = run_ranks(ranks_call_pairing.torch_peer_never_calls, 2, 2.0, timeout=60)
    caller = results[0].value
    assert caller is not None, results
    assert caller["type"] == "CallTimeout", caller
    assert "rank(s) 1" in caller["error"] and "phase 'call" in caller["error"], caller
    assert "backend torch" in caller["error"]
    assert "timed out after 2s" in caller["error"], caller  # arfuse's deadline, not gloo's
    assert caller["second"]["type"] == "WorkspaceBroken", caller  # not "pair closure"
    assert "process group" in caller["second"]["error"], caller  # what it advises: a new group


@pytest.mark.parametrize(("world", "tokens", "residual_on"), [
    (2, [1, 2], [False, False]), (2, [8, 1], [False, False]), (3, [3, 5, 3], [False] * 3),
    (2, [4, 4], [True, False])])
def test_torch_backend_mismatched_calls_fail_on_every_rank(world: int, tokens: list[int],
                                                           residual_on: list[bool]) -> None:
    for result in values(run_ranks(ranks_call_pairing.mismatched_tokens, world, tokens, "torch",
                                   residual_on)):
        assert result["type"] == "MismatchedCall", result
        for rank in range(world):
            assert f"rank {rank}: tokens={tokens[rank]}" in result["error"], result


# --- item 8: no reference to the process group once arfuse is done with it ---

@pytest.mark.parametrize("backend", ["torch", "shm"])
def test_close_and_destroy_all_release_the_process_group(backend: str) -> None:
    for refs in values(run_ranks(ranks_registry.process_group_references, 2, backend)):
        assert refs["during"] > refs["before"], refs  # arfuse did hold it while in use
        assert refs["after_close"] == refs["before"], refs
        assert refs["after_destroy_all"] == refs["before"], refs


# --- item 12: store keys do not pile up ---

def test_store_keys_stay_bounded_over_many_creations() -> None:
    for seen in values(run_ranks(ranks_registry.store_keys_after_creations, 2, [2, 10, 40],
                                 timeout=120)):
        assert seen[2] <= seen[0] + 2, seen  # not 16 more per creation


# --- item 10: each bad argument names itself ---

@pytest.mark.parametrize(("tokens", "error"), [(-1, ValueError), (1.5, TypeError),
                                               ("4", TypeError), (True, TypeError)])
def test_input_buffer_arguments(tokens: object, error: type[Exception]) -> None:
    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=16, dtype=torch.float32)
    with pytest.raises(error, match="tokens"):
        comm.input_buffer(tokens)  # type: ignore[arg-type]
    comm.close()


def test_group_and_device_arguments_name_themselves() -> None:
    with pytest.raises(TypeError, match="group must be a torch"):
        arfuse.FusedAllReduce("abc", max_token_num=4, hidden_dim=16)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda'"):
            arfuse.FusedAllReduce(max_token_num=4, hidden_dim=16, device="cuda")


def test_rank0_exiting_in_creation_is_named_by_the_survivor() -> None:
    env = {"ARFUSE_FAULTS": "shm.create@*=exit", "ARFUSE_TIMEOUT_S": "3"}
    results = run_ranks(ranks_negotiation.create_then_report, 2, env=env, timeout=60, expect=1)
    survivor = results[1].value
    assert survivor is not None, results
    # rank 0 may die while rank 1 still reads the facts exchange, or in the shm exchange
    assert ("phase 'shm-name'" in survivor["error"] and "backend shm" in survivor["error"]) \
        or "phase 'facts'" in survivor["error"] or "phase 'open'" in survivor["error"], survivor
    assert "store stopped answering" in survivor["error"] and "rank 0" in survivor["error"]


# --- item 11: in place on a tensor that requires grad: refused everywhere ---

@pytest.mark.parametrize("backend", ["torch", "shm"])
def test_out_requiring_grad_is_refused_on_every_backend(backend: str) -> None:
    for result in values(run_ranks(ranks_calls.requires_grad_destination, 2, backend)):
        assert result["type"] == "ValueError" and "requires grad" in result["error"], result
        assert result["version"] == 0 and result["then_works"], result


# --- items 9 and 14: files and the command line ---

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


@pytest.mark.parametrize("faults", ["shm.create", "nccl.create@1=raise", "shm.call@1=null",
                                    "shm.create@x=raise"])
def test_explain_refuses_malformed_faults_as_the_api_does(faults: str) -> None:
    from arfuse.faults import parse

    with pytest.raises(ValueError):
        parse(faults)
    result = _explain(env={"ARFUSE_FAULTS": faults})
    assert result.returncode == 2 and "ARFUSE_FAULTS" in result.stderr, result.stderr


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

    from arfuse.backends.shm import workspace as shm_workspace
    from arfuse.spec import Spec

    monkeypatch.setenv("ARFUSE_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(shm_workspace.os, "statvfs",
                        lambda _path: SimpleNamespace(f_bavail=16, f_frsize=4096))
    reason = shm_workspace.ShmBackend().local_check(SimpleNamespace(world_size=2),
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

    from arfuse.backends.shm import build as shm_build
    from arfuse.backends.shm import workspace as shm_workspace
    from arfuse.spec import Spec

    monkeypatch.setattr(shm_build, "load", lambda: None)
    monkeypatch.setattr(shm_build, "why_not", lambda: "no C++ compiler")
    monkeypatch.setattr(shm_workspace.platform, "machine", lambda: machine)
    reason = shm_workspace.ShmBackend().local_check(SimpleNamespace(world_size=2),
                                                 Spec(max_tokens=8, hidden=64))
    if machine == "x86_64":
        assert reason == ""
    else:
        assert reason == ("no compiled kernel (no C++ compiler) and the pure-torch path relies "
                          "on x86's store order; this CPU is aarch64")


def test_the_torch_operators_fake_names_x_for_a_0d_input() -> None:
    """torch.compile's fake of the shm operator refuses a 0-d x as the kernel does."""
    from arfuse.backends.shm import build as shm_build

    if shm_build.load() is None:
        pytest.skip(f"no compiled kernel: {shm_build.why_not()}")
    x = torch.empty((), device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be 2-D \[tokens, hidden\]"):
        torch.ops.arfuse.shm_fused_allreduce(1, x, None, None, 1e-6, 0.0, 0, 0.0, True, None,
                                             None)


def test_a_timeout_beyond_float_is_a_value_error_naming_it() -> None:
    from arfuse import settings

    with pytest.raises(ValueError, match="timeout_s"):  # was OverflowError
        settings.load(timeout_s=10**400)


def test_an_empty_hosts_list_is_a_wrong_length_not_one_host() -> None:
    from arfuse.topology import Topology

    with pytest.raises(ValueError, match="hosts has 0 entries but world_size=4"):
        Topology.from_dict({"device": "cpu", "world_size": 4, "hosts": []})
    assert Topology.from_dict({"device": "cpu", "world_size": 4}).node_count == 1  # left out


# --- paths the user gives: only regular files are read ---

def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo.json"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind", ["FIFO", "directory", "character device"])
def test_a_topology_path_that_is_no_regular_file_is_refused_naming_its_source(
        tmp_path: Path, kind: str) -> None:
    """A FIFO blocked open() forever (no writer ever comes); a device or a directory is no
    file of settings either. Each is refused at once, naming the path and where it came from.
    Run in a child process: the old behaviour hangs, and the test must fail, not hang."""
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


# --- tensors that hold no plain values, complex x, meta numbers: errors naming the argument ---

BAD_TENSOR_CALLS = ranks_calls.bad_tensor_calls(2, 16, torch.float32)


@pytest.mark.parametrize("name", list(BAD_TENSOR_CALLS))
def test_a_tensor_argument_without_plain_values_is_an_error_naming_it(name: str) -> None:
    """Sparse, nested, meta or quantized tensors, lazily negated or conjugated views, complex x
    and meta numbers: torch-internal RuntimeErrors, misleading advice ("call .contiguous()")
    or, for a negated view, a result from its raw memory. One process: the torch backend."""
    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=16, dtype=torch.float32)
    try:
        with pytest.raises((ValueError, TypeError)) as info:
            comm(**ranks_calls.bad_tensor_calls(2, 16, torch.float32)[name])
        assert ranks_calls.argument_named(name) in str(info.value), info.value
    finally:
        comm.close()


@pytest.mark.parametrize("backend", ["torch", "shm"])
def test_tensor_arguments_without_plain_values_are_errors_on_a_real_group(backend: str) -> None:
    """The same calls on two ranks: on shm they reach the kernel's fast path first, which must
    decline each so that the Python path raises the error that names the argument."""
    for errors in values(run_ranks(ranks_calls.bad_tensor_errors, 2, backend, timeout=120)):
        assert errors.pop("then") == {"works": True, "backend": backend}
        for name, error in errors.items():
            assert error["type"] in ("ValueError", "TypeError"), (name, error)
            assert ranks_calls.argument_named(name) in error["error"], (name, error)


# --- explain runs the local checks creation runs ---

@pytest.fixture
def shm_dir_without_room(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The shm backend's directory with 64 KiB free: too small for any segment here."""
    from types import SimpleNamespace

    from arfuse.backends.shm import workspace as shm_workspace

    if torch.cuda.is_available():
        pytest.skip("explain plans for CUDA ranks on this machine: shm is not a candidate")
    for name in ("ARFUSE_TOPOLOGY", "ARFUSE_BACKEND", "ARFUSE_STRICT"):
        monkeypatch.delenv(name, raising=False)
    statvfs = os.statvfs
    monkeypatch.setenv("ARFUSE_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(shm_workspace.os, "statvfs", lambda path: SimpleNamespace(
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
