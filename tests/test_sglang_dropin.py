"""The SGLang drop-in (``arfuse.integrations.sglang``): SGLang 0.5.23's surface, its resolution
rules on the fusion group's own facts, and the GPU paths where SGLang's module fails in the field,
on real gloo ranks with the FlashInfer stand-in (``flashinfer_standin``) and one of what the
drop-in reads of SGLang (``sglang_standin``). No SGLang is needed: scripts/sglang_check.sh runs
the real module. Not a hardware test."""

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
from sglang_standin import SGLang

from arfuse import log
from arfuse import topology as topology_mod
from arfuse.errors import NegotiationTimeout
from arfuse.integrations import common
from arfuse.integrations import sglang as dropin
from arfuse.integrations.sglang import workspaces
from arfuse.registry import REGISTRY
from arfuse.topology import Topology

from harness import run_ranks, values

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "topologies"
RANK_ENV = {"ARFUSE_TIMEOUT_S": "10", "ARFUSE_LOG": "warning"}
BF16 = torch.bfloat16
# two H100 NVL boards bridged as a pair: NVLink between the two, no NVSwitch multicast
H100_NVL_PAIR = {"device": "cuda", "world_size": 2, "hosts": ["n0", "n0"], "sm": 90,
                 "gpu": "H100 NVL", "multicast": False, "nvlink_all_pairs": True,
                 "fabric": False, "flashinfer": "0.7.2.post1"}


def example(name: str, **changes: Any) -> Topology:
    data = json.loads((EXAMPLES / f"{name}.json").read_text())
    return Topology.from_dict({**data, **changes})


@pytest.fixture
def sglang(monkeypatch: pytest.MonkeyPatch) -> Any:
    """One process, no process group: SGLang's state with the flag unset."""
    state = SGLang(None)
    state.install(monkeypatch)
    monkeypatch.setattr(workspaces, "_unavailable", False)
    yield state
    dropin.cleanup_flashinfer_workspace()


# --- the surface ------------------------------------------------------------------------------


