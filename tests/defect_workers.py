"""Per-rank bodies for tests/test_defects.py (module level, so they can be pickled)."""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

import torch


def _error(fn: Any) -> dict[str, Any]:
    started = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return {"type": type(exc).__name__, "error": str(exc),
                "seconds": time.monotonic() - started}
    return {"type": "", "error": "", "seconds": time.monotonic() - started}


def torch_peer_never_calls(rank: int, world: int, timeout_s: float) -> dict[str, Any]:
    """Rank 0 calls the torch backend; rank 1 never does (it only waits, alive)."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 backend="torch", timeout_s=timeout_s)
    if rank != 0:
        time.sleep(timeout_s + 3)
        return {"type": "", "error": "", "seconds": 0.0}
    first = _error(lambda: comm(torch.ones(2, 64)))
    second = _error(lambda: comm(torch.ones(2, 64)))
    return {**first, "second": second}


def mismatched_tokens(rank: int, world: int, tokens: list[int], backend: str,
                      residual_on: list[bool]) -> dict[str, Any]:
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=64, hidden_dim=32, dtype=torch.float32,
                                 backend=backend, timeout_s=5)
    x = torch.full((tokens[rank], 32), float(rank + 1))
    kwargs: dict[str, Any] = {}
    if residual_on[rank]:
        kwargs = {"residual": torch.zeros_like(x), "weight": torch.ones(32)}
    return _error(lambda: comm(x, **kwargs))


def process_group_references(rank: int, world: int, backend: str) -> dict[str, int]:
    """References to the process group before arfuse, after close() and destroy_all()."""
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
    arfuse.destroy_all()
    del c
    gc.collect()
    return {"before": before, "during": during, "after_close": after_close,
            "after_destroy_all": sys.getrefcount(group)}


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


def requires_grad_destination(rank: int, world: int, backend: str) -> dict[str, Any]:
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 backend=backend)
    x = torch.ones(2, 64, requires_grad=True)
    result = _error(lambda: comm(x, out=x))
    result["version"] = x._version
    ok = comm(torch.ones(2, 64)).out
    result["then_works"] = bool(torch.all(ok == world))
    comm.close()
    return result


def create_then_report(rank: int, world: int) -> dict[str, Any]:
    import arfuse

    return _error(lambda: arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64,
                                                dtype=torch.float32))


def fp8_dynamic_call(rank: int, world: int, backend: str) -> dict[str, Any]:
    import hashlib

    import arfuse
    from arfuse import quant as q

    comm = arfuse.FusedAllReduce(max_token_num=70, hidden_dim=64, dtype=torch.bfloat16,
                                 backend=backend, quant="fp8_dynamic")
    gen = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(67, 64, generator=gen).to(torch.bfloat16)
    residual = torch.randn(67, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    res = comm(x, residual=residual, weight=torch.ones(64, dtype=torch.bfloat16),
               quant="fp8_dynamic")
    codes, scales = q.fp8_dynamic_quantize(res.out)
    assert res.quant_out is not None and res.scale_out is not None
    digest = hashlib.sha256(res.quant_out.view(torch.uint8).numpy().tobytes()
                            + res.scale_out.numpy().tobytes()).hexdigest()
    comm.close()
    return {"digest": digest, "backend": backend,
            "matches_reference": bool(torch.equal(res.quant_out.view(torch.uint8),
                                                  codes.view(torch.uint8))
                                      and torch.equal(res.scale_out, scales))}
