"""What arfuse holds of a process group it gives back: no reference to the group once every op
is closed or destroyed, and no pile of keys in its store over many creations."""

from __future__ import annotations

import pytest

import ranks_registry
from harness import run_ranks, values


@pytest.mark.parametrize("backend", ["torch", "shm"])
def test_close_and_destroy_all_release_the_process_group(backend: str) -> None:
    for refs in values(run_ranks(ranks_registry.process_group_references, 2, backend)):
        assert refs["during"] > refs["before"], refs  # arfuse did hold it while in use
        assert refs["after_close"] == refs["before"], refs
        # an op alive after destroy_all holds nothing of the group, and says it was closed
        assert refs["after_destroy_all"] == refs["before"], refs
        assert "closed (by arfuse.destroy_all())" in refs["refused"], refs
        assert refs["backend_after"] == "closed", refs


def test_store_keys_stay_bounded_over_many_creations() -> None:
    for seen in values(run_ranks(ranks_registry.store_keys_after_creations, 2, [2, 10, 40],
                                 timeout=120)):
        assert seen[2] <= seen[0] + 2, seen  # not 16 more per creation
