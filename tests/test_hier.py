"""The hierarchical backend on one machine: four gloo ranks that a topology file places on two
hosts (2 x 2), so ``auto`` picks ``hier`` and every step runs as across hosts (two shm
segments, one per host, and the gloo subgroups between them). Real hosts: test_two_hosts.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arfuse.backends.hier.workspace import VERDICT_BYTES
from arfuse.backends.torch.workspace import SIGNATURE_BYTES

import ranks_hier
from harness import run_ranks, values

TOPOLOGY = str(Path(__file__).resolve().parent.parent / "examples" / "topologies"
               / "cpu-2hosts.json")
ENV = {"ARFUSE_TOPOLOGY": TOPOLOGY, "ARFUSE_LOG": "warning"}


def test_auto_picks_hier_every_pattern_within_tolerance_and_bit_identical() -> None:
    _check_numerics(4, [1, 3, 64, 200], ENV, "2 hosts x 2 ranks")


def _check_numerics(world: int, tokens: list[int], env: dict[str, str], layout: str) -> None:
    """``auto`` picks hier for ``layout``; every pattern within tolerance of the reference,
    out in the documented sum order, the same bytes on every rank, nothing over capacity."""
    got = values(run_ranks(ranks_hier.numerics, world, ["fp32", "bf16"], tokens, 64, env=env,
                           timeout=300))
    assert {g["backend"] for g in got} == {"hier"}, got[0]["explain"]
    assert layout in got[0]["explain"]
    for g in got:
        assert g["worst"] <= 1.0, g["worst"]
        assert g["order_exact"], "out differs from the documented sum order's"
        assert g["digests"] == got[0]["digests"]
        assert g["stats"]["unfused_over_capacity"] == 0, g["stats"]


def test_moe_patterns_through_hier() -> None:
    got = values(run_ranks(ranks_hier.moe, 4, 64, env=ENV, timeout=200))
    assert {g["backend"] for g in got} == {"hier"}
    assert all(g["worst"] <= 1.0 for g in got), got
    assert len({g["out"] for g in got}) == 1


@pytest.mark.parametrize("kind", ["tokens", "pattern", "capacity"])
def test_a_mismatched_call_raises_on_every_rank_of_both_hosts(kind: str) -> None:
    got = values(run_ranks(ranks_hier.mismatched, 4, kind, env=ENV, timeout=200))
    for rank, g in enumerate(got):
        assert g["backend"] == "hier"
        assert g["error"], (rank, kind)
        assert g["after"] == 6.0  # 0 + 1 + 2 + 3: the workspace stays usable


@pytest.mark.parametrize(("world", "head", "wire_bytes", "finished_apart"), [
    (4, VERDICT_BYTES, 4, 0), (2, SIGNATURE_BYTES, 2, 6)])
def test_a_steady_call_crosses_between_hosts_once(tmp_path: Path, world: int, head: int,
                                                  wire_bytes: int, finished_apart: int) -> None:
    """The data rides with the verdicts when its size is the last call's (the creation's
    check was one token): a size that changes costs a second exchange, once. 2 x 2: each rank
    sends its half of the host's fp32 partial sums after a 40-byte verdict, and the second
    host step's kernel call runs the epilogue; 2 x 1: the torch backend's call on the link,
    each rank's bf16 rows as they are (its host's sum exactly) after its signature, finished by
    the torch backend's sum and epilogue."""
    env = ENV if world == 4 else {**ENV, "ARFUSE_TOPOLOGY": _one_rank_per_host(tmp_path)}
    tokens = [4, 4, 4, 2, 2, 1]
    got = values(run_ranks(ranks_hier.crossings, world, tokens, env=env, timeout=200))
    local = world // 2
    for g in got:
        assert g["backend"] == "hier"
        assert g["counts"] == [2, 1, 1, 2, 1, 2], g["counts"]
        assert g["values"] == [world * (world + 1) / 2 + 1] * 6, g["values"]
        steady = [b for b, c in zip(g["bytes"], g["counts"], strict=True) if c == 1]
        assert steady == [head + t * 64 * wire_bytes // local
                          for t, c in zip(tokens, g["counts"], strict=True) if c == 1], g
        assert g["finished_apart"] == finished_apart, g


def test_one_rank_per_host_every_pattern_in_the_documented_order(tmp_path: Path) -> None:
    env = {**ENV, "ARFUSE_TOPOLOGY": _one_rank_per_host(tmp_path)}
    _check_numerics(2, [1, 3, 64], env, "2 hosts x 1 ranks")


def _one_rank_per_host(tmp_path: Path) -> str:
    topology = tmp_path / "two-hosts-one-rank-each.json"
    topology.write_text(json.dumps({"device": "cpu", "world_size": 2, "hosts": ["a", "b"]}))
    return str(topology)


@pytest.mark.parametrize("victim", [1, 3])
def test_a_killed_rank_makes_every_rank_on_both_hosts_raise(victim: int) -> None:
    """Every other rank raises within the timeout; a rank that names who is silent names the
    victim by its group rank (the host step's kernel numbers its ranks by local index: its
    words come with the map), never a live rank; the next call is ``WorkspaceBroken``."""
    results = run_ranks(ranks_hier.killed, 4, victim, env=ENV, timeout=120, expect=3)
    for r in results:
        if r.rank == victim:
            continue
        assert r.ok, r.error
        assert r.value["error"], r.value
        assert r.value["seconds"] < 40, r.value  # within the timeout (10 s), with room
        assert set(r.value["silent"]) <= {victim}, r.value
        if "numbers its ranks by local index" in r.value["error"]:
            assert f"{victim % 2} is rank {victim}" in r.value["error"], r.value
        assert r.value["next"] == "WorkspaceBroken", r.value


def test_a_host_that_cannot_create_makes_every_rank_fall_back_together() -> None:
    env = {**ENV, "ARFUSE_FAULTS": "hier.create@2,3=raise"}
    got = values(run_ranks(ranks_hier.negotiated, 4, env=env, timeout=200))
    for g in got:
        assert g["backend"] == "torch", g
        assert g["attempts"][0].startswith("hier: failed"), g
        assert g["value"] == 10.0


def test_a_tensor_parallel_llama_through_hier_gives_the_whole_models_tokens() -> None:
    """tp_models' Llama split over the 4 ranks (one head each), compiled with the pass: the op
    the fused calls make is ``auto``'s (hier), every chain runs fused, and the greedy tokens
    are those of the whole model in one process, the logits' bits the same on every rank."""
    pytest.importorskip("transformers")
    import ranks_compile
    import tp_models

    steps = 3
    found = values(run_ranks(ranks_compile.architectures, 4, 1, steps, ("llama",),
                             tp_models.FOUR_RANKS, env=ENV, timeout=300))
    ranks = [f["llama"] for f in found]
    for mine in ranks:
        assert mine["backends"] == ["hier"], mine
        assert mine["fused"] == {"residual + RMSNorm": 2} and mine["left"] == {}, mine
        # two teacher-forced forwards of one layer's two chains, every one fused by the op
        assert mine["calls"] == mine["counted_fused"] == 2 * mine["reduces"] == 4, mine
        assert mine["tokens"] == mine["reference"] and len(mine["tokens"]) == steps, mine
        assert mine["again"], mine
        assert mine["bits"] == ranks[0]["bits"], "the ranks' logits differ"
