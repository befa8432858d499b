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


def bad_tensor_calls(tokens: int, hidden: int, dtype: torch.dtype) -> dict[str, dict[str, Any]]:
    """Calls whose tensor argument does not hold plain values in its memory (sparse, nested,
    meta, quantized, a lazily negated view), or whose x is complex or a conjugate view, and
    numbers that are meta tensors, by name. Each must be a ValueError or TypeError naming the
    argument, on every backend and path (the shm kernel's fast path declines them)."""
    import warnings

    def plain() -> torch.Tensor:
        return torch.randn(tokens, hidden).to(dtype)

    def weight() -> torch.Tensor:
        return (torch.rand(hidden) + 0.5).to(dtype)

    def quiet(make: Any) -> Any:
        """``make`` without torch's notes that these kinds are beta, prototype or deprecated."""
        def made() -> torch.Tensor:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return make()
        return made

    def kinds(make: Any) -> dict[str, Any]:
        def nested() -> torch.Tensor:
            like = make()
            return torch.nested.nested_tensor([like, like] if like.dim() == 2 else [like])

        def sparse_csr() -> torch.Tensor:
            like = make()
            return like.to_sparse_csr() if like.dim() == 2 else like.to_sparse()

        return {"sparse": lambda: make().to_sparse(),
                "sparse CSR": quiet(sparse_csr),
                "nested": quiet(nested),
                "meta": lambda: torch.empty_like(make(), device="meta"),
                "quantized": quiet(lambda: torch.quantize_per_tensor(make().float(), 0.1, 0,
                                                                     torch.qint8)),
                "negative view": lambda: torch._neg_view(make())}

    calls: dict[str, dict[str, Any]] = {}
    for kind, bad in kinds(plain).items():
        calls[f"x {kind}"] = {"x": bad()}
        calls[f"residual {kind}"] = {"x": plain(), "residual": bad(), "weight": weight()}
        calls[f"out {kind}"] = {"x": plain(), "out": bad()}
        calls[f"residual_out {kind}"] = {"x": plain(), "weight": weight(),
                                         "residual_out": bad()}
    for kind, bad in kinds(weight).items():
        calls[f"weight {kind}"] = {"x": plain(), "weight": bad()}
    complex_x = torch.randn(tokens, hidden, dtype=torch.complex64)
    calls["x complex"] = {"x": complex_x}
    calls["x conjugate view"] = {"x": complex_x.conj()}
    meta_number = torch.tensor(1e-6, device="meta")
    calls["eps meta"] = {"x": plain(), "weight": weight(), "eps": meta_number}
    calls["weight_bias meta"] = {"x": plain(), "weight": weight(), "weight_bias": meta_number}
    calls["scale meta"] = {"x": plain(), "quant": "fp8", "scale": meta_number}
    return calls


def argument_named(name: str) -> str:
    """The argument a case of ``bad_tensor_calls`` is about: the first word of its name."""
    return name.split(" ")[0]


def bad_tensor_errors(rank: int, world: int, backend: str) -> dict[str, dict[str, Any]]:
    """Every call of ``bad_tensor_calls`` on a real group: the error of each, then that a good
    call still works (no rank left a call half done)."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 backend=backend)
    errors = {name: _error(lambda call=call: comm(**call))
              for name, call in bad_tensor_calls(4, 64, torch.float32).items()}
    ok = comm(torch.ones(2, 64)).out
    errors["then"] = {"works": bool(torch.all(ok == world)), "backend": comm.backend}
    comm.close()
    return errors
