"""The torch backend's call errors on real ranks: a peer that never calls is named after the
op's own timeout, and calls that differ across ranks fail on every rank, naming each rank's
values."""

from __future__ import annotations

import pytest

import ranks_call_pairing
from harness import run_ranks, values


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


def test_a_late_peer_within_the_timeout_is_waited_for() -> None:
    """A peer late by 2.5 s, well within the timeout, is waited for: nothing in the call's
    wait gives up before its deadline."""
    got = values(run_ranks(ranks_call_pairing.torch_peer_late, 2, 2.5, timeout=60))
    assert [g["type"] for g in got] == ["", ""], got
    assert [g["value"] for g in got] == [3.0, 3.0], got


@pytest.mark.parametrize("victim", [1, 0])
def test_torch_backend_names_a_killed_peer_at_once_not_a_timeout(victim: int) -> None:
    """A peer SIGKILLed during a call: gloo sees its connection close; the survivor says so
    (the peer died, named by rank), well before the op's 20 s, instead of 'timed out'. Rank 0
    hosts the store (killed, it is named as the only peer)."""
    results = run_ranks(ranks_call_pairing.torch_peer_killed_mid_call, 2, 20.0, victim,
                        timeout=90, expect=1)
    survivor = results[1 - victim].value
    assert survivor is not None, results
    assert survivor["type"] == "CallTimeout", survivor  # the class a dead peer raises on shm
    assert "timed out" not in survivor["error"], survivor
    assert f"connection to rank(s) {victim} was" in survivor["error"], survivor
    assert "was closed or reset" in survivor["error"], survivor
    assert "died" in survivor["error"] and "backend torch" in survivor["error"], survivor
    assert survivor["seconds"] < 10, survivor
    assert survivor["second"]["type"] == "WorkspaceBroken", survivor


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
