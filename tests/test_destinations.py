"""Caller-given outputs (``out=``, ``residual_out=``) and in-place calls, on every CPU path;
and the op's argument errors (DESIGN 3.6): each names its argument and runs no collective."""

from __future__ import annotations

import pytest

import ranks_calls
from harness import run_ranks, values


@pytest.mark.parametrize(("world", "backend", "mode", "env"), [
    (2, "shm", "oneshot", {}),
    (3, "shm", "twoshot", {}),
    (2, "shm", None, {"ARFUSE_SHM_PURE_TORCH": "1"}),
    (2, "torch", None, {}),
])
def test_given_outputs_and_in_place_equal_new_outputs(world: int, backend: str,
                                                      mode: str | None,
                                                      env: dict[str, str]) -> None:
    reports = values(run_ranks(ranks_calls.in_place, world, backend, mode, env=env))
    for report in reports:
        *cases, tail = report
        assert tail["backend"] == backend
        if env:
            assert tail["path"] == "pure-torch"
        assert len(cases) == 8
        for case in cases:
            assert case["given_equal"] and case["inplace_equal"], case
            assert case["given_used"] and case["inplace_used"], case
            assert case["is_fused_output"], case
    # every rank computed the same bits (in place included)
    assert all(r[:-1] == reports[0][:-1] for r in reports)


EXPECTED = {
    "x not a tensor": ("TypeError", "x must be a torch.Tensor"),
    "x 1-D": ("ValueError", "x must be 2-D"),
    "x dtype": ("ValueError", "x has dtype torch.float64"),
    "x hidden": ("ValueError", "hidden_dim=64"),
    "x not contiguous": ("ValueError", "x must be contiguous"),
    "residual without weight": ("ValueError", "residual needs weight"),
    "residual shape": ("ValueError", "residual has shape (3, 64)"),
    "weight shape": ("ValueError", "weight must have shape (64,)"),
    "eps": ("ValueError", "eps=0.0"),
    "quant name": ("ValueError", "int8"),
    "quant without scale": ("ValueError", "needs scale"),
    "nvfp4 fp32": ("ValueError", "bf16 or fp16"),
    "out shape": ("ValueError", "out has shape (3, 64)"),
    "out dtype": ("ValueError", "out has dtype torch.float64"),
    "out is residual": ("ValueError", "out overlaps residual"),
    "out partly x": ("ValueError", "out overlaps x only partly"),
    "residual_out without weight": ("ValueError", "residual_out needs weight"),
    "residual_out is x": ("ValueError", "residual_out overlaps x"),
    "out and residual_out same": ("ValueError", "out and residual_out overlap"),
    "out in the shared slot": ("ValueError", "out is in the shared input slot"),
    "slot input in place": ("ValueError", "out is in the shared input slot"),
}


def test_bad_arguments_name_themselves_and_leave_the_op_usable() -> None:
    for errors in values(run_ranks(ranks_calls.bad_calls, 2, timeout=120)):
        assert errors.pop("after") == "True"
        assert set(errors) == set(EXPECTED)
        for name, (kind, text) in EXPECTED.items():
            assert errors[name].startswith(kind + ":"), (name, errors[name])
            assert text in errors[name], (name, errors[name])
