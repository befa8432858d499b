"""The vLLM drop-in (``arfuse.integrations.vllm``): vLLM 0.33.0's surface, its resolution rules, and
R1-R10 where they can be shown without a GPU. Multi-rank tests run real gloo ranks against the
FlashInfer stand-in (``flashinfer_standin``); no vLLM is needed. Not a hardware test."""

from __future__ import annotations

import inspect
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from arfuse import group as group_mod
from arfuse import policy
from arfuse.errors import NegotiationError, NegotiationTimeout, PeerAborted
from arfuse.integrations import vllm as dropin
from arfuse.integrations.vllm import workspaces
from arfuse.registry import REGISTRY
from arfuse.settings import Settings
from arfuse.spec import Spec
from arfuse.topology import Topology

from harness import run_ranks, values

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "topologies"
ENV = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"
RANK_ENV = {"ARFUSE_TIMEOUT_S": "10", "ARFUSE_LOG": "warning"}


def example(name: str) -> Topology:
    return Topology.from_dict(json.loads((EXAMPLES / f"{name}.json").read_text()))


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv(ENV, raising=False)
    yield
    dropin.destroy_fi_ar_workspace()


# --- the surface ------------------------------------------------------------------------------


def params(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_names_and_signatures_are_vllm_0_33_0s() -> None:
    empty = inspect.Parameter.empty
    getter = [("world_size", empty), ("rank", empty), ("max_token_num", empty),
              ("hidden_dim", empty), ("dtype", empty), ("group", empty)]
    assert params(dropin.get_fi_ar_workspace) == getter
    assert params(dropin.get_fi_ar_quant_workspace) == getter
    assert params(dropin.destroy_fi_ar_workspace) == []
    for fn in (dropin.checkpoint_prepare_fi_ar_workspaces,
               dropin.checkpoint_restore_fi_ar_workspaces):
        assert params(fn) == [("group", empty), ("skip_unsupported", False)]
    assert params(dropin.resolve_fi_ar_backend) == [("group", None)]
    assert dropin._resolve_fi_ar_backend is dropin.resolve_fi_ar_backend
    assert params(dropin.FlashInferAllReduce) == [("group", empty), ("device", empty)]
    for method in ("should_use_fi_ar", "all_reduce"):
        assert params(getattr(dropin.FlashInferAllReduce, method)) == [
            ("self", empty), ("input_tensor", empty)]
    assert params(dropin.FlashInferAllReduce.destroy) == [("self", empty)]
    assert dropin.PDL_ADVANCE_LAUNCH_TOKENS == 16 and dropin.MiB == 1 << 20
    assert isinstance(dropin.fi_ar_available, bool)
    assert dropin.fi_ar_available == (dropin.flashinfer_comm is not None)


@pytest.mark.parametrize("value", [None, "auto", "trtllm", "mnnvl"])
def test_allowed_backend_values(value: str | None) -> None:
    env = {} if value is None else {ENV: value}
    assert dropin.backend_setting(env) == (value or "auto")


@pytest.mark.parametrize("value", ["MNNVL", "Auto", "TRTLLM", "", " mnnvl", "mnnvl ", "nccl",
                                   "mnnvl-cutedsl", "none"])
def test_other_values_are_vllms_value_error(value: str) -> None:
    """Case-sensitive and exact, as vLLM's ``env_with_choices``; an empty value is invalid."""
    message = (f"Invalid value '{value}' for {ENV}. "
               "Valid options: ['auto', 'trtllm', 'mnnvl'].")
    with pytest.raises(ValueError) as caught:
        dropin.backend_setting({ENV: value})
    assert str(caught.value) == message


def test_the_resolver_reads_the_variable_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dropin.resolve_fi_ar_backend() == ("mnnvl", True)  # one process is one node
    monkeypatch.setenv(ENV, "trtllm")
    assert dropin.resolve_fi_ar_backend(None) == ("trtllm", False)
    monkeypatch.setenv(ENV, "Mnnvl")
    with pytest.raises(ValueError, match="Invalid value 'Mnnvl'"):
        dropin.resolve_fi_ar_backend()


# --- vLLM's resolution rules, as a table ---------------------------------------------------


@pytest.mark.parametrize(("setting", "topology", "expected"), [
    # an explicit choice is taken as is, never with a fallback
    ("mnnvl", "h200-nvswitch-8", ("mnnvl", False)),
    ("trtllm", "h200-nvswitch-8", ("trtllm", False)),
    ("mnnvl", "h100-2nodes-no-fabric", ("mnnvl", False)),
    ("trtllm", "gb200-2nodes-mnnvl-fabric", ("trtllm", False)),
    # auto: mnnvl, with the trtllm fallback only on one node
    ("auto", "h200-nvswitch-8", ("mnnvl", True)),
    ("auto", "h200-nvl-bridges-8", ("mnnvl", True)),
    # across nodes: mnnvl alone on SM >= 100, else nothing
    ("auto", "gb200-2nodes-mnnvl-fabric", ("mnnvl", False)),
    ("auto", "h100-2nodes-no-fabric", (None, False)),
])
def test_backend_rule(setting: str, topology: str, expected: tuple[str | None, bool]) -> None:
    assert dropin.choose_backend(setting, example(topology)) == expected


def test_across_nodes_the_groups_weakest_sm_decides() -> None:
    mixed = Topology(device="cuda", world_size=2, hosts=("a", "b"), sm=90)
    assert dropin.choose_backend("auto", mixed) == (None, False)
    unknown = Topology(device="cuda", world_size=2, hosts=("a", "b"), sm=None)
    assert dropin.choose_backend("auto", unknown) == (None, False)
    assert dropin.choose_backend("auto", Topology(device="cuda", world_size=2,
                                                  hosts=("a", "b"), sm=120)) == ("mnnvl", False)


def test_an_explicit_choice_is_the_only_fused_candidate() -> None:
    """What the getter asks arfuse for: explicit X is X alone (strict: nothing unfused)."""
    spec = Spec(max_tokens=64, hidden=4096)
    for name in ("mnnvl", "trtllm"):
        plan = policy.resolve(Settings(backend=name, strict=True), example("h200-nvswitch-8"),
                              spec)
        assert plan.viable == (name,)
    auto = policy.resolve(Settings(strict=True), example("h200-nvswitch-8"), spec)
    assert auto.viable == ("mnnvl", "trtllm")


class Recorder:
    """Stands for ``FusedAllReduce``: records what the getter asks for, then fails as a
    negotiation that found nothing would."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, group: Any, **kw: Any) -> Any:
        self.calls.append({"group": group, **kw})
        raise NegotiationError("no candidate could be created on every rank (recorded)")


def decided(topology: Topology, setting: str = "auto") -> Any:
    def fake_decide(group: Any, device: str | None, check: Any = lambda: None,
                    known: Any = lambda: None) -> dropin.GroupDecision:
        check()  # the caller's argument checks run where the real exchange runs them
        backend, allow = dropin.choose_backend(setting, topology)
        fake_decide.devices.append(device)  # type: ignore[attr-defined]
        return dropin.GroupDecision(setting, topology, backend, allow, "g", 0, (known(),))

    fake_decide.devices = []  # type: ignore[attr-defined]
    return fake_decide


ONE_RANK_GPU = Topology(device="cuda", world_size=1, sm=90)
TWO_NODES_H100 = Topology(device="cuda", world_size=2, hosts=("n0", "n1"), sm=90)
GETTER = {"world_size": 1, "rank": 0, "max_token_num": 64, "hidden_dim": 256,
          "dtype": torch.bfloat16, "group": None}


@pytest.mark.parametrize("cuda", [True, False])
def test_the_getters_ask_arfuse_for_cuda_when_cuda_is_available(
        monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    """vLLM passes its gloo group; its tensors are CUDA. Explicit trtllm stays explicit, auto
    stays auto (arfuse then adds R2/R3), both strict, and quant is only a pattern (R5)."""
    recorder, decide = Recorder(), decided(ONE_RANK_GPU, "trtllm")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(workspaces, "_decide", decide)
    monkeypatch.setattr(workspaces, "FusedAllReduce", recorder)
    assert dropin.get_fi_ar_workspace(**GETTER) is None
    dropin.destroy_fi_ar_workspace()
    monkeypatch.setattr(workspaces, "_decide", decided(ONE_RANK_GPU, "auto"))
    assert dropin.get_fi_ar_quant_workspace(**GETTER) is None
    want = "cuda" if cuda else None
    assert decide.devices == [want]
    plain, quant = recorder.calls
    assert plain["device"] == want and plain["backend"] == "trtllm" and plain["strict"] is True
    assert plain["quant"] is None and plain["max_token_num"] == 64
    assert quant["backend"] == "auto" and quant["quant"] == "fp8"


def test_a_failed_creation_is_not_retried_until_destroy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Creation is collective: like vLLM, a failure is remembered (per group, setting, hidden
    size and dtype, for that size and above); destroy forgets it."""
    recorder = Recorder()
    monkeypatch.setattr(workspaces, "_decide", decided(ONE_RANK_GPU))
    monkeypatch.setattr(workspaces, "FusedAllReduce", recorder)
    for _ in range(3):
        assert dropin.get_fi_ar_workspace(**GETTER) is None
        assert dropin.get_fi_ar_quant_workspace(**GETTER) is None
    assert len(recorder.calls) == 1
    assert dropin.get_fi_ar_workspace(**{**GETTER, "hidden_dim": 512}) is None
    assert len(recorder.calls) == 2
    dropin.destroy_fi_ar_workspace()
    assert dropin.get_fi_ar_workspace(**GETTER) is None
    assert len(recorder.calls) == 3


@pytest.mark.parametrize(("getter", "message"), [
    (dropin.get_fi_ar_workspace,
     "Flashinfer allreduce is not supported for multi-node allreduce with 'trtllm' backend. "
     "Please use 'mnnvl' backend instead."),
    (dropin.get_fi_ar_quant_workspace,
     "Flashinfer allreduce quantization fusion is not supported for multi-node allreduce with "
     "'trtllm' backend. Please use 'mnnvl' backend instead."),
])
def test_explicit_trtllm_across_nodes_is_vllms_value_error(
        monkeypatch: pytest.MonkeyPatch, getter: Any, message: str) -> None:
    recorder = Recorder()
    monkeypatch.setattr(workspaces, "_decide", decided(TWO_NODES_H100, "trtllm"))
    monkeypatch.setattr(workspaces, "_rank_and_size", lambda group: (0, 2))
    monkeypatch.setattr(workspaces, "FusedAllReduce", recorder)
    with pytest.raises(ValueError) as caught:
        getter(**{**GETTER, "world_size": 2})
    assert str(caught.value) == message and not recorder.calls


def test_auto_across_nodes_below_sm100_creates_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder()
    monkeypatch.setattr(workspaces, "_decide", decided(TWO_NODES_H100))
    monkeypatch.setattr(workspaces, "_rank_and_size", lambda group: (0, 2))
    monkeypatch.setattr(workspaces, "FusedAllReduce", recorder)
    assert dropin.get_fi_ar_workspace(**{**GETTER, "world_size": 2}) is None
    assert not recorder.calls


def test_arguments_that_contradict_the_group_are_refused() -> None:
    """R9: the group passed is the group used; a world size or rank of another group is an
    error, not a silent rendezvous elsewhere."""
    with pytest.raises(ValueError, match="do not match the group"):
        dropin.get_fi_ar_workspace(**{**GETTER, "world_size": 2})
    with pytest.raises(ValueError, match="hidden"):
        dropin.get_fi_ar_workspace(**{**GETTER, "hidden_dim": 0})


def test_one_process_gets_no_workspace_and_keeps_nothing() -> None:
    """A process without a process group is one node of one rank: no FlashInfer backend runs
    on one rank, so the getters return None and nothing stays allocated (R10)."""
    assert dropin.get_fi_ar_workspace(**GETTER) is None
    assert dropin.get_fi_ar_quant_workspace(**GETTER) is None
    assert REGISTRY.workspaces() == []
    comm = dropin.FlashInferAllReduce(None, "cpu")
    assert comm.disabled and not comm.should_use_fi_ar(torch.ones(2, 256))
    comm.destroy()
    dropin.checkpoint_prepare_fi_ar_workspaces(None)
    dropin.checkpoint_restore_fi_ar_workspaces(None)


def test_a_disabled_communicator_refuses_to_reduce_in_one_line() -> None:
    """vLLM calls ``all_reduce`` only after ``should_use_fi_ar``; a caller that does not gets
    an error saying why, not an ``AttributeError`` from the half-made communicator."""
    comm = dropin.FlashInferAllReduce(None, "cpu")  # no FlashInfer or no CUDA here
    assert comm.disabled
    with pytest.raises(RuntimeError, match="FlashInfer All Reduce is disabled"):
        comm.all_reduce(torch.ones(2, 256))


def test_decisions_are_logged_once_by_the_arfuse_logger(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    from arfuse import log

    monkeypatch.setattr(log, "_seen", set())
    monkeypatch.setenv("ARFUSE_LOG", "info")
    with caplog.at_level(logging.INFO, logger="arfuse"):
        for _ in range(3):
            assert dropin.resolve_fi_ar_backend() == ("mnnvl", True)
    decisions = [r for r in caplog.records if "vLLM drop-in" in r.getMessage()]
    assert len(decisions) == 1 and decisions[0].name == "arfuse"
    assert "-> backend mnnvl, trtllm fallback allowed" in decisions[0].getMessage()
    assert capsys.readouterr().out == ""


# --- real gloo ranks with the FlashInfer stand-in ---------------------------------------------


def two_rank_topologies(tmp_path: Path) -> dict[str, str]:
    """The shipped examples, cut to the two ranks of the test: one node or two nodes."""
    cuts = {"nvswitch": ("h200-nvswitch-8", 0, 1), "bridges": ("h200-nvl-bridges-8", 0, 1),
            "gb200_2n": ("gb200-2nodes-mnnvl-fabric", 0, 7),
            "h100_2n": ("h100-2nodes-no-fabric", 0, 15)}
    paths = {}
    for key, (name, first, last) in cuts.items():
        data = json.loads((EXAMPLES / f"{name}.json").read_text())
        data["world_size"], data["hosts"] = 2, [data["hosts"][first], data["hosts"][last]]
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps(data))
        paths[key] = str(path)
    return paths


@pytest.mark.slow
def test_vllms_call_sequence_on_two_ranks(tmp_path: Path) -> None:
    """CudaCommunicator builds FlashInferAllReduce with its gloo group; the fusion pass takes
    both workspaces with that group and hands them to FlashInfer's allreduce_fusion; the
    communicator gates and runs all-reduces; suspend/resume checkpoint; destroy frees all."""
    topo = two_rank_topologies(tmp_path)["nvswitch"]
    for report in values(run_ranks(call_sequence, 2, topo, env=RANK_ENV, timeout=120)):
        assert report["comm"] == (False, 64 * 2**20)
        assert report["pass"] == ("StandinWorkspace", "mnnvl", True)  # R5: one workspace
        assert report["fused_residual_out"] == 4.0                    # (1 + 2) + 1
        assert report["should_use"] and report["all_reduce"] == 3.0
        assert report["declines"] == [False] * 5
        # the communicator asked for more tokens: a larger workspace (R4), which the pass then
        # gets too; the smaller one lives until destroy (graphs captured with it)
        assert report["after_comm"] == (False, True, False)
        assert report["checkpoints"] == [[("prepare", None), ("restore", True)]] * 2
        assert report["other_group_untouched"]
        assert report["freed"] == (True, True, True)
        assert report["rendezvous_group"] and report["store_released"]  # R9, R10
        assert report["fresh_after_destroy"]


def call_sequence(rank: int, world: int, topo: str) -> dict[str, Any]:
    import torch.distributed as dist
    from flashinfer_standin import StandinFlashInfer

    mp = pytest.MonkeyPatch()
    mp.setenv("ARFUSE_TOPOLOGY", topo)
    fake = StandinFlashInfer()
    fake.install(mp)
    group = dist.new_group(backend="gloo")  # vLLM's cpu_group
    report: dict[str, Any] = {}
    with mp.context() as cuda:
        cuda.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA platform
        comm = dropin.FlashInferAllReduce(group=group, device="cpu")
    report["comm"] = (comm.disabled, comm.max_workspace_size)
    kw: dict[str, Any] = {"world_size": 2, "rank": rank, "max_token_num": 512,
                          "hidden_dim": 256, "dtype": torch.bfloat16, "group": group}
    ws = dropin.get_fi_ar_workspace(**kw)
    quant = dropin.get_fi_ar_quant_workspace(**kw)
    report["pass"] = (type(ws).__name__, ws.backend, quant is ws)
    report["rendezvous_group"] = ws.group is group and ws.comm.group is group  # R9
    comm_mod = sys.modules["flashinfer.comm"]
    x = torch.full((4, 256), float(rank + 1), dtype=torch.bfloat16)
    residual, norm_out = torch.ones_like(x), torch.empty_like(x)
    comm_mod.allreduce_fusion(  # type: ignore[attr-defined]
        input=x, workspace=dropin.get_fi_ar_workspace(**kw),
        pattern=comm_mod.AllReduceFusionPattern.kARResidualRMSNorm,  # type: ignore[attr-defined]
        launch_with_pdl=True, output=None, residual_out=residual, norm_out=norm_out,
        residual_in=residual, rms_gamma=torch.ones(256, dtype=torch.bfloat16), rms_eps=1e-6)
    report["fused_residual_out"] = float(residual[0, 0])
    y = torch.full((8, 256), float(rank + 1), dtype=torch.bfloat16)
    report["should_use"] = comm.should_use_fi_ar(y)
    out = comm.all_reduce(y)
    report["all_reduce"] = float(out[0, 0]) if bool(torch.all(out == out[0, 0])) else -1.0
    too_many = comm.max_workspace_size // (256 * 2) + 1
    report["declines"] = [comm.should_use_fi_ar(t) for t in (
        torch.ones(256, 8, dtype=torch.bfloat16).t(), torch.ones(2, 4, 256, dtype=torch.bfloat16),
        torch.ones(8, 256, dtype=torch.int32), torch.ones(8, 256, dtype=torch.float64),
        torch.empty(too_many, 256, dtype=torch.bfloat16))]
    again = dropin.get_fi_ar_workspace(**kw)
    report["after_comm"] = (again is ws, again is dropin.get_fi_ar_quant_workspace(**kw),
                            ws.destroyed)
    dropin.checkpoint_prepare_fi_ar_workspaces(group, skip_unsupported=True)
    dropin.checkpoint_restore_fi_ar_workspaces(group, skip_unsupported=True)
    report["checkpoints"] = [[(what, arg is group if what == "restore" else arg)
                              for what, arg in w.checkpoints] for w in (ws, again)]
    other = dist.new_group(backend="gloo")
    dropin.checkpoint_prepare_fi_ar_workspaces(other)
    report["other_group_untouched"] = all(len(w.checkpoints) == 2 for w in (ws, again))
    comm.destroy()
    report["freed"] = (REGISTRY.workspaces() == [], all(w.destroyed for w in fake.workspaces),
                       not dropin._held)
    report["store_released"] = group_mod._channels[group_mod.group_key(group)].store is None
    fresh = dropin.get_fi_ar_workspace(**kw)
    report["fresh_after_destroy"] = fresh is not None and fresh not in (ws, again)
    dropin.destroy_fi_ar_workspace()
    mp.undo()
    return report


@pytest.mark.slow
def test_behaviour_table_on_two_ranks(tmp_path: Path) -> None:
    """Each row: what vLLM's rule resolves, and which FlashInfer workspace every rank gets."""
    rows = values(run_ranks(behaviour_table, 2, two_rank_topologies(tmp_path), env=RANK_ENV,
                            timeout=180))
    for rank, row in enumerate(rows):
        # auto on one NVSwitch node: mnnvl, one workspace for plain and quant (R5)
        assert row["auto/nvswitch"] == (("mnnvl", True), "mnnvl", True)
        # R7: mnnvl fails on rank 1 only (no multicast there): every rank falls back to trtllm
        assert row["auto/nvswitch, rank 1 without multicast"] == (("mnnvl", True), "trtllm",
                                                                    True)
        # an explicit choice never falls back
        assert row["mnnvl/nvswitch without multicast"] == (("mnnvl", False), None, None)
        assert row["trtllm/nvswitch"] == (("trtllm", False), "trtllm", True)
        # R2 + R3: NVLink bridges, no multicast: vLLM would run trtllm ~10x slower than unfused
        assert row["auto/bridges"] == (("mnnvl", True), None, None)
        # across nodes: mnnvl alone on SM 100 with a fabric; nothing below SM 100
        assert row["auto/gb200 2 nodes"] == (("mnnvl", False), "mnnvl", True)
        assert row["auto/h100 2 nodes"] == ((None, False), None, None, 0)
        plain, quant = row["trtllm/h100 2 nodes"]
        assert plain[:2] == quant[:2] == ("raised", "ValueError")
        assert "multi-node allreduce with 'trtllm' backend" in plain[2]
        assert "quantization fusion is not supported" in quant[2]
        # R7: ranks that ask for different backends fail together, naming the values
        kind, name, message = row["ranks disagree"]
        assert (kind, name) == ("raised", "NegotiationError")
        assert "rank 0: 'auto'; rank 1: 'mnnvl'" in message
        # R4: reuse only what fits
        assert row["R4"] == {"smaller": True, "larger": False, "larger_for_smaller": True,
                             "hidden": True, "dtype": True, "too_wide_is_new": True,
                             "quant_follows": True, "old_alive": True}
        # R1: the communicator admits what the workspace holds, not the byte budget
        capacity, budget, at, over = row["R1"]
        assert 0 < capacity < budget and at and not over
        # the fusion pass hands the workspace to FlashInfer for up to max_token_num tokens: a
        # workspace that holds fewer is regrown once (64 -> 128 here), or there is none
        assert row["R1 getter"] == (True, 128, True)
        assert row["R1 getter, far too small"] == (None, 1)
        # checkpoints a FlashInfer workspace cannot do: skipped only when asked to
        assert row["checkpoint unsupported"] == ("NotImplementedError", "skipped")
        for name, freed in row.items():
            if name.endswith("/freed"):
                assert freed == (True, True), f"rank {rank}: {name}"


def behaviour_table(rank: int, world: int, topologies: dict[str, str]) -> dict[str, Any]:
    import torch.distributed as dist
    from flashinfer_standin import StandinFlashInfer

    group = dist.new_group(backend="gloo")
    kw: dict[str, Any] = {"world_size": 2, "rank": rank, "max_token_num": 64, "hidden_dim": 256,
                          "dtype": torch.bfloat16, "group": group}
    rows: dict[str, Any] = {}

    def backend(handle: Any) -> str | None:
        return None if handle is None else str(handle.backend)

    def row(name: str, topo: str, setting: str, body: Any,
            fake: StandinFlashInfer | None = None) -> None:
        mp = pytest.MonkeyPatch()
        fake = fake or StandinFlashInfer()
        try:
            mp.setenv("ARFUSE_TOPOLOGY", topologies[topo])
            mp.setenv(ENV, setting)
            fake.install(mp)
            try:
                rows[name] = body(fake)
            except Exception as exc:
                rows[name] = ("raised", type(exc).__name__, str(exc))
            finally:
                dropin.destroy_fi_ar_workspace()
                rows[name + "/freed"] = (REGISTRY.workspaces() == [],
                                         all(w.destroyed for w in fake.workspaces))
        finally:
            mp.undo()

    def resolved(fake: StandinFlashInfer) -> tuple[Any, ...]:
        handle = dropin.get_fi_ar_workspace(**kw)
        quant = dropin.get_fi_ar_quant_workspace(**kw)
        return (dropin.resolve_fi_ar_backend(group), backend(handle),
                None if handle is None else quant is handle)

    row("auto/nvswitch", "nvswitch", "auto", resolved)
    row("auto/nvswitch, rank 1 without multicast", "nvswitch", "auto", resolved,
        StandinFlashInfer(multicast=lambda r: r != 1))
    row("mnnvl/nvswitch without multicast", "nvswitch", "mnnvl", resolved,
        StandinFlashInfer(multicast=lambda r: False))
    row("trtllm/nvswitch", "nvswitch", "trtllm", resolved)
    row("auto/bridges", "bridges", "auto", resolved)
    row("auto/gb200 2 nodes", "gb200_2n", "auto", resolved)
    row("auto/h100 2 nodes", "h100_2n", "auto",
        lambda fake: (*resolved(fake), len(fake.created)))

    def both_raise(fake: StandinFlashInfer) -> tuple[Any, ...]:
        outcomes = []
        for getter in (dropin.get_fi_ar_workspace, dropin.get_fi_ar_quant_workspace):
            try:
                outcomes.append(("returned", backend(getter(**kw)), ""))
            except Exception as exc:
                outcomes.append(("raised", type(exc).__name__, str(exc)))
        return tuple(outcomes)

    row("trtllm/h100 2 nodes", "h100_2n", "trtllm", both_raise)
    row("ranks disagree", "nvswitch", "auto" if rank == 0 else "mnnvl",
        lambda fake: dropin.get_fi_ar_workspace(**kw))

    def reuse(fake: StandinFlashInfer) -> dict[str, bool]:
        first = dropin.get_fi_ar_workspace(**kw)
        smaller = dropin.get_fi_ar_workspace(**{**kw, "max_token_num": 32})
        larger = dropin.get_fi_ar_workspace(**{**kw, "max_token_num": 128})
        again = dropin.get_fi_ar_workspace(**kw)
        # FlashInfer's answer decides (the fusion pass sizes one workspace for the widest
        # model, then asks with each tensor's shape): the 128-token bf16 workspace of hidden
        # 256 holds 64 tokens of hidden 512 or of fp32, not 128
        fits = {"hidden": dropin.get_fi_ar_workspace(**{**kw, "hidden_dim": 512}) is larger,
                "dtype": dropin.get_fi_ar_workspace(**{**kw, "dtype": torch.float32}) is larger}
        too_wide = dropin.get_fi_ar_workspace(**{**kw, "hidden_dim": 512, "max_token_num": 128})
        return {"smaller": smaller is first, "larger": larger is first,
                "larger_for_smaller": again is larger, **fits,
                "too_wide_is_new": too_wide is not larger and too_wide is not None,
                "quant_follows": dropin.get_fi_ar_quant_workspace(**kw) in (larger, too_wide),
                "old_alive": not first.destroyed}

    row("R4", "nvswitch", "auto", reuse)

    def capacity(fake: StandinFlashInfer) -> tuple[int, int, bool, bool]:
        with pytest.MonkeyPatch.context() as cuda:
            cuda.setattr(torch.cuda, "is_available", lambda: True)
            comm = dropin.FlashInferAllReduce(group, "cpu")
        tokens = comm.max_workspace_size // (256 * 2)
        assert comm.should_use_fi_ar(torch.ones(1, 256, dtype=torch.bfloat16))
        op = comm._op(256, torch.bfloat16)
        assert op is not None
        cap = op.capacity
        at = comm.should_use_fi_ar(torch.empty(cap, 256, dtype=torch.bfloat16))
        over = comm.should_use_fi_ar(torch.empty(cap + 1, 256, dtype=torch.bfloat16))
        comm.destroy()
        return cap, tokens, at, over

    row("R1", "nvswitch", "auto", capacity, StandinFlashInfer(buffer_scale=0.5))

    def holds(fake: StandinFlashInfer) -> tuple[Any, ...]:
        handle = dropin.get_fi_ar_workspace(**kw)
        if handle is None:
            return None, len(fake.created)
        return (handle.is_buffer_size_sufficient(2, 64, 256, torch.bfloat16),
                handle.max_token_num, dropin.get_fi_ar_quant_workspace(**kw) is handle)

    row("R1 getter", "nvswitch", "auto", holds, StandinFlashInfer(buffer_scale=0.5))
    row("R1 getter, far too small", "nvswitch", "auto", holds,
        StandinFlashInfer(buffer_scale=0.1))

    def checkpoint(fake: StandinFlashInfer) -> tuple[str, str]:
        dropin.get_fi_ar_workspace(**kw)
        try:
            dropin.checkpoint_prepare_fi_ar_workspaces(group)
            strict = "passed"
        except NotImplementedError:
            strict = "NotImplementedError"
        dropin.checkpoint_prepare_fi_ar_workspaces(group, skip_unsupported=True)
        dropin.checkpoint_restore_fi_ar_workspaces(group, skip_unsupported=True)
        return strict, "skipped"

    row("checkpoint unsupported", "nvswitch", "auto", checkpoint,
        StandinFlashInfer(checkpoint=False))
    return rows


@pytest.mark.slow
def test_node_count_and_exchanges_are_the_groups_own() -> None:
    """R6 + R9 on three ranks, hosts A, A, B: the two-rank group on host A is one node (trtllm
    allowed, fallback allowed) although the world spans two; rank 2 never joins the group's
    exchanges (were the world used, ranks 0 and 1 would time out); explicit trtllm is a
    ValueError on the world, not on the group. R8: a rank that never calls is named."""
    results = values(run_ranks(group_scoping, 3, env={**RANK_ENV, "ARFUSE_TIMEOUT_S": "5"},
                               timeout=120))
    for rank, result in enumerate(results):
        if rank < 2:
            assert result["group"] == ("mnnvl", True)
            assert result["group_trtllm"] == "None"
        assert result["world"] == (None, False)
        assert result["world_trtllm"].startswith("ValueError: Flashinfer allreduce is not")
        assert result["held"] == 0
    assert results[0]["deadline"] == (1,)


def group_scoping(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from arfuse import topology

    mp = pytest.MonkeyPatch()
    mp.setattr(topology, "host_identity", lambda: "A" if rank < 2 else "B")
    tp = dist.new_group([0, 1], backend="gloo")
    result: dict[str, Any] = {}
    kw: dict[str, Any] = {"max_token_num": 64, "hidden_dim": 256, "dtype": torch.bfloat16}
    if rank < 2:
        result["group"] = dropin.resolve_fi_ar_backend(tp)
        mp.setenv(ENV, "trtllm")
        result["group_trtllm"] = repr(dropin.get_fi_ar_workspace(
            world_size=2, rank=rank, group=tp, **kw))
        mp.delenv(ENV)
    result["world"] = dropin.resolve_fi_ar_backend(None)
    mp.setenv(ENV, "trtllm")
    try:
        dropin.get_fi_ar_workspace(world_size=3, rank=rank, group=dist.group.WORLD, **kw)
        result["world_trtllm"] = "returned"
    except ValueError as exc:
        result["world_trtllm"] = f"ValueError: {exc}"
    dropin.destroy_fi_ar_workspace()
    result["held"] = len(dropin._held)
    if rank == 0:  # R8: rank 1 never calls; rank 0 is told so within the deadline
        mp.setenv("ARFUSE_TIMEOUT_S", "1")
        try:
            dropin.resolve_fi_ar_backend(tp)
            result["deadline"] = "returned"
        except NegotiationTimeout as exc:
            result["deadline"] = exc.silent
    mp.undo()
    return result


def test_the_communicator_declines_a_shape_without_a_workspace_and_keeps_the_others(
        tmp_path: Path) -> None:
    """A shape arfuse makes no workspace for (Mamba's fp32 [T, 1] all-reduce: a row under 16
    bytes) is declined alone: the bf16 shape keeps its workspace, and destroy() frees it (one
    such shape used to disable the communicator for every shape, and destroy then freed
    nothing)."""
    topo = two_rank_topologies(tmp_path)["nvswitch"]
    for got in values(run_ranks(shapes_on_one_communicator, 2, topo, env=RANK_ENV,
                                timeout=120)):
        assert got == {"main": (True, 3.0), "odd": False, "main_after": True,
                       "live_after_destroy": 0, "held_after_destroy": 0}, got


def shapes_on_one_communicator(rank: int, world: int, topo: str) -> dict[str, Any]:
    import torch.distributed as dist
    from flashinfer_standin import StandinFlashInfer

    mp = pytest.MonkeyPatch()
    mp.setenv("ARFUSE_TOPOLOGY", topo)
    StandinFlashInfer().install(mp)
    group = dist.new_group(backend="gloo")
    with mp.context() as cuda:
        cuda.setattr(torch.cuda, "is_available", lambda: True)
        comm = dropin.FlashInferAllReduce(group=group, device="cpu")
    main = torch.full((8, 256), float(rank + 1), dtype=torch.bfloat16)
    got: dict[str, Any] = {"main": (comm.should_use_fi_ar(main),
                                    float(comm.all_reduce(main)[0, 0]))}
    got["odd"] = comm.should_use_fi_ar(torch.ones(8, 1, dtype=torch.float32))
    got["main_after"] = comm.should_use_fi_ar(main)
    comm.destroy()
    got["live_after_destroy"] = len(REGISTRY.workspaces())
    got["held_after_destroy"] = len(dropin._held)
    dropin.destroy_fi_ar_workspace()
    mp.undo()
    return got


def test_a_fused_call_of_a_narrower_model_gets_the_pass_workspace(tmp_path: Path) -> None:
    """The fusion pass sizes one workspace for the widest model (a draft of hidden 512 here);
    each fused call then asks with its own tensor's hidden size (the target's 256), and vLLM
    asserts the answer is not None. The workspace FlashInfer says holds it is returned, with no
    collective creation at run time (which could fail, or run inside a graph capture)."""
    topo = two_rank_topologies(tmp_path)["nvswitch"]
    for got in values(run_ranks(narrower_call_after_the_pass, 2, topo, env=RANK_ENV,
                                timeout=120)):
        assert got == {"same": True, "created": 1}, got


def narrower_call_after_the_pass(rank: int, world: int, topo: str) -> dict[str, Any]:
    import torch.distributed as dist
    from flashinfer_standin import StandinFlashInfer

    mp = pytest.MonkeyPatch()
    mp.setenv("ARFUSE_TOPOLOGY", topo)
    fake = StandinFlashInfer()
    fake.install(mp)
    group = dist.new_group(backend="gloo")
    kw: dict[str, Any] = {"world_size": 2, "rank": rank, "max_token_num": 512,
                          "hidden_dim": 512, "dtype": torch.bfloat16, "group": group}
    pass_workspace = dropin.get_fi_ar_workspace(**kw)
    at_run_time = dropin.get_fi_ar_workspace(**{**kw, "hidden_dim": 256})
    got = {"same": at_run_time is pass_workspace, "created": len(fake.created)}
    dropin.destroy_fi_ar_workspace()
    mp.undo()
    return got


def test_the_drop_in_waits_as_long_as_vllm_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks reach the first getter after loading their weights, minutes apart: without
    ARFUSE_TIMEOUT_S the drop-in waits torch's default process-group timeout, as vLLM's own
    creation does (arfuse's 60 s ended start-up on the early ranks); the variable still rules."""
    monkeypatch.delenv("ARFUSE_TIMEOUT_S", raising=False)
    assert dropin.drop_in_timeout_s() == dropin.DROP_IN_TIMEOUT_S == 1800.0
    monkeypatch.setenv("ARFUSE_TIMEOUT_S", "7.5")
    assert dropin.drop_in_timeout_s() == 7.5


# the failing call's deadline; the peers must hear of a refusal well before it
REFUSAL_TIMEOUT_S = 12.0


@pytest.mark.parametrize("scenario", ["bad hidden_dim", "destroy on one rank"])
def test_a_remembered_decline_meets_the_other_ranks_in_the_exchange(scenario: str) -> None:
    """After a declined getter call (no CUDA here: nothing to create, remembered), rank 1
    either passes an invalid hidden_dim or forgets the failure (destroy on that rank alone).
    The remembered answer and the refusal travel in the same exchange: the refusing rank gets
    its ValueError and the others PeerAborted at once; a rank that forgot declines with the
    others. The group stays in step: later drop-in calls and ops on it work on every rank."""
    env = {**RANK_ENV, "ARFUSE_TIMEOUT_S": str(REFUSAL_TIMEOUT_S)}
    got = values(run_ranks(remembered_decline_then_rank_1_differs, 2, scenario, env=env,
                           timeout=120))
    if scenario == "bad hidden_dim":
        assert got[0]["second"][:2] == ("raised", "PeerAborted"), got[0]
        assert "rank 1" in got[0]["second"][2] and "hidden" in got[0]["second"][2]
        assert got[1]["second"][:2] == ("raised", "ValueError"), got[1]
    else:
        assert [g["second"] for g in got] == [("returned", "None", "")] * 2, got
    for rank, report in enumerate(got):
        assert report["first"] == "None"
        assert report["seconds"] < REFUSAL_TIMEOUT_S / 2, (rank, report)
        assert report["third"] == "None" and report["resolve"] == ("mnnvl", True), report
        assert report["sum"] == 3.0


def remembered_decline_then_rank_1_differs(rank: int, world: int,
                                           scenario: str) -> dict[str, Any]:
    import torch.distributed as dist

    import arfuse

    group = dist.new_group(backend="gloo")
    kw: dict[str, Any] = {"world_size": 2, "rank": rank, "max_token_num": 64,
                          "hidden_dim": 256, "dtype": torch.float32, "group": group}
    report: dict[str, Any] = {"first": repr(dropin.get_fi_ar_workspace(**kw))}
    second = dict(kw)
    if rank == 1 and scenario == "bad hidden_dim":
        second["hidden_dim"] = 0
    elif rank == 1:
        dropin.destroy_fi_ar_workspace()
    started = time.monotonic()
    try:
        report["second"] = ("returned", repr(dropin.get_fi_ar_workspace(**second)), "")
    except (ValueError, PeerAborted, NegotiationError) as exc:
        report["second"] = ("raised", type(exc).__name__, str(exc))
    report["seconds"] = time.monotonic() - started
    report["third"] = repr(dropin.get_fi_ar_workspace(**kw))
    report["resolve"] = dropin.resolve_fi_ar_backend(group)
    op = arfuse.FusedAllReduce(group, max_token_num=4, hidden_dim=64, dtype=torch.float32,
                               backend="torch")
    report["sum"] = float(op(torch.full((2, 64), float(rank + 1))).out[0, 0])
    op.close()
    dropin.destroy_fi_ar_workspace()
    return report
