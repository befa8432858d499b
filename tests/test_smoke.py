"""One multi-rank check per backend, for the quick set (``pytest -m "not slow"``): two real
ranks, one fused call of each epilogue, bit-identical ranks and the float64 reference."""

from __future__ import annotations

import pytest

import ranks_agreement
from harness import run_ranks, values


@pytest.mark.smoke
@pytest.mark.parametrize(("backend", "env"), [("shm", {}), ("shm", {"ARFUSE_SHM_PURE_TORCH": "1"}),
                                              ("torch", {})], ids=["shm", "pure-torch", "torch"])
def test_two_ranks_agree_with_the_reference(backend: str, env: dict[str, str]) -> None:
    results = values(run_ranks(ranks_agreement.one_call_per_epilogue, 2, backend, env=env,
                               timeout=120))
    for report in results:
        assert report["backend"] == backend, report
        assert all(err < 2.0**-6 for err in report["errors"].values()), report
    assert results[0]["digests"] == results[1]["digests"]
