"""Negotiation under injected faults (R7, R8), spec checks, and the registry (R4, R5, R10)."""

from __future__ import annotations

import json

import pytest

from arfuse import faults

import ranks_negotiation
import ranks_registry
from harness import run_ranks, values

NON_FATAL = [
    f"shm.{phase}@{ranks}={mode}"
    for phase, modes in (("create", ("raise", "none", "null", "oom")),
                         ("validate", ("raise", "none", "null", "oom")),
                         ("probe", ("raise", "none", "oom")))
    for mode in modes
    for ranks in ("1", "*")
]


def test_non_fatal_faults_every_rank_ends_on_the_same_backend() -> None:
    results = values(run_ranks(ranks_negotiation.fault_sequence, 2, NON_FATAL, timeout=240))
    for i, clause in enumerate(NON_FATAL):
        per_rank = [r[i] for r in results]
        backends = {p["backend"] for p in per_rank}
        assert backends == {"torch"}, (clause, per_rank)
        assert all(p["correct"] for p in per_rank), clause
        if not clause.startswith("shm.probe"):
            assert per_rank[0]["attempts"][0].startswith("shm: failed"), per_rank[0]
    # and without faults, shm is what the group negotiates
    clean = values(run_ranks(ranks_negotiation.fault_sequence, 2, [""]))
    assert {r[0]["backend"] for r in clean} == {"shm"}


def test_a_torch_workspace_created_broken_fails_validation_on_every_rank() -> None:
    """torch.create@1=null (design 3.8: create takes every mode): the workspace succeeds
    broken and validation catches it; the injection used to be ignored."""
    env = {"ARFUSE_FAULTS": "torch.create@1=null"}
    for got in values(run_ranks(ranks_negotiation.expect_failure, 2, "torch", env=env, timeout=60)):
        assert got["error"].startswith("NegotiationError"), got
        assert "torch: failed at validate" in got["error"], got


def test_fault_on_three_ranks_names_the_failing_rank() -> None:
    results = values(run_ranks(ranks_negotiation.fault_sequence, 3, ["shm.create@2=oom"]))
    first = results[0][0]
    assert {r[0]["backend"] for r in results} == {"torch"}
    assert "rank 2: MemoryError" in first["attempts"][0]


@pytest.mark.parametrize(("clause", "backend"), [
    ("shm.create@1=hang", None), ("shm.create@1=exit", None), ("shm.validate@1=exit", None),
    ("torch.validate@1=hang", "torch"), ("torch.create@1=exit", "torch"),
    ("shm.probe@1=exit", None)])
def test_hang_or_exit_times_out_naming_the_rank(clause: str, backend: str | None) -> None:
    env = {"ARFUSE_FAULTS": clause, "ARFUSE_TIMEOUT_S": "3"}
    results = run_ranks(ranks_negotiation.expect_failure, 2, backend, env=env, timeout=60, expect=1)
    survivor = results[0].value
    assert survivor is not None, results
    assert "NegotiationTimeout" in survivor["error"], survivor
    assert "rank(s) 1" in survivor["error"]
    phase = clause.split(".")[1].split("@")[0]
    backend = clause.split(".")[0]
    assert f"backend {backend}" in survivor["error"] or phase == "probe"
    assert "timed out after 3s" in survivor["error"], survivor  # the deadline, not a hang
    if clause.endswith("exit"):
        assert results[1].exitcode == faults.EXIT_CODE


def test_rank0_exiting_in_creation_is_named_by_the_survivor() -> None:
    env = {"ARFUSE_FAULTS": "shm.create@*=exit", "ARFUSE_TIMEOUT_S": "3"}
    results = run_ranks(ranks_negotiation.create_then_report, 2, env=env, timeout=60, expect=1)
    survivor = results[1].value
    assert survivor is not None, results
    # rank 0 may die while rank 1 still reads the facts exchange, or in the shm exchange
    assert ("phase 'shm-name'" in survivor["error"] and "backend shm" in survivor["error"]) \
        or "phase 'facts'" in survivor["error"] or "phase 'open'" in survivor["error"], survivor
    assert "store stopped answering" in survivor["error"] and "rank 0" in survivor["error"]


