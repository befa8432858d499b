"""The shm kernel's bytes do not depend on how many intra-op threads a rank gives it: 2 real
ranks, torch.set_num_threads(k) for k in 1, 2, 3 and 7 (oversubscribed on purpose), one-shot
and two-shot, the patterns of the numerics matrix, token counts below and above the size from
which a call goes parallel (csrc/parallel.h). Bytes equal across thread counts and ranks."""

from __future__ import annotations

from typing import Any

import pytest

from harness import run_ranks, values
from ranks_numerics import numerics
from reference import Case

THREADS = (1, 2, 3, 7)
TOKENS = (1, 3, 64, 700)
PATTERNS = ("plain", "norm", "fp8", "nvfp4_swizzled")


def with_threads(rank: int, world: int, threads: int, cases: list[Case], max_tokens: int,
                 mode: str) -> dict[Case, str]:
    import torch

    torch.set_num_threads(threads)
    got = numerics(rank, world, "shm", cases, max_tokens, mode)
    assert torch.get_num_threads() == threads
    return {case: entry["digest"] for case, entry in got.items() if "digest" in entry}


@pytest.mark.parametrize("mode", ["oneshot", "twoshot"])
def test_bytes_do_not_depend_on_threads(mode: str) -> None:
    cases = [Case(dtype, tokens, 256, pattern) for dtype in ("bf16", "fp32")
             for tokens in TOKENS for pattern in PATTERNS
             if not (dtype == "fp32" and pattern.startswith("nvfp4"))]
    by_threads: dict[int, Any] = {}
    for k in THREADS:
        ranks = values(run_ranks(with_threads, 2, k, cases, max(TOKENS), mode))
        assert ranks[0] == ranks[1], f"ranks differ at {k} threads"
        by_threads[k] = ranks[0]
    for k in THREADS[1:]:
        differ = [c for c in cases if by_threads[k][c] != by_threads[1][c]]
        assert not differ, f"{k} threads give other bytes than 1 in {differ}"
