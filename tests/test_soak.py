"""The soak (arfuse.bench.soak, which benchmarks/soak.py runs), short: 2,000 calls on two real
ranks of random sizes on both sides of the capacity and of the one-/two-shot threshold, every
pattern, checked every 20th call against the float64 reference; memory, descriptors and threads
flat; nothing left."""

from __future__ import annotations

import pytest

from arfuse.bench import soak


@pytest.mark.parametrize("output_stores", ["auto", "streaming"])
def test_short_soak(output_stores: str) -> None:
    """output_stores=streaming: every call with outputs of its own stores them with streaming
    stores (auto mode does so only far above these sizes)."""
    result = soak.run_soak(calls=2000, check_every=20, sample_every=200, limit_s=240,
                           output_stores=output_stores)
    print(soak.summary(result))
    assert result["ok"], result["problems"]
    assert result["segments_left"] == []
    for rank in ("0", "1"):
        r = result["ranks"][rank]
        assert r["backend"] == "shm" and r["calls"] == 2000 and r["checks"] == 100, r
        assert r["mismatches"] == 0 and r["worst_ratio"] <= 1.0, r
        assert r["fds_end"] == r["fds_start"] and r["threads_end"] == r["threads_start"], r
        assert r["rss_growth_after_warmup_mib"] <= soak.RSS_BOUND_MIB, r
        assert r["leaks_after_destroy_all"] == [], r
        modes = r["modes"]
        assert modes.get("unfused", 0) > 0 and r["stats"]["unfused_over_capacity"] == \
            modes["unfused"], r
        if r["path"] == "c++":  # the pure-torch path is one-shot only
            assert modes.get("oneshot", 0) > 0 and modes.get("twoshot", 0) > 0, modes
