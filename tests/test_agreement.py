"""What the ranks of a group must agree on, and what happens when they do not: every rank
raises together, at once, and the group stays usable."""

from __future__ import annotations

from typing import Any

import pytest

import ranks_agreement
from harness import run_ranks, values

BAD_LOCAL = [
    ({"hidden_dim": 0}, {}, "ValueError", "hidden=0"),
    ({}, {"ARFUSE_BACKEND": "bogus"}, "ValueError", "ARFUSE_BACKEND='bogus'"),
    ({}, {"ARFUSE_FAULTS": "shm.nowhere@1=raise"}, "ValueError", "ARFUSE_FAULTS clause"),
    ({}, {"ARFUSE_TIMEOUT_S": "-1"}, "ValueError", "ARFUSE_TIMEOUT_S=-1"),
    ({"device": "tpu"}, {}, "ValueError", "device='tpu'"),
]


@pytest.mark.parametrize(("bad", "env", "kind", "text"), BAD_LOCAL,
                         ids=["hidden", "backend-env", "faults-env", "timeout-env", "device"])
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_local_error_on_one_rank_fails_every_rank_at_once_and_leaves_the_group_usable(
        bad: dict[str, Any], env: dict[str, str], kind: str, text: str, bad_rank: int) -> None:
    """The rank with the bad argument or setting raises its own error; the other learns it at
    once (``PeerAborted`` naming that rank and why, not a ``NegotiationTimeout`` after its
    30 s); every later op of the group, before and after ``destroy_all``, works."""
    results = values(run_ranks(ranks_agreement.local_error_then_recovery, 2, bad_rank, bad, env,
                               timeout=120))
    for rank, report in enumerate(results):
        if rank == bad_rank:
            assert report["bad"].startswith(f"{kind}: ") and text in report["bad"], report
        else:
            assert report["bad"].startswith("PeerAborted: "), report
            assert f"rank(s) {bad_rank} of the group failed locally" in report["bad"]
            assert text in report["bad"], report
        assert report["after"] == report["after destroy_all"] == "shm: 3", report


def test_the_vllm_drop_in_tells_every_rank_of_a_local_error() -> None:
    results = values(run_ranks(ranks_agreement.vllm_local_error_then_recovery, 2, timeout=120))
    assert results[1]["bad"].startswith("ValueError: world_size=2, rank=0 do not match")
    assert results[0]["bad"].startswith("PeerAborted: "), results[0]
    for report in results:
        assert report["after"] == "None"  # no CUDA here: vLLM runs unfused, on every rank
    assert results[0]["resolve"] == results[1]["resolve"]


QUANTISED_CASES = {
    "none vs fp8": [(None, "swizzled_128x4"), ("fp8", "swizzled_128x4")],
    "fp8 vs fp8_dynamic": [("fp8", "swizzled_128x4"), ("fp8_dynamic", "swizzled_128x4")],
    "nvfp4 swizzled vs linear": [("nvfp4", "swizzled_128x4"), ("nvfp4", "linear")],
    "fp8_group 32 vs 64": [("fp8_group", "fp32", 32), ("fp8_group", "fp32", 64)],
    "fp8_group fp32 vs ue8m0": [("fp8_group", "fp32", 32), ("fp8_group", "ue8m0_packed", 32)],
    "fp8_group column-major vs fp32": [("fp8_group", "fp32_column_major", 64),
                                       ("fp8_group", "fp32", 64)],
    "fp8_group vs fp8_dynamic": [("fp8_group", "fp32", 64), ("fp8_dynamic", None)],
}


@pytest.mark.parametrize("case", sorted(QUANTISED_CASES))
@pytest.mark.parametrize(("backend", "tokens"), [("torch", 2), ("shm", 2), ("shm", 8)],
                         ids=["torch", "shm", "shm-over-capacity"])
def test_calls_that_differ_in_quantisation_or_layout_fail_on_every_rank(
        case: str, backend: str, tokens: int) -> None:
    """R11 on every path: the quantisation (and NVFP4's scale layout) is part of the call's
    descriptor also where the backend quantises as a step of its own (torch, and a call over
    capacity, which runs there): ``MismatchedCall`` on every rank, and the next call works."""
    results = values(run_ranks(ranks_agreement.quantised_calls_that_differ, 2, backend, tokens,
                               QUANTISED_CASES[case], timeout=120))
    for report in results:
        assert report["backend"] == backend, report
        assert report["call"].startswith("MismatchedCall: "), report
        assert report["after"] == "2", report  # normed to 1; its fp8 code with scale 0.5: 2
    assert results[0]["call"] == results[1]["call"]


