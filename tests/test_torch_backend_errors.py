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