def test_strict_explicit_backend_failure_raises_on_every_rank() -> None:
    env = {"ARFUSE_FAULTS": "shm.create@1=raise", "ARFUSE_STRICT": "1"}
    results = values(run_ranks(ranks_negotiation.expect_failure, 2, "shm", env=env))
    for r in results:
        assert "NegotiationError" in r["error"] and "ARFUSE_STRICT=1" in r["error"], r


def test_spec_mismatch_is_a_clear_error_not_a_hang() -> None:
    errors = values(run_ranks(ranks_negotiation.mismatched_spec, 2))
    for err in errors:
        assert "NegotiationError" in err and "different specs" in err and "rank 1" in err


def test_topology_file_of_two_hosts_means_hier_not_shm(tmp_path) -> None:
    """Two hosts of one rank each: shm cannot span them; auto picks hier (one rank per host)."""
    topo = tmp_path / "two-hosts.json"
    topo.write_text(json.dumps({"device": "cpu", "world_size": 2, "hosts": ["a", "b"]}))
    results = values(run_ranks(ranks_negotiation.fault_sequence, 2, [""],
                               env={"ARFUSE_TOPOLOGY": str(topo)}))
    assert {r[0]["backend"] for r in results} == {"hier"}


@pytest.mark.parametrize("file_rank", [0, 1])
def test_a_topology_file_on_one_rank_only_fails_on_every_rank(tmp_path, file_rank: int) -> None:
    """Ranks must agree on ARFUSE_TOPOLOGY whichever rank has one (a file on rank 1 only was
    ignored: every rank used the detected facts)."""
    topo = tmp_path / "two-hosts.json"
    topo.write_text(json.dumps({"device": "cpu", "world_size": 2, "hosts": ["a", "b"]}))
    for got in values(run_ranks(ranks_negotiation.topology_file_on_one_rank, 2, file_rank,
                                str(topo))):
        assert got.startswith("NegotiationError") and "topology files (ARFUSE_TOPOLOGY)" in got, got


def test_a_plan_with_nothing_to_run_fails_on_every_rank(tmp_path) -> None:
    """shm asked for, strict, on two hosts: the plan's ValueError on every rank, after the
    ranks acknowledged the facts (rank 0 hosts the store: it must not exit while a peer still
    reads them)."""
    topo = tmp_path / "two-hosts.json"
    topo.write_text(json.dumps({"device": "cpu", "world_size": 2, "hosts": ["a", "b"]}))
    results = values(run_ranks(ranks_negotiation.expect_failure, 2, "shm",
                               env={"ARFUSE_TOPOLOGY": str(topo), "ARFUSE_STRICT": "1"}))
    for got in results:
        assert got["error"].startswith("ValueError: ARFUSE_STRICT=1 and no fused backend"), got


@pytest.mark.parametrize("pure", [False, True])
def test_what_workspace_broken_advises_brings_the_group_back(pure: bool) -> None:
    """After a timeout in a shm call the ranks may have failed apart; WorkspaceBroken's advice
    (close every op of the group on every rank, then create new ones) must work, and the
    kernel's message must give the same advice as the pure-torch path's. (The torch backend's
    timeouts leave the process group itself out of step, and its message says so.)"""
    from arfuse.errors import WorkspaceBroken

    env = {"ARFUSE_SHM_PURE_TORCH": "1"} if pure else {}
    rank0, rank1 = values(run_ranks(ranks_negotiation.new_ops_after_a_broken_workspace, 2, "shm",
                                    env=env, timeout=60))
    assert rank0["first"].startswith("CallTimeout"), rank0
    assert rank0["first_again"].startswith("WorkspaceBroken"), rank0
    assert rank0["first_again"].endswith(WorkspaceBroken.ADVICE), rank0
    assert rank0["second"] == 3.0 and rank1["second"] == 3.0, (rank0, rank1)


