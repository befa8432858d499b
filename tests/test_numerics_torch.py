"""The torch backend against an independent float64 reference, on real gloo ranks."""

from __future__ import annotations

import pytest

from harness import run_ranks, values
from numerics_check import check_case
from reference import PATTERNS, Case


def cases() -> list[Case]:
    out = []
    for dtype in ("bf16", "fp16", "fp32"):
        for hidden in (48, 80):  # multiples of 16 that are not powers of two
            for pattern in PATTERNS:
                if pattern.startswith("nvfp4") and dtype == "fp32":
                    continue
                out.append(Case(dtype, 3, hidden, pattern))
        out.append(Case(dtype, 2, 33, "norm"))  # odd hidden
        out.append(Case(dtype, 2, 33, "plain"))
    out.append(Case("bf16", 130, 48, "nvfp4_swizzled"))  # more than one 128-row tile
    out.append(Case("fp16", 5, 48, "norm", residual=False))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_torch_backend_numerics(world: int) -> None:
    all_cases = cases()
    results = values(run_ranks(__import__("ranks_numerics").numerics, world, "torch", all_cases,
                               256))
    for case in all_cases:
        check_case(case, [r[case] for r in results], "torch")
