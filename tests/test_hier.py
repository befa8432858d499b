"""The hierarchical backend on one machine: four gloo ranks that a topology file places on two
hosts (2 x 2), so ``auto`` picks ``hier`` and every step runs as across hosts (two shm
segments, one per host, and the gloo subgroups between them). Real hosts: test_two_hosts.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arfuse.backends.hier.link import VERDICT_BYTES
from arfuse.backends.torch.workspace import SIGNATURE_BYTES

import ranks_hier
from harness import run_ranks, values

TOPOLOGY = str(Path(__file__).resolve().parent.parent / "examples" / "topologies"
               / "cpu-2hosts.json")
ENV = {"ARFUSE_TOPOLOGY": TOPOLOGY, "ARFUSE_LOG": "warning"}


# host partials of up to 1 KiB (hidden 64: 4 tokens) cross on each host's first rank alone,
# larger ones on every rank: the tests' sizes take both ways, and turn from one to the other
BOTH_WAYS = 1024
# chunks over 12 KiB cross in halves at bf16: 64 tokens on the first rank alone (16 KiB, after
# 3 tokens), 200 on every rank (25 KiB each); fp32's go whole
HALVES_OVER = 12 << 10


def test_auto_picks_hier_every_pattern_within_tolerance_and_bit_identical() -> None:
    _check_numerics(4, [1, 3, 64, 200], ENV, "2 hosts x 2 ranks", BOTH_WAYS, HALVES_OVER)


def _check_numerics(world: int, tokens: list[int], env: dict[str, str], layout: str,
                    alone_max: int | None = None, halves_min: int | None = None) -> None:
    """``auto`` picks hier for ``layout``; every pattern within tolerance of the reference,
    out in the documented sum order, the same bytes on every rank, nothing over capacity."""
    got = values(run_ranks(ranks_hier.numerics, world, ["fp32", "bf16"], tokens, 64, alone_max,
                           halves_min, env=env, timeout=300))
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


@pytest.mark.parametrize(("kind", "alone_max"), [
    ("tokens", None), ("pattern", None), ("capacity", None), ("host-tokens", None),
    ("host-capacity", None), ("tokens", 0), ("host-tokens", 0), ("host-capacity", 0)])
def test_a_mismatched_call_raises_on_every_rank_of_both_hosts(kind: str,
                                                              alone_max: int | None) -> None:
    """Few tokens cross on each host's first rank alone (``None``: the library's limit), any
    number on every rank (0)."""
    got = values(run_ranks(ranks_hier.mismatched, 4, kind, alone_max, env=ENV, timeout=200))
    for rank, g in enumerate(got):
        assert g["backend"] == "hier"
        assert g["error"], (rank, kind)
        assert g["after"] == 6.0  # 0 + 1 + 2 + 3: the workspace stays usable


@pytest.mark.parametrize(("world", "head", "wire_bytes", "finished_apart", "alone_max"), [
    (4, VERDICT_BYTES, 4, 0, None), (4, VERDICT_BYTES, 4, 0, 0), (2, SIGNATURE_BYTES, 2, 6, None)])
def test_a_steady_call_crosses_between_hosts_once(tmp_path: Path, world: int, head: int,
                                                  wire_bytes: int, finished_apart: int,
                                                  alone_max: int | None) -> None:
    """The data rides with the verdicts when its size is the last call's (the creation's
    check was one token): a size that changes costs a second exchange, once. 2 x 2, few
    tokens: each host's first rank sends the host's whole fp32 partial sums after a 40-byte
    verdict, its other rank nothing, and the second host step's kernel call runs the
    epilogue; 2 x 2 crossing on every rank (``alone_max`` 0): each rank its half after its
    verdict; 2 x 1: the torch backend's call on the link, each rank's bf16 rows as they are
    (its host's sum exactly) after its signature, finished by the torch backend's sum and
    epilogue."""
    env = ENV if world == 4 else {**ENV, "ARFUSE_TOPOLOGY": _one_rank_per_host(tmp_path)}
    hosts = json.loads(Path(env["ARFUSE_TOPOLOGY"]).read_text())["hosts"]
    tokens = [4, 4, 4, 2, 2, 1]
    got = values(run_ranks(ranks_hier.crossings, world, tokens, alone_max, env=env,
                           timeout=200))
    share = 1 if alone_max is None else world // 2  # of the host's partial, per crossing rank
    for rank, g in enumerate(got):
        assert g["backend"] == "hier"
        assert g["values"] == [world * (world + 1) / 2 + 1] * 6, g["values"]
        assert g["finished_apart"] == finished_apart, g
        if alone_max is None and hosts.index(hosts[rank]) != rank:  # not its host's first
            assert g["counts"] == [0] * 6 and g["bytes"] == [0] * 6, (rank, g)
            continue
        assert g["counts"] == [2, 1, 1, 2, 1, 2], (rank, g["counts"])
        steady = [b for b, c in zip(g["bytes"], g["counts"], strict=True) if c == 1]
        assert steady == [head + t * 64 * wire_bytes // share
                          for t, c in zip(tokens, g["counts"], strict=True) if c == 1], g


def test_a_large_16_bit_chunk_crosses_a_rings_bytes_in_halves() -> None:
    """2 x 2, every rank crossing, every chunk in halves (over 0 bytes): after its verdict
    (nothing rides), a rank sends its host's fp32 partial of the other host's half of its
    chunk, then its own half finished in bf16: 3/4 of the whole fp32 chunk's bytes, so the two
    local indices together cross a ring all-reduce's bytes each way (``1.5 T D`` bf16
    elements, ``docs/design.md`` 4), and every rank gets the sum."""
    tokens = [4, 4, 2]
    got = values(run_ranks(ranks_hier.crossings, 4, tokens, 0, 0, env=ENV, timeout=200))
    for rank, g in enumerate(got):
        assert g["values"] == [11.0] * 3, (rank, g["values"])
        assert g["finished_apart"] == 0, g
        assert g["counts"] == [3, 3, 3], (rank, g["counts"])
        half = [t * 64 // 4 for t in tokens]  # of this rank's chunk (1/2 of the host's rows)
        assert g["bytes"] == [VERDICT_BYTES + h * 4 + h * 2 for h in half], (rank, g)
        ring = [3 * t * 64 for t in tokens]  # bf16 bytes a ring sends over each edge that crosses
        assert [2 * (b - VERDICT_BYTES) for b in g["bytes"]] == ring


def test_one_rank_per_host_every_pattern_in_the_documented_order(tmp_path: Path) -> None:
    env = {**ENV, "ARFUSE_TOPOLOGY": _one_rank_per_host(tmp_path)}
    _check_numerics(2, [1, 3, 64], env, "2 hosts x 1 ranks")


def _one_rank_per_host(tmp_path: Path) -> str:
    topology = tmp_path / "two-hosts-one-rank-each.json"
    topology.write_text(json.dumps({"device": "cpu", "world_size": 2, "hosts": ["a", "b"]}))
    return str(topology)


@pytest.mark.parametrize(("victim", "alone_max"), [(0, None), (1, None), (2, None), (3, None),
                                                 (1, 0), (3, 0)])
def test_a_killed_rank_makes_every_rank_on_both_hosts_raise(victim: int,
                                                            alone_max: int | None) -> None:
    """Every other rank raises within the timeout; a rank that names who is silent names the
    victim by its group rank (the host step's kernel numbers its ranks by local index: its
    words come with the map), never a live rank; the next call is ``WorkspaceBroken``."""
    results = run_ranks(ranks_hier.killed, 4, victim, alone_max, env=ENV, timeout=120,
                        expect=3)
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


@pytest.mark.parametrize("alone_max", [None, 0])
def test_calls_over_capacity_between_calls_under_it(alone_max: int | None) -> None:
    got = values(run_ranks(ranks_hier.over_capacity, 4, alone_max, env=ENV, timeout=200))
    for g in got:
        assert g["backend"] == "hier"
        assert g["values"] == [11.0] * 6, g
        assert g["stats"]["unfused_over_capacity"] == 3, g["stats"]


def test_a_first_ranks_link_down_makes_every_rank_on_both_hosts_raise() -> None:
    """Few tokens cross on each host's first rank alone, the others wait in the host's gather:
    rank 0's exchange between hosts fails, rank 2's times out waiting for it; each stops its
    host's other rank, which raises what its first rank raised (or, where its own deadline,
    as long, came first, names that rank's exchange as what may have held it)."""
    got = values(run_ranks(ranks_hier.first_link_down, 4, env=ENV, timeout=150))
    for rank, g in enumerate(got):
        assert g["error"].startswith("CallTimeout"), (rank, g)
        assert g["seconds"] < 60, (rank, g)  # within the timeouts (10 s each), with room
        assert g["next"] == "WorkspaceBroken", (rank, g)
    for rank in (1, 3):
        assert f"rank {rank - 1}, the first of cpu{rank // 2}, crosses this call for its " \
            "host" in got[rank]["error"], got[rank]
    assert "rank 0" in got[2]["error"], got[2]


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