def test_registry_reuse_growth_sharing_and_destroy() -> None:
    stories = values(run_ranks(ranks_registry.registry_story, 2))
    for story in stories:
        assert story["plain_and_quant_share"] and story["live_after_two"] == 1
        assert story["quant_ok"]
        assert story["smaller_reuses"]
        assert story["larger_is_new"] and story["larger_capacity"] == 32
        assert story["old_still_works"]
        assert story["after_growth_reuses_largest"]
        assert story["other_topology_is_new"] and story["other_topology_works"]
        assert story["promise_is_new"] and story["promise_kept"] and story["promise_works"]
        assert story["other_hidden_is_new"]
        assert story["over_capacity_result_ok"]
        assert story["over_capacity_stats"]["unfused_over_capacity"] == 1
        assert story["old_destroyed_after_last_user"]
        assert story["live_before_destroy_all"] == 2
        assert story["live_after_destroy_all"] == 0
        assert "closed" in story["closed_op_error"]


@pytest.mark.parametrize("text", ["shm.create@1", "gpu.create@1=raise", "shm.build@1=raise",
                                  "shm.create@x=raise", "shm.call@1=null", "shm.create@-1=raise"])
def test_fault_strings_are_parsed_strictly(text: str) -> None:
    with pytest.raises(ValueError, match="ARFUSE_FAULTS"):
        faults.parse(text)


def test_fault_string_grammar() -> None:
    parsed = faults.parse("shm.create@1,2=raise; mnnvl.validate@*=null")
    assert faults.mode_for(parsed, "shm", "create", 2) == "raise"
    assert faults.mode_for(parsed, "shm", "create", 0) is None
    assert faults.mode_for(parsed, "mnnvl", "validate", 7) == "null"
    assert faults.parse("") == () and faults.parse(None) == ()


def test_the_replicated_residual_promise_is_logged_with_the_workspace(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    import torch

    import arfuse

    monkeypatch.setenv("ARFUSE_LOG", "info")  # the suite runs at warning
    for promised in (True, False):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="arfuse"):
            comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=48 + promised,
                                         dtype=torch.float32, replicated_residual=promised)
        comm.close()
        using = [r.getMessage() for r in caplog.records if "using" in r.getMessage()]
        assert len(using) == 1, [r.getMessage() for r in caplog.records]
        assert ("residual promised the same on every rank" in using[0]) == promised, using


def test_ops_with_other_timeouts_do_not_share_a_workspace() -> None:
    """A workspace waits with the timeout of the op that made it: an op asking for another
    timeout gets its own (it used to reuse one that waited 60 s where it asked for 0.5)."""
    import torch

    import arfuse

    long = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=64, dtype=torch.float32,
                                 timeout_s=60.0)
    short = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                  timeout_s=0.5)
    same = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 timeout_s=0.5)
    try:
        assert short.workspace is not long.workspace
        assert short.workspace.ctx.timeout_s == 0.5 and long.workspace.ctx.timeout_s == 60.0
        assert same.workspace is short.workspace  # the same settings still share
    finally:
        for op in (long, short, same):
            op.close()


class _PeerThatAnswersThenAborts:
    """A store where, while rank 0 is between its look for the peer's value and its look for
    the peer's abort, the peer posts its value, finishes the exchange and announces a failure
    of a later step (a rank descheduled between the two looks sees exactly this)."""

    def __init__(self, phase_key: str, abort_key: str) -> None:
        self.data: dict[str, bytes] = {}
        self.phase_key, self.abort_key = phase_key, abort_key

    def set(self, key: str, value: bytes | str) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        present = all(k in self.data for k in keys)
        if keys == [self.phase_key] and not present:
            self.data[self.phase_key] = json.dumps("peer's value").encode()
            self.data[self.abort_key] = b"MemoryError: after the exchange"
        return present

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


def test_a_peer_that_answered_then_failed_counts_as_answered() -> None:
    """Rank 1 posted its value and only then failed a later step: the exchange has its value
    (no PeerAborted), as it would had rank 0 looked a moment later."""
    from arfuse.rendezvous import Channel

    store = _PeerThatAnswersThenAborts("t/n1/shm/shm-mapped/1", "t/n1/shm/abort/1")
    channel = Channel(store, "t", 0, 2)
    channel.begin("n1/shm")
    assert channel.all_gather("shm-mapped", "mine", 5.0) == ["mine", "peer's value"]
