"""Ranks that call the shm op with different arguments (R11): every rank raises
``MismatchedCall`` naming the ranks and their values, none returns data or waits for blocks the
others never publish, and the group stays in step: every rank stops at the same point of the
same call, before reading a peer's data, so the next (matching) call is right. Real ranks
over gloo, one-shot and two-shot, 2 and 3 ranks, the input-in-slot path and the pure-torch path.
"""

from __future__ import annotations

from typing import Any

import pytest

import ranks_call_pairing
from harness import run_ranks, values

# (tokens, pattern, quant) of rank 0, then of every other rank
CASES: list[dict[str, Any]] = [
    {"name": "tokens 1 vs 2", "ranks": [(1, "plain", None), (2, "plain", None)],
     "differ": "tokens"},
    {"name": "tokens 3 vs 5", "ranks": [(3, "norm", None), (5, "norm", None)],
     "differ": "tokens"},
    {"name": "tokens 8 vs 1", "ranks": [(8, "residual", None), (1, "residual", None)],
     "differ": "tokens"},
    {"name": "tokens 16 vs 40", "ranks": [(16, "plain", None), (40, "plain", None)],
     "differ": "tokens"},
    {"name": "tokens 16 vs 40 in the slot", "in_slot": True,
     "ranks": [(16, "residual", None), (40, "residual", None)], "differ": "tokens"},
    {"name": "tokens 0 vs 3", "ranks": [(0, "plain", None), (3, "plain", None)],
     "differ": "tokens"},
    {"name": "residual vs none", "ranks": [(4, "residual", None), (4, "norm", None)],
     "differ": "pattern"},
    {"name": "fp8 vs none", "spec_quant": "fp8",
     "ranks": [(4, "norm", "fp8"), (4, "norm", None)], "differ": "quant"},
]

PATTERN_NAMES = {"plain": "plain", "norm": "norm", "residual": "norm+residual"}


def expected_values(case: dict[str, Any], rank: int) -> str:
    tokens, pattern, quant = case["ranks"][min(rank, len(case["ranks"]) - 1)]
    return (f"rank {rank}: tokens={tokens} dtype=fp32 hidden=4096 "
            f"pattern={PATTERN_NAMES[pattern]} quant={quant or 'none'}")


def check(reports: list[list[dict[str, Any]]], world: int, path: str) -> None:
    for rank, report in enumerate(reports):
        assert len(report) == len(CASES)
        for case, entry in zip(CASES, report, strict=True):
            assert entry["path"] == path, (case["name"], entry)
            error = entry["error"]
            assert error.startswith("MismatchedCall:"), (case["name"], rank, error)
            assert f"they differ in {case['differ']}" in error, (case["name"], error)
            for other in range(world):  # every rank, named with its values
                assert expected_values(case, other) in error, (case["name"], other, error)
            assert entry["after"] == "ok", (case["name"], entry)  # still in step, correct
    # every rank says the same
    for case_index in range(len(CASES)):
        assert len({r[case_index]["error"] for r in reports}) == 1


@pytest.mark.parametrize(("world", "mode"), [(2, "oneshot"), (2, "twoshot"), (3, "oneshot"),
                                             (3, "twoshot")])
def test_every_rank_raises_mismatched_call(world: int, mode: str) -> None:
    reports = values(run_ranks(ranks_call_pairing.mismatched_calls, world, mode, CASES, timeout=90))
    check(reports, world, "c++")


def test_mismatched_call_when_the_ranks_pick_different_modes() -> None:
    """Automatic mode: 1 token is one-shot, 40 tokens of 16 KiB rows two-shot."""
    cases = [{"name": "1 vs 40", "ranks": [(1, "plain", None), (40, "plain", None)]}]
    reports = values(run_ranks(ranks_call_pairing.mismatched_calls, 2, None, cases, timeout=60))
    for report in reports:
        assert report[0]["error"].startswith("MismatchedCall:"), report
        assert "rank 0: tokens=1 " in report[0]["error"]
        assert "rank 1: tokens=40 " in report[0]["error"]
        assert report[0]["after"] == "ok", report


def test_pure_torch_path_raises_mismatched_call_too() -> None:
    reports = values(run_ranks(ranks_call_pairing.mismatched_calls, 2, None, CASES, timeout=90,
                               env={"ARFUSE_SHM_PURE_TORCH": "1"}))
    check(reports, 2, "pure-torch")


@pytest.mark.parametrize("env", [{}, {"ARFUSE_SHM_PURE_TORCH": "1"}])
def test_a_call_over_capacity_announced_meets_the_group(env: dict[str, str]) -> None:
    """``ShmWorkspace.announce``: what a call that runs unfused (over capacity) does on the shm
    group first, so that tokens that differ across the capacity are a MismatchedCall too."""
    reports = values(run_ranks(ranks_call_pairing.announce_across_capacity, 2, env=env, timeout=60))
    for rank, report in enumerate(reports):
        assert report["path"] == ("pure-torch" if env else "c++")
        assert report["after_same"] is True, report
        assert report["error"].startswith("MismatchedCall:"), (rank, report)
        assert "rank 0: tokens=4 " in report["error"] and "rank 1: tokens=20 " in report["error"]


@pytest.mark.parametrize("case,message", [("dtype", "x has dtype torch.float64"),
                                          ("eps", "eps"), ("out", "out")])
@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_a_plain_call_one_rank_refuses_fails_its_peers_at_once(backend: str, case: str,
                                                                message: str) -> None:
    """An argument of a plain call that only one rank's checks refuse: that rank raises the
    ValueError, its peers MismatchedCall at once (a refusal's signature, not a timeout), and
    the next good call works on every rank."""
    results = values(run_ranks(ranks_call_pairing.one_rank_refuses_a_plain_call, 3, backend,
                               case, timeout=90))
    refusing = results[1][0]
    assert refusing["type"] in ("ValueError", "TypeError"), refusing
    assert message in refusing["error"], refusing
    for peer in (results[0][0], results[2][0]):
        assert peer["type"] == "MismatchedCall", peer
        assert "top_k=0" in peer["error"], peer  # the refusal's signature (fan-in 0)
        assert peer["seconds"] < 5, peer  # the call's timeout is 10 s
    assert [r[1]["type"] for r in results] == ["", "", ""], (backend, results)