def params(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_names_and_signatures_are_sglang_0_5_23s() -> None:
    """What SGLang's callers call, as 0.5.23 defines it (scripts/sglang_check.sh compares
    them with the installed module too)."""
    empty = inspect.Parameter.empty
    assert params(dropin.FlashInferWorkspaceManager.initialize) == [
        ("self", empty), ("world_size", empty), ("rank", empty), ("max_token_num", empty),
        ("hidden_dim", empty), ("backend", "auto"), ("group", None),
        ("use_fp32_lamport", False), ("dtype", None), ("use_oneshot", None),
        ("device_group", None), ("cpu_group", None)]
    assert params(dropin.FlashInferWorkspaceManager.is_buffer_size_sufficient) == [
        ("self", empty), ("token_num", empty), ("hidden_dim", empty), ("dtype", empty),
        ("use_oneshot", None)]
    assert params(dropin.ensure_workspace_initialized) == [
        ("max_token_num", 2048), ("hidden_dim", 4096), ("use_fp32_lamport", False),
        ("dtype", None), ("token_num", None), ("use_oneshot", None),
        ("use_attn_tp_group", True)]
    fused = [("input_tensor", empty), ("residual", empty), ("weight", empty), ("eps", 1e-6),
             ("max_token_num", 2048), ("use_oneshot", None),
             ("trigger_completion_at_end", False), ("fp32_acc", True),
             ("use_attn_tp_group", True)]
    assert params(dropin.flashinfer_allreduce_residual_rmsnorm) == fused
    assert params(dropin.fake_flashinfer_allreduce_residual_rmsnorm) == [
        *fused[:4], ("max_token_num", 16384), *fused[5:]]
    assert params(dropin.can_use_flashinfer_allreduce) == [
        ("input_", empty), ("use_attn_tp_group", empty), ("expected_world_size", empty),
        ("expected_group_key", empty)]
    assert params(dropin.flashinfer_allreduce) == [("input_", empty),
                                                   ("use_attn_tp_group", empty)]
    assert params(dropin.pre_initialize_workspaces) == [
        ("max_token_num", empty), ("hidden_dim", empty), ("dtype", empty), ("use_oneshot", None)]
    for fn in (dropin.resolve_fusion_world_size, dropin.resolve_fusion_group):
        assert params(fn) == [("use_attn_tp_group", empty)]
    for fn in (dropin.uses_cutedsl_ar_fusion, dropin.resolve_flashinfer_allreduce_fusion_backend,
               dropin.is_flashinfer_allreduce_unavailable, dropin.cleanup_flashinfer_workspace):
        assert params(fn) == []


def test_an_unknown_flag_value_is_a_value_error_naming_the_flag(sglang: SGLang) -> None:
    sglang.exec.comm.flashinfer_allreduce_fusion_backend = "nccl"
    with pytest.raises(ValueError, match="--flashinfer-allreduce-fusion-backend must be one of"):
        dropin.backend_setting()


# --- SGLang's rules, on the group's topology -------------------------------------------------


@pytest.mark.parametrize(("setting", "topology", "expected"), [
    (None, example("h200-nvswitch-8"), None),
    # auto: the first fused backend the group's capability allows (R2, R3)
    ("auto", example("h200-nvswitch-8"), "mnnvl"),
    ("auto", Topology.from_dict(H100_NVL_PAIR), "trtllm"),           # no multicast
    ("auto", example("h200-nvl-bridges-8"), None),                    # nor NVLink all pairs
    ("auto", example("gb200-2nodes-mnnvl-fabric"), "mnnvl"),
    ("auto", example("gb200-2nodes-mnnvl-fabric", fabric=False), None),
    # an explicit choice is taken as is (creation then decides, on every rank together)
    ("mnnvl", Topology.from_dict(H100_NVL_PAIR), "mnnvl"),
    ("trtllm", example("h200-nvl-bridges-8"), "trtllm"),
    ("mnnvl", example("gb200-2nodes-mnnvl-fabric"), "mnnvl"),
    ("cutedsl", example("gb200-2nodes-mnnvl-fabric"), "cutedsl"),
])
def test_backend_rule(setting: str | None, topology: Topology, expected: str | None) -> None:
    assert dropin.choose_backend(setting, topology) == expected


@pytest.mark.parametrize(("setting", "topology", "message"), [
    ("auto", Topology(device="cpu", world_size=2), dropin.NEEDS_SM),
    ("auto", Topology(device="cuda", world_size=2, sm=80), dropin.NEEDS_SM),
    ("cutedsl", example("h200-nvswitch-8"), dropin.CUTEDSL_NEEDS_BLACKWELL),
    ("auto", example("h100-2nodes-no-fabric"), dropin.AUTO_MULTI_NODE),
    ("trtllm", example("gb200-2nodes-mnnvl-fabric"), dropin.TRTLLM_MULTI_NODE),
    ("mnnvl", example("h100-2nodes-no-fabric"), dropin.MNNVL_NEEDS),
])
def test_what_sglang_refuses_is_refused_with_its_message(setting: str, topology: Topology,
                                                         message: str) -> None:
    with pytest.raises(ValueError) as caught:
        dropin.choose_backend(setting, topology)
    assert str(caught.value) == message


def test_the_node_count_is_the_groups_not_the_launchs() -> None:
    """R6: the rule reads the group's hosts; SGLang's read ``get_parallel().nnodes``."""
    node_local = example("h200-nvswitch-8", world_size=2, hosts=["n0", "n0"])
    assert dropin.choose_backend("trtllm", node_local) == "trtllm"
    spanning = example("h200-nvswitch-8", world_size=2, hosts=["n0", "n1"])
    with pytest.raises(ValueError, match="single-node only"):
        dropin.choose_backend("trtllm", spanning)


def test_one_process_declines_everything_and_keeps_nothing(sglang: SGLang) -> None:
    """No process group: one rank, nothing to reduce; every function declines as SGLang's."""
    sglang.exec.comm.flashinfer_allreduce_fusion_backend = "auto"
    x = torch.ones(4, 256, dtype=BF16)
    assert dropin.ensure_workspace_initialized(hidden_dim=256) is False
    assert dropin.flashinfer_allreduce_residual_rmsnorm(
        x, torch.ones_like(x), torch.ones(256, dtype=BF16)) == (None, None)
    assert not dropin.can_use_flashinfer_allreduce(
        x, use_attn_tp_group=True, expected_world_size=1, expected_group_key=(None, None))
    dropin.pre_initialize_workspaces(2048, 256, BF16)
    assert REGISTRY.workspaces() == [] and not dropin.is_flashinfer_allreduce_unavailable()


def test_cutedsl_is_declined_with_a_clear_log_line(
        sglang: SGLang, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """CuTe DSL fusion is SGLang's own module: the drop-in says so once and creates nothing;
    the resolver still answers ``cutedsl`` (SGLang's runner asks it for the platform check)."""
    path = tmp_path / "gb200.json"
    path.write_text(json.dumps({**example("gb200-2nodes-mnnvl-fabric").to_dict(),
                                "world_size": 1, "hosts": ["tray0"]}))
    monkeypatch.setenv("ARFUSE_TOPOLOGY", str(path))
    monkeypatch.setenv("ARFUSE_LOG", "info")
    monkeypatch.setattr(log, "_seen", set())
    sglang.exec.comm.flashinfer_allreduce_fusion_backend = "cutedsl"
    manager = dropin.FlashInferWorkspaceManager()
    with caplog.at_level(logging.INFO, logger="arfuse"):
        assert dropin.uses_cutedsl_ar_fusion()
        assert dropin.resolve_flashinfer_allreduce_fusion_backend() == "cutedsl"
        assert dropin.ensure_workspace_initialized(hidden_dim=256) is False
        manager.initialize(world_size=1, rank=0, max_token_num=64, hidden_dim=256,
                           backend="cutedsl")
    assert manager.workspace is None and REGISTRY.workspaces() == []
    lines = [r.getMessage() for r in caplog.records if "cutedsl is SGLang's" in r.getMessage()]
    assert lines == ["arfuse SGLang drop-in: --flashinfer-allreduce-fusion-backend cutedsl is "
                     "SGLang's CuTe DSL fusion, not arfuse's: arfuse creates no workspace for "
                     "it, SGLang's CuTe DSL module stays in charge"]


# --- real gloo ranks with the FlashInfer stand-in ---------------------------------------------


def topology_file(tmp_path: Path, name: str, data: dict[str, Any]) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return str(path)


def cut(name: str, hosts: list[str]) -> dict[str, Any]:
    """A shipped example for as many ranks as ``hosts`` names."""
    data = json.loads((EXAMPLES / f"{name}.json").read_text())
    return {**data, "world_size": len(hosts), "hosts": hosts}


def flashinfer_0_7_2_signature(mp: pytest.MonkeyPatch, raises_on: int | None = None) -> None:
    """The installed stand-in's creation with FlashInfer 0.7.2.post1's signature, which has no
    ``use_fp32_lamport``: SGLang 0.5.23's module passes it for fp32 and gets a TypeError.
    ``raises_on``: that rank's mnnvl creation raises inside FlashInfer (0.6.15+ without
    multicast, or out of memory) while its peers are in the handle exchange."""
    comm = sys.modules["flashinfer.comm"]
    loose = comm.create_allreduce_fusion_workspace

    def create_allreduce_fusion_workspace(
            backend: str = "auto", world_size: Any = None, rank: Any = None,
            max_token_num: Any = None, hidden_dim: Any = None, dtype: Any = None,
            gpus_per_node: Any = None, comm_backend: Any = None,
            force_oneshot_support: bool = False, group: Any = None) -> Any:
        if backend == "mnnvl" and rank == raises_on:
            raise RuntimeError("[SymmDeviceMemory] cuMemCreate: out of memory")
        return loose(backend=backend, world_size=world_size, rank=rank,
                     max_token_num=max_token_num, hidden_dim=hidden_dim, dtype=dtype,
                     comm_backend=comm_backend, group=group)

    for module in (comm, comm.allreduce):
        mp.setattr(module, "create_allreduce_fusion_workspace", create_allreduce_fusion_workspace)


class Rows:
    """One rank's table: each row in its own stand-ins and settings, freed after (R10)."""

    def __init__(self, group: Any):
        self.group, self.rows = group, {}

    def row(self, name: str, setting: str | None, topo: str, body: Any, fake: Any = None,
            faults: str | None = None, nnodes: int = 1, group: Any = None,
            raises_on: int | None = None) -> None:
        from flashinfer_standin import StandinFlashInfer

        mp = pytest.MonkeyPatch()
        fake = fake or StandinFlashInfer()
        try:
            if topo:
                mp.setenv("ARFUSE_TOPOLOGY", topo)
            else:
                mp.delenv("ARFUSE_TOPOLOGY", raising=False)
            if faults:
                mp.setenv("ARFUSE_FAULTS", faults)
            fake.install(mp)
            flashinfer_0_7_2_signature(mp, raises_on)
            mp.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA platform
            mp.setattr(common, "cuda_if_available", lambda: None)  # tensors: the gloo group's
            mp.setattr(workspaces, "_unavailable", False)
            SGLang(setting, self.group if group is None else group, nnodes=nnodes).install(mp)
            try:
                self.rows[name] = body(fake)
            except Exception as exc:
                self.rows[name] = ("raised", type(exc).__name__, str(exc))
            finally:
                dropin.cleanup_flashinfer_workspace()
                self.rows[name + "/freed"] = (REGISTRY.workspaces() == [],
                                              all(w.destroyed for w in fake.workspaces))
        finally:
            mp.undo()


def outcome(fake: Any) -> tuple[Any, ...]:
    """(resolver, workspace ready, its backend, fusion disabled, backends FlashInfer created)."""
    resolved = dropin.resolve_flashinfer_allreduce_fusion_backend()
    ready = dropin.ensure_workspace_initialized(max_token_num=64, hidden_dim=256, dtype=BF16)
    manager = dropin._get_workspace_manager(True)
    return (resolved, ready, manager.backend, dropin.is_flashinfer_allreduce_unavailable(),
            sorted({kw["backend"] for kw in fake.created}))


def fused(rank: int, dtype: torch.dtype = BF16, tokens: int = 8) -> tuple[Any, ...]:
    """SGLang's layer calls: the fused op (residual_out = sum + residual) and the plain
    all-reduce behind ``can_use_flashinfer_allreduce``."""
    x = torch.full((tokens, 256), float(rank + 1), dtype=dtype)
    _, residual_out = dropin.flashinfer_allreduce_residual_rmsnorm(
        x, torch.ones_like(x), torch.ones(256, dtype=dtype), max_token_num=64)
    manager = dropin._get_workspace_manager(True)
    key = manager.group
    can = dropin.can_use_flashinfer_allreduce(
        x, use_attn_tp_group=True, expected_world_size=2, expected_group_key=key)
    summed = dropin.flashinfer_allreduce(x, use_attn_tp_group=True) if can else None
    return (None if residual_out is None else float(residual_out[0, 0]), can,
            None if summed is None else float(summed[0, 0]))


@pytest.mark.slow
def test_gpu_paths_on_two_ranks(tmp_path: Path) -> None:
    """Each row: what the resolver answers, whether the fusion group gets a workspace, which,
    whether fusion is disabled, what FlashInfer was asked to create; every rank the same."""
    topologies = {
        "nvswitch": topology_file(tmp_path, "nvswitch", cut("h200-nvswitch-8", ["n0"] * 2)),
        "h100 nvl": topology_file(tmp_path, "h100nvl", H100_NVL_PAIR),
        "bridges": topology_file(tmp_path, "bridges", cut("h200-nvl-bridges-8", ["n0"] * 2)),
        "gb200": topology_file(tmp_path, "gb200", cut("gb200-2nodes-mnnvl-fabric",
                                                      ["tray0", "tray1"]))}
    for rank, row in enumerate(values(run_ranks(gpu_paths, 2, topologies, env=RANK_ENV,
                                                timeout=150))):
        # one NVSwitch node: mnnvl, and SGLang's layer calls run on it
        assert row["auto/nvswitch"] == ("mnnvl", True, "mnnvl", False, ["mnnvl"])
        assert row["auto/nvswitch calls"] == (4.0, True, 3.0)
        # H100 NVL without multicast: auto skips mnnvl (R2) and takes trtllm (the pair is
        # NVLinked); explicit mnnvl, which SGLang creates and crashes on, is refused before
        # any creation, on every rank together
        assert row["auto/h100 nvl"] == ("trtllm", True, "trtllm", False, ["trtllm"])
        assert row["mnnvl/h100 nvl"] == ("mnnvl", False, None, True, [])
        # SM90 without NVLink between the pair: SGLang's auto takes trtllm, which is slower
        # than unfused there (R3); an explicit trtllm is still honoured
        assert row["auto/bridges"] == (None, False, None, False, [])
        assert row["trtllm/bridges"] == ("trtllm", True, "trtllm", False, ["trtllm"])
        # fp32 on FlashInfer 0.7.2.post1: no use_fp32_lamport TypeError, fusion stays on
        assert row["fp32/trtllm"] == ("TypeError", True, True, (4.0, True, 3.0), False)
        assert row["fp32/mnnvl"] == ("TypeError", True, None, (4.0, True, 3.0), False)
        # one rank fails creation: auto moves on to trtllm on every rank; explicit mnnvl
        # declines on every rank (never another fused backend), and nothing is left. Failing
        # before FlashInfer's rendezvous, no rank enters it; failing inside, the peer waiting
        # in the handle exchange is released, not hung
        assert row["auto/rank 1 fails mnnvl"] == ("mnnvl", True, "trtllm", False, ["trtllm"])
        assert row["mnnvl/rank 1 fails mnnvl"] == ("mnnvl", False, None, True, [])
        entered = ["mnnvl", "trtllm"] if rank == 0 else ["trtllm"]
        assert row["auto/rank 1 raises in FlashInfer"] == ("mnnvl", True, "trtllm", False,
                                                           entered)
        assert row["mnnvl/rank 1 raises in FlashInfer"] == ("mnnvl", False, None, True,
                                                            entered[:-1])
        # cutedsl is SGLang's CuTe DSL fusion: the resolver says so, arfuse creates nothing
        assert row["cutedsl/gb200"] == ("cutedsl", False, None, False, [])
        # the group's ranks disagree on the flag: every rank fails, naming the values
        kind, name, message = row["ranks disagree"]
        assert (kind, name) == ("raised", "NegotiationError")
        assert "rank 0: 'auto'; rank 1: 'mnnvl'" in message
        # a workspace that holds fewer tokens than a call: that call declines, with no
        # creation and no collective on the calls after the first (SGLang syncs per call)
        assert row["over capacity"] == (True, 1, [(4.0, True, 3.0), None, None, None], 1)
        for name, freed in row.items():
            if name.endswith("/freed"):
                assert freed == (True, True), f"rank {rank}: {name}"


def gpu_paths(rank: int, world: int, topologies: dict[str, str]) -> dict[str, Any]:
    import torch.distributed as dist
    from flashinfer_standin import StandinFlashInfer

    table = Rows(dist.new_group(backend="gloo"))  # SGLang's TP cpu_group
    table.row("auto/nvswitch", "auto", topologies["nvswitch"], outcome)
    table.row("auto/nvswitch calls", "auto", topologies["nvswitch"], lambda fake: fused(rank))
    no_multicast = StandinFlashInfer(multicast=lambda r: False)
    table.row("auto/h100 nvl", "auto", topologies["h100 nvl"], outcome, no_multicast)
    table.row("mnnvl/h100 nvl", "mnnvl", topologies["h100 nvl"], outcome,
              StandinFlashInfer(multicast=lambda r: False))
    table.row("auto/bridges", "auto", topologies["bridges"], outcome)
    table.row("trtllm/bridges", "trtllm", topologies["bridges"], outcome)

    def fp32(fake: StandinFlashInfer) -> tuple[Any, ...]:
        comm = sys.modules["flashinfer.comm"]
        try:  # what SGLang's own module passes for fp32
            comm.create_allreduce_fusion_workspace(backend="trtllm", use_fp32_lamport=True)
            sglangs = "created"
        except TypeError:
            sglangs = "TypeError"
        ready = dropin.ensure_workspace_initialized(
            max_token_num=64, hidden_dim=256, use_fp32_lamport=True, dtype=torch.float32)
        manager = dropin._get_workspace_manager(True)
        return (sglangs, ready, manager.use_fp32_lamport, fused(rank, torch.float32),
                dropin.is_flashinfer_allreduce_unavailable())

    table.row("fp32/trtllm", "trtllm", topologies["nvswitch"], fp32)
    table.row("fp32/mnnvl", "mnnvl", topologies["nvswitch"], fp32)
    table.row("auto/rank 1 fails mnnvl", "auto", topologies["nvswitch"], outcome,
              faults="mnnvl.create@1=raise")
    table.row("mnnvl/rank 1 fails mnnvl", "mnnvl", topologies["nvswitch"], outcome,
              faults="mnnvl.create@1=raise")
    table.row("auto/rank 1 raises in FlashInfer", "auto", topologies["nvswitch"], outcome,
              raises_on=1)
    table.row("mnnvl/rank 1 raises in FlashInfer", "mnnvl", topologies["nvswitch"], outcome,
              raises_on=1)
    table.row("cutedsl/gb200", "cutedsl", topologies["gb200"], outcome)
    table.row("ranks disagree", "auto" if rank == 0 else "mnnvl", topologies["nvswitch"],
              outcome)

    def over_capacity(fake: StandinFlashInfer) -> tuple[Any, ...]:
        syncs = []
        real_sync = workspaces._sync_unavailable

        def counted() -> None:
            syncs.append(1)
            real_sync()

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(workspaces, "_sync_unavailable", counted)
            ready = dropin.ensure_workspace_initialized(max_token_num=64, hidden_dim=256,
                                                        dtype=BF16, token_num=4)
            calls = [fused(rank, tokens=4)]
            x = torch.ones(64, 256, dtype=BF16)
            for _ in range(3):
                _, residual_out = dropin.flashinfer_allreduce_residual_rmsnorm(
                    x, torch.ones_like(x), torch.ones(256, dtype=BF16), max_token_num=64)
                calls.append(residual_out)
        return ready, len(fake.created), calls, len(syncs)

    table.row("over capacity", "mnnvl", topologies["nvswitch"], over_capacity,
              StandinFlashInfer(buffer_scale=0.1))
    return table.rows


@pytest.mark.slow
def test_node_local_groups_in_a_two_node_launch() -> None:
    """R6 + R9 on four ranks, hosts A, A, B, B (SGLang's launch: two nodes): each node's TP
    group is one node, so trtllm and auto run on it where SGLang refuses both; a group across
    the nodes is refused as SGLang refuses multi-node. R8: a rank that never calls is named
    within the deadline (SGLang's own waits have none of their own)."""
    results = values(run_ranks(two_node_launch, 4, env={**RANK_ENV, "ARFUSE_TIMEOUT_S": "5"},
                               timeout=150))
    for rank, row in enumerate(results):
        assert row["auto/node group"] == ("mnnvl", True, "mnnvl", False, ["mnnvl"])
        assert row["trtllm/node group"] == ("trtllm", True, "trtllm", False, ["trtllm"])
        assert row["trtllm/across nodes"] == ("raised", "ValueError", dropin.TRTLLM_MULTI_NODE)
        assert row["auto/across nodes"] == ("raised", "ValueError", dropin.AUTO_MULTI_NODE)
        for name, freed in row.items():
            if name.endswith("/freed"):
                assert freed == (True, True), f"rank {rank}: {name}"
    assert results[0]["deadline"] == (1,)


def two_node_launch(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    mp = pytest.MonkeyPatch()
    host = "A" if rank < 2 else "B"
    # what detection reads on an H200 NVSwitch node (no ARFUSE_TOPOLOGY: the hosts are real)
    facts = topology_mod.LocalFacts(host=host, device="cuda", sm=90, gpu="H200", multicast=True,
                                    nvlink_all_pairs=True, fabric=False, flashinfer="0.7.2.post1")
    mp.setattr(topology_mod, "local_facts", lambda device: facts)
    node = [dist.new_group(ranks, backend="gloo") for ranks in ([0, 1], [2, 3])][rank // 2]
    across = [dist.new_group(ranks, backend="gloo") for ranks in ([0, 2], [1, 3])][rank % 2]
    table = Rows(node)
    table.row("auto/node group", "auto", "", outcome, nnodes=2)
    table.row("trtllm/node group", "trtllm", "", outcome, nnodes=2)
    table.row("trtllm/across nodes", "trtllm", "", outcome, nnodes=2, group=across)
    table.row("auto/across nodes", "auto", "", outcome, nnodes=2, group=across)
    if rank == 0:  # R8: rank 1 never asks; rank 0 is told within the deadline, naming it
        mp.setenv("ARFUSE_TIMEOUT_S", "1")

        def alone(fake: Any) -> Any:
            try:
                return dropin.resolve_flashinfer_allreduce_fusion_backend()
            except NegotiationTimeout as exc:
                return exc.silent

        table.row("deadline", "auto", "", alone)
    mp.undo()
    return {**table.rows, "deadline": table.rows.get("deadline")}


# the failing call's deadline; the peers must hear of a refusal well before it
REFUSAL_TIMEOUT_S = 12.0


def test_an_invalid_flag_on_one_rank_fails_every_rank_at_once(tmp_path: Path) -> None:
    """Rank 1's flag is no value SGLang allows: its ValueError travels in the group's exchange,
    so rank 0 raises PeerAborted at once instead of waiting out the deadline, through the
    resolver and through the layer's workspace check alike; the group stays in step, and with
    the flag right every rank resolves, creates and runs the fused calls."""
    topo = topology_file(tmp_path, "nvswitch", cut("h200-nvswitch-8", ["n0"] * 2))
    env = {**RANK_ENV, "ARFUSE_TIMEOUT_S": str(REFUSAL_TIMEOUT_S)}
    for rank, row in enumerate(values(run_ranks(invalid_flag_on_rank_1, 2, topo, env=env,
                                                timeout=150))):
        for name in ("resolver", "workspace check"):
            kind, error, message, seconds = row[name]
            assert (kind, error) == ("raised", "PeerAborted" if rank == 0 else "ValueError"), \
                (rank, name, row[name])
            assert dropin.FLAG in message and "'nccl'" in message, message
            assert seconds < REFUSAL_TIMEOUT_S / 2, (rank, name, seconds)
        assert row["after"] == ("mnnvl", True, "mnnvl", False, ["mnnvl"], (4.0, True, 3.0))
        for name, freed in row.items():
            if name.endswith("/freed"):
                assert freed == (True, True), f"rank {rank}: {name}"


def invalid_flag_on_rank_1(rank: int, world: int, topo: str) -> dict[str, Any]:
    import torch.distributed as dist

    table = Rows(dist.new_group(backend="gloo"))
    flag = "auto" if rank == 0 else "nccl"

    def timed(call: Any) -> Any:
        def body(fake: Any) -> tuple[Any, ...]:
            started = time.monotonic()
            try:
                return ("returned", repr(call()), "", time.monotonic() - started)
            except Exception as exc:
                return ("raised", type(exc).__name__, str(exc), time.monotonic() - started)
        return body

    table.row("resolver", flag, topo, timed(dropin.resolve_flashinfer_allreduce_fusion_backend))
    table.row("workspace check", flag, topo, timed(lambda: dropin.ensure_workspace_initialized(
        max_token_num=64, hidden_dim=256, dtype=BF16)))
    table.row("after", "auto", topo, lambda fake: (*outcome(fake), fused(rank)))
    return table.rows
