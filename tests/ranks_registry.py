"""Rank bodies for what ops share and give back: workspaces reused, grown and destroyed by the
registry, references to the process group, keys in its store. Module level, so they can be
pickled."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import torch


def registry_story(rank: int, world: int) -> dict[str, Any]:
    """Reuse, growth (R4), one workspace for plain + quant (R5), destroy frees (R10)."""
    import arfuse
    from arfuse.registry import REGISTRY

    story: dict[str, Any] = {}
    a = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.bfloat16)
    b = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.bfloat16, quant="fp8")
    story["plain_and_quant_share"] = a.workspace is b.workspace
    story["live_after_two"] = len(REGISTRY.workspaces())
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    q = b(x, weight=w, quant="fp8", scale=1.0)
    story["quant_ok"] = q.quant_out is not None and q.quant_out.dtype == torch.float8_e4m3fn
    c = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=64, dtype=torch.bfloat16)
    story["smaller_reuses"] = c.workspace is a.workspace
    d = arfuse.FusedAllReduce(max_token_num=32, hidden_dim=64, dtype=torch.bfloat16)
    story["larger_is_new"] = d.workspace is not a.workspace
    story["larger_capacity"] = d.capacity
    story["old_still_works"] = bool(torch.all(a(x).out == world))
    e = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.bfloat16)
    story["after_growth_reuses_largest"] = e.workspace is d.workspace
    topology = Path(__file__).resolve().parent.parent / "examples/topologies/cpu-host-2.json"
    os.environ["ARFUSE_TOPOLOGY"] = str(topology)  # a covering request, another topology file
    try:
        g = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.bfloat16)
    finally:
        del os.environ["ARFUSE_TOPOLOGY"]
    story["other_topology_is_new"] = g.workspace is not d.workspace
    story["other_topology_works"] = bool(torch.all(g(x).out == world))
    g.close()
    promised = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.bfloat16,
                                     replicated_residual=True)
    story["promise_is_new"] = promised.workspace is not d.workspace and not any(
        promised.workspace is o.workspace for o in (a, b, c, e))
    story["promise_kept"] = promised.replicated_residual and not d.replicated_residual
    story["promise_works"] = bool(torch.all(promised(x).out == world))
    promised.close()
    f = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=96, dtype=torch.bfloat16)
    story["other_hidden_is_new"] = f.workspace is not d.workspace
    over = torch.ones(40, 64, dtype=torch.bfloat16)
    story["over_capacity_result_ok"] = bool(torch.all(d(over).out == world))
    story["over_capacity_stats"] = d.stats()
    old = a.workspace
    for comm in (a, b, c):
        comm.close()
    story["old_destroyed_after_last_user"] = old.destroyed
    story["live_before_destroy_all"] = len(REGISTRY.workspaces())
    arfuse.destroy_all()
    story["live_after_destroy_all"] = len(REGISTRY.workspaces())
    story["closed_op_error"] = ""
    try:
        d(x)
    except RuntimeError as exc:
        story["closed_op_error"] = str(exc)
    return story


def process_group_references(rank: int, world: int, backend: str) -> dict[str, int]:
    """References to the process group before arfuse, after close() and after destroy_all()
    with an op still alive, and what a call of that op then raises."""
    import torch.distributed as dist

    import arfuse

    group = dist.group.WORLD
    gc.collect()
    before = sys.getrefcount(group)
    a = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                              backend=backend)
    b = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=64, dtype=torch.float32,
                              backend=backend)
    a(torch.ones(2, 64))
    b(torch.ones(20, 64))  # over capacity: the unfused workspace too
    during = sys.getrefcount(group)
    a.close()
    b.close()
    gc.collect()
    after_close = sys.getrefcount(group)
    c = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                              backend=backend)
    c(torch.ones(2, 64))
    c(torch.ones(20, 64))
    arfuse.destroy_all()  # c stays alive: destroy_all closes it
    gc.collect()
    after_destroy_all = sys.getrefcount(group)
    refused = ""
    try:
        c(torch.ones(2, 64))
    except arfuse.ArfuseError as exc:
        refused = str(exc)
    return {"before": before, "during": during, "after_close": after_close,
            "after_destroy_all": after_destroy_all, "refused": refused,
            "backend_after": c.backend}


def store_keys_after_creations(rank: int, world: int, counts: list[int]) -> list[int]:
    """Keys in the group's store after each number of create/close cycles."""
    import torch.distributed as dist

    import arfuse

    store = dist.distributed_c10d._get_default_store()
    seen: list[int] = []
    done = 0
    for count in counts:
        while done < count:
            arfuse.FusedAllReduce(max_token_num=4, hidden_dim=32, dtype=torch.float32,
                                  backend="torch").close()
            done += 1
        dist.barrier()
        seen.append(int(store.num_keys()))
        dist.barrier()
    return seen
