"""Whether a two-rank exchange goes whole or in pieces (``collective.PieceChoice``): learnt from
the calls' own timings per size class, and followed alike by both ranks of a real gloo group
(rank 0's proposal rides ahead of the exchange), on the torch backend and on hier's link."""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from arfuse.collective import PIECE_BYTES, RIDE_MAX_BYTES, PieceChoice

import ranks_exchange
from harness import run_ranks, values

WHOLE, PIECES = PieceChoice.WHOLE, PieceChoice.PIECES
LARGE = 3 * PIECE_BYTES


def test_an_exchange_of_at_most_a_piece_is_always_whole() -> None:
    choice = PieceChoice("a link")
    for _ in range(10):
        assert choice.propose(PIECE_BYTES) == WHOLE
        choice.record(PIECE_BYTES, PIECES, 0.0)  # ignored: nothing to learn
    assert choice.chosen() == {}


def test_a_disabled_choice_never_proposes_pieces() -> None:
    choice = PieceChoice("NCCL", enabled=False)
    for _ in range(2 * PieceChoice.SAMPLES + 2):
        assert choice.propose(LARGE) == WHOLE
        choice.record(LARGE, WHOLE, 1.0)
    assert choice.chosen() == {}


@given(st.lists(st.floats(min_value=1e-6, max_value=1.0), min_size=2 * PieceChoice.RUN,
                max_size=2 * PieceChoice.RUN),
       st.integers(min_value=PIECE_BYTES + 1, max_value=1 << 32))
def test_a_run_of_each_way_then_the_lower_mean(times: list[float], nbytes: int) -> None:
    """Whatever the timings: a size class's first calls go a run whole, then a run in pieces;
    the first call of each run does not count; then every call takes the way whose mean
    time was lower (whole on a tie), and sizes of another class start learning afresh."""
    choice = PieceChoice("a link")
    seen: dict[int, list[float]] = {WHOLE: [], PIECES: []}
    for i, seconds in enumerate(times):
        way = choice.propose(nbytes)
        assert way == (WHOLE if i < PieceChoice.RUN else PIECES)
        choice.record(nbytes, way, seconds)
        if i % PieceChoice.RUN:
            seen[way].append(seconds)
    assert all(len(t) == PieceChoice.SAMPLES for t in seen.values())
    better = (PIECES if statistics.fmean(seen[PIECES]) < statistics.fmean(seen[WHOLE])
              else WHOLE)
    assert all(choice.propose(nbytes) == better for _ in range(3))
    choice.record(nbytes, 1 - better, 0.0)  # a class once chosen stays chosen
    assert choice.propose(nbytes) == better
    assert choice.chosen() == {nbytes.bit_length(): better}
    assert choice.propose(2 * nbytes) == WHOLE  # another class: learning, whole first


N = PieceChoice.SAMPLES


@pytest.mark.parametrize(("whole", "pieces", "kept"), [
    # pieces slow only right after the whole run (the link recovering): pieces
    ([2.0] * (N + 1), [9.0] + [1.0] * N, PIECES),
    # one message fast in most calls (a link idle before them), twice as slow in the
    # others: its median would keep it
    ([3.0] + [1.0] * (N - 2) + [3.0] * 2, [1.1] * (N + 1), PIECES),
    # pieces a little slower in every call (loopback): whole
    ([1.0] * (N + 1), [1.2] + [1.1] * N, WHOLE)])
def test_the_kept_way_is_the_faster_on_average(whole: list[float], pieces: list[float],
                                              kept: int) -> None:
    choice = PieceChoice("a link")
    for seconds in whole + pieces:
        choice.record(LARGE, choice.propose(LARGE), seconds)
    assert choice.propose(LARGE) == kept


def test_the_choice_is_logged_once_per_size_class(caplog: pytest.LogCaptureFixture) -> None:
    choice = PieceChoice("the link between hosts")
    with caplog.at_level(logging.INFO, logger="arfuse"):
        for i in range(4 * PieceChoice.RUN):
            way = choice.propose(LARGE)
            choice.record(LARGE, way, 2.0 if way == WHOLE else 1.0 + i * 1e-3)
    lines = [r.getMessage() for r in caplog.records if "go in pieces" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    low = 1 << (LARGE.bit_length() - 1)  # the size class: [low, 2 low)
    assert f"{low / 2**20:g}-{2 * low / 2**20:g} MiB over the link between hosts" in lines[0], \
        lines[0]


@pytest.mark.parametrize(("backend", "hosts", "tokens"), [
    ("torch", None, 128), (None, ["a", "b"], 128), ("torch", None, 32)])
def test_both_ranks_follow_rank_zeros_way(tmp_path: Path, backend: str | None,
                                          hosts: list[str] | None, tokens: int) -> None:
    """Rows of 2 MiB (128 tokens) per rank on two real gloo ranks, rank 1 proposing the
    opposite of its own choice on every call: both exchange alike on every call (a mismatch
    would hang or abort gloo), a run of each way while they learn, then the way rank 0 kept;
    every result exact. The torch backend, and hier with one rank on each of two hosts (a
    topology file). Rows of 512 KiB (32 tokens) ride with the signature from the second call:
    that message goes the way rank 0 proposed in the call before, so the runs start a call
    later."""
    env = {"ARFUSE_LOG": "warning"}
    if hosts is not None:
        topology = tmp_path / "two-hosts.json"
        topology.write_text(json.dumps({"device": "cpu", "world_size": 2, "hosts": hosts}))
        env["ARFUSE_TOPOLOGY"] = str(topology)
    calls = 2 * PieceChoice.RUN + 3
    got = values(run_ranks(ranks_exchange.ways_per_call, 2, backend, calls, tokens, True,
                           env=env, timeout=200))
    assert [g["backend"] for g in got] == [backend or "hier"] * 2
    assert got[0]["ways"] == got[1]["ways"], got
    ways = [call[-1] for call in got[0]["ways"]]  # the rows' exchange, or the riding message
    rows = tokens * 4096 * 4
    later = 1 if rows <= RIDE_MAX_BYTES else 0
    learning = 2 * PieceChoice.RUN + later
    assert ways[:learning] == (["whole"] * (PieceChoice.RUN + later)
                               + ["pieces"] * PieceChoice.RUN), ways
    kept = ["whole", "pieces"][got[0]["chosen"][rows.bit_length()]]
    assert ways[learning:] == [kept] * (calls - learning), (ways, got[0]["chosen"])
    assert all(all(g["exact"]) for g in got), got
