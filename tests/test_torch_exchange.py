"""The torch backend's exchange on real gloo ranks: collectives and bytes per call against a
ring all-reduce's (docs/design.md 4, "torch"), the signature riding with rows of the last
agreed size, and calls that differ after a run of matching ones failing on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from arfuse.backends.torch.workspace import SIGNATURE_BYTES
from arfuse.collective import RIDE_MAX_BYTES

import ranks_exchange
from harness import run_ranks, values

TOKENS = 16
TWO_HOSTS = Path(__file__).parent.parent / "examples" / "topologies" / "cpu-2hosts.json"


@pytest.mark.parametrize("world", [2, 4, 8])
def test_bytes_and_collectives_per_call_are_a_rings(world: int) -> None:
    """A decode-like run of one size: the first call sends its signature, then its rows; the
    calls after it send both at once. Per call, a rank sends at most a ring all-reduce's
    bytes, 2 (W - 1) / W of the rows, and a signature and a share's padding per peer."""
    got = values(run_ranks(ranks_exchange.traffic_per_call, world, [TOKENS] * 4, timeout=120))
    rows = TOKENS * ranks_exchange.HIDDEN * 4
    ring = 2 * (world - 1) * rows // world
    steady = 1 if world == 2 else 2
    for rank, calls in enumerate(got):
        assert all(call["exact"] for call in calls), (rank, calls)
        assert calls[0]["collectives"] == steady + 1, (rank, calls)
        for call in calls[1:]:
            assert call["collectives"] == steady, (rank, calls)
            assert call["bytes"] <= ring + (world - 1) * (SIGNATURE_BYTES + 8), (rank, calls)
            assert call["bytes"] >= ring, (rank, calls)  # the count counts


@pytest.mark.parametrize("over", [0, 1])
def test_rows_at_and_over_the_riding_limit(over: int) -> None:
    """Rows over ``RIDE_MAX_BYTES`` never ride (they go uncopied): every call sends the
    signature, then the rows (whole for the first calls while the group learns whether
    pieces are faster: ``collective.PieceChoice``), two collectives a call. Rows of the limit
    ride from the second call, one collective: the message goes the way rank 0 proposed for
    rows of its size in the call before (whole, while the group learns). A ring's bytes."""
    hidden = 4096
    tokens = RIDE_MAX_BYTES // (hidden * 4) + over
    got = values(run_ranks(ranks_exchange.traffic_per_call, 2, [tokens] * 3, hidden,
                           timeout=120))
    rows = tokens * hidden * 4
    for calls in got:
        assert all(call["exact"] for call in calls), calls
        assert [call["collectives"] for call in calls] == ([2, 2, 2] if over else [2, 1, 1]), calls
        assert all(call["bytes"] <= rows + SIGNATURE_BYTES for call in calls), calls
        assert calls[1]["bytes"] == rows + SIGNATURE_BYTES, calls


@pytest.mark.parametrize("world", [2, 3])
def test_sizes_that_change_cost_one_more_exchange(world: int) -> None:
    """Tokens 4, 4, 4, 2, 2, 1: a call of a new size exchanges its signature first."""
    got = values(run_ranks(ranks_exchange.traffic_per_call, world, [4, 4, 4, 2, 2, 1],
                           timeout=120))
    steady = 1 if world == 2 else 2
    for calls in got:
        assert all(call["exact"] for call in calls), calls
        assert [call["collectives"] - steady for call in calls] == [1, 0, 0, 1, 0, 1], calls


@pytest.mark.parametrize(("world", "tokens"), [
    # rank 0's call rides (the agreed size), rank 1's has another size
    (2, [[4, 4], [4, 4], [4, 2], [4, 4]]),
    # the other way round, and a call over the riding limit against one under it
    (2, [[4, 4], [2, 4], [9000, 4], [4, 4]]),
    (3, [[3, 3, 3], [3, 3, 5], [3, 3, 3], [9000, 9000, 9000]]),
])
def test_calls_that_differ_after_matching_ones_fail_on_every_rank(
        world: int, tokens: list[list[int]]) -> None:
    """Whatever sizes the ranks' calls have, every rank raises ``MismatchedCall`` at the same
    call (no collective of mismatched sizes, which gloo would abort on), and the calls after
    it that match give the right sum."""
    got = values(run_ranks(ranks_exchange.differ_after_matching, world, tokens, timeout=120))
    expected = ["ok" if len(set(call)) == 1 else "MismatchedCall" for call in tokens]
    assert got == [expected] * world, got


@pytest.mark.parametrize(("world", "backend", "env"), [
    (2, "torch", {}), (4, "torch", {}),
    (4, None, {"ARFUSE_TOPOLOGY": str(TWO_HOSTS), "ARFUSE_LOG": "warning"})])
def test_ops_called_in_different_orders_fail_on_every_rank(
        world: int, backend: str | None, env: dict[str, str]) -> None:
    """Ops of one group whose last calls had other sizes, called in different orders by half
    the ranks each: every rank raises ``MismatchedCall`` (their first messages have one size,
    the group's, so no rank dies of a collective of mismatched sizes), and matching calls
    after it give the sum. On hier (2 hosts x 2 ranks by topology file) too."""
    got = values(run_ranks(ranks_exchange.ops_in_different_orders, world, backend, env=env,
                           timeout=200))
    for g in got:
        assert g["backends"] == [backend or "hier"], g
        assert g["first"] == ["ok"] * 3, g
        assert g["crossed"] == ["MismatchedCall"] * 2, g
        assert g["after"] == ["ok"] * 2, g