def test_a_backend_registered_on_some_ranks_only_fails_on_every_rank_at_once() -> None:
    for report in values(run_ranks(ranks_agreement.backend_registered_on_one_rank, 2, timeout=120)):
        assert report.startswith("NegotiationError: ranks have different backends"), report
        assert "backend 'extra' is registered on ranks [0] but not on ranks [1]" in report


@pytest.mark.parametrize("field", ["auto_rank", "unmet"])
def test_a_backend_registered_with_different_fields_fails_on_every_rank_naming_the_field(
        field: str) -> None:
    """The same name on every rank is not enough: a descriptor whose fields differ would make
    the ranks resolve different plans (and time out naming each other); every rank raises
    ``NegotiationError`` naming the backend and the field instead."""
    for report in values(run_ranks(ranks_agreement.backend_registered_with_other_fields, 2,
                                   field, timeout=120)):
        assert report.startswith("NegotiationError: ranks have different backends"), report
        assert f"backend 'extra' differs in {field}: rank 0:" in report, report


def test_the_unfused_backend_blocked_by_a_local_check_is_not_used() -> None:
    """What the plan lists as blocked is never used, the unfused backend included."""
    env = {"ARFUSE_BACKEND": "torch", "ARFUSE_FAULTS": "torch.probe@1=raise"}
    for report in values(run_ranks(ranks_agreement.unfused_backend_blocked, 2, env=env,
                                   timeout=120)):
        assert report.startswith("ValueError: no backend can run"), report
        assert "torch: rank 1: local check failed: InjectedFault" in report, report


@pytest.mark.parametrize(("backend", "env"), [("shm", {}), ("shm", {"ARFUSE_SHM_PURE_TORCH": "1"}),
                                              ("torch", {})], ids=["shm", "pure-torch", "torch"])
@pytest.mark.parametrize("hidden_b", [64, 128], ids=["one-workspace", "two-workspaces"])
def test_ops_called_in_other_orders_are_a_mismatched_call_on_every_rank(
        backend: str, env: dict[str, str], hidden_b: int) -> None:
    """Rank 0 calls op A then op B, rank 1 B then A: ``MismatchedCall`` on every rank at once
    (not a timeout after 30 s naming a live rank, and no call of A paired with one of B).
    Ops that share a workspace (or, on torch, the process group) differ in the op their
    descriptors name: the group stays in step. Ops in two shm workspaces wait in different
    segments: each rank sees the other in a call there, and both workspaces are out of step
    (``WorkspaceBroken``) until the ops are closed."""
    results = values(run_ranks(ranks_agreement.ops_called_in_other_orders, 2, backend, hidden_b,
                               env=env, timeout=150))
    in_step = hidden_b == 64 or backend == "torch"
    for report in results:
        assert report["shared"] == (hidden_b == 64), report
        assert report["first"].startswith("MismatchedCall: "), report
        if in_step:
            assert "they differ in" in report["first"] or "differ from rank 0" in report["first"]
            assert "op=" in report["first"], report
            assert report["second"].startswith("MismatchedCall: "), report
            assert report["A after"] == report["B after"] == "3", report
        else:
            assert "called their ops in different orders" in report["first"], report
            for step in ("second", "A after", "B after"):
                assert report[step].startswith("WorkspaceBroken: "), (step, report)
        assert report["fresh"] == "3", report


def test_ranks_forced_into_different_modes_are_a_mismatched_call() -> None:
    for report in values(run_ranks(ranks_agreement.ranks_in_different_modes, 2, timeout=120)):
        assert report["call"].startswith("MismatchedCall: "), report
        assert "they differ in mode;" in report["call"], report
        assert report["after"] == "2", report


def test_a_call_timeout_leaves_no_key_in_the_store_past_the_next_ops() -> None:
    results = values(run_ranks(ranks_agreement.store_keys_after_a_call_timeout, 2, timeout=120))
    assert results[0]["timed out"] and results[0]["left"], results
    assert not results[0]["after"] and not results[1]["after"], results


def test_a_local_error_leaves_no_reference_cycle_holding_the_group() -> None:
    for report in values(run_ranks(ranks_agreement.contexts_left_after_a_local_error, 2,
                                   timeout=120)):
        assert report == {"left": 0}, report
