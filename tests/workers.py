"""Per-rank bodies for the multi-process tests (module level, so they can be pickled)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from reference import DTYPES, EPS, FP8_SCALE, NVFP4_SCALE, Case, digest, inputs, reference


def numerics(rank: int, world: int, backend: str, cases: list[Case],
             max_tokens: int, mode: str | None = None) -> dict[Case, dict[str, Any]]:
    """Run every case; return per case a digest of the outputs and the errors vs float64."""
    import arfuse

    by_shape: dict[tuple[str, int], arfuse.FusedAllReduce] = {}
    results: dict[Case, dict[str, Any]] = {}
    for case in cases:
        key = (case.dtype, case.hidden)
        if key not in by_shape:
            by_shape[key] = arfuse.FusedAllReduce(
                max_token_num=max_tokens, hidden_dim=case.hidden, dtype=DTYPES[case.dtype],
                backend=backend, timeout_s=30)
            if mode is not None:
                by_shape[key].workspace.set_mode(mode)  # type: ignore[attr-defined]
        comm = by_shape[key]
        data = inputs(case, world)
        x = data["xs"][rank]
        kwargs: dict[str, Any] = {}
        if case.pattern != "plain":
            kwargs.update(weight=data["weight"], eps=EPS, weight_bias=case.weight_bias)
            if case.residual:
                kwargs["residual"] = data["residual"]
        if case.quant == "fp8":
            kwargs.update(quant="fp8", scale=FP8_SCALE)
        elif case.quant == "nvfp4":
            kwargs.update(quant="nvfp4", scale=NVFP4_SCALE, layout=case.layout)
        x_before = x.clone()
        res = comm(x, **kwargs)
        assert torch.equal(x, x_before), "the op modified its input"
        ref = reference(case, data)
        entry: dict[str, Any] = {
            "backend": comm.backend,
            "digest": digest(res.out, res.residual_out, res.quant_out, res.scale_out),
            "out": res.out.float().clone(),
            "ref_out": ref["out"],
            "residual_out": None if res.residual_out is None else res.residual_out.float(),
            "ref_residual_out": ref.get("residual_out"),
            "ref_abs_sum": ref["abs_sum"],
            "quant_out": None if res.quant_out is None else res.quant_out.view(torch.uint8),
            "scale_out": None if res.scale_out is None else res.scale_out.clone(),
            "out_raw": res.out.clone(),
            "path": getattr(comm.workspace, "path", ""),
            "mode": comm.workspace.mode(case.tokens) if comm.backend == "shm" else "",  # type: ignore[attr-defined]
        }
        results[case] = entry
    stats = {k: c.stats() for k, c in by_shape.items()}
    for comm in by_shape.values():
        comm.close()
    results[Case("stats", 0, 0, "plain")] = {"stats": stats}  # type: ignore[dict-item]
    return results


def negotiate_once(rank: int, world: int, backend: str | None, hidden: int = 64,
                   max_tokens: int = 16) -> dict[str, Any]:
    """Create a comm (faults come from the environment), run one call, report what happened."""
    import arfuse

    started = time.perf_counter()
    comm = arfuse.FusedAllReduce(max_token_num=max_tokens, hidden_dim=hidden,
                                 dtype=torch.float32, backend=backend)
    seconds = time.perf_counter() - started
    x = torch.full((2, hidden), float(rank + 1))
    out = comm(x).out
    ok = bool(torch.all(out == world * (world + 1) / 2))
    attempts = [a.describe() for a in comm.attempts]
    result = {"backend": comm.backend, "correct": ok, "attempts": attempts, "seconds": seconds,
              "pid": os.getpid()}
    comm.close()
    return result


def fault_sequence(rank: int, world: int, clauses: list[str]) -> list[dict[str, Any]]:
    """Negotiate once per ``ARFUSE_FAULTS`` value, in one process (non-fatal faults only)."""
    out = []
    for clause in clauses:
        os.environ["ARFUSE_FAULTS"] = clause
        try:
            out.append(negotiate_once(rank, world, None) | {"clause": clause})
        finally:
            os.environ.pop("ARFUSE_FAULTS", None)
    return out


def expect_failure(rank: int, world: int, backend: str | None = None) -> dict[str, Any]:
    """Negotiate (faults from the environment) and report the error this rank ends with."""
    started = time.monotonic()
    try:
        result = negotiate_once(rank, world, backend)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
    return {"error": "", "result": result, "seconds": time.monotonic() - started}


def mismatched_spec(rank: int, world: int) -> str:
    import arfuse

    try:
        arfuse.FusedAllReduce(max_token_num=16, hidden_dim=64 + 16 * rank, dtype=torch.float32,
                              timeout_s=10)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def registry_story(rank: int, world: int) -> dict[str, Any]:
    """Reuse, growth (R4), one workspace for plain + quant (R5), destroy frees (R10)."""
    import arfuse
    from arfuse.registry import REGISTRY

    story: dict[str, Any] = {}
    a = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.bfloat16)
    b = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.bfloat16, quant="fp8")
    story["plain_and_quant_share"] = a.workspace is b.workspace
    story["live_after_two"] = len(REGISTRY.live_workspaces())
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
    f = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=96, dtype=torch.bfloat16)
    story["other_hidden_is_new"] = f.workspace is not d.workspace
    over = torch.ones(40, 64, dtype=torch.bfloat16)
    story["over_capacity_result_ok"] = bool(torch.all(d(over).out == world))
    story["over_capacity_stats"] = d.stats()
    old = a.workspace
    for comm in (a, b, c):
        comm.close()
    story["old_destroyed_after_last_user"] = old.destroyed
    story["live_before_destroy_all"] = len(REGISTRY.live_workspaces())
    arfuse.destroy_all()
    story["live_after_destroy_all"] = len(REGISTRY.live_workspaces())
    story["closed_op_error"] = ""
    try:
        d(x)
    except RuntimeError as exc:
        story["closed_op_error"] = str(exc)
    return story


def call_then_report(rank: int, world: int) -> dict[str, Any]:
    """Two calls on shm (faults from the environment); report how each rank's second call ends."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32)
    started = time.monotonic()
    try:
        comm(torch.ones(2, 64))
        comm(torch.ones(2, 64))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started,
                "backend": comm.backend}
    return {"error": "", "seconds": time.monotonic() - started, "backend": comm.backend}


def zero_copy(rank: int, world: int, mode: str) -> dict[str, Any]:
    """The op on an input computed straight into the shared slot equals the op on a copy."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=80, dtype=torch.bfloat16)
    comm.workspace.set_mode(mode)  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(rank)
    w = torch.rand(80, generator=gen).to(torch.bfloat16)
    same = []
    for tokens in (3, 16, 5):
        x = torch.randn(tokens, 80, generator=gen).to(torch.bfloat16)
        r = torch.randn(tokens, 80).to(torch.bfloat16)
        expected = comm(x, residual=r, weight=w)
        slot = comm.input_buffer(tokens)
        torch.mul(x, 1, out=slot)  # a "layer" writing its output into the slot
        got = comm(slot, residual=r, weight=w)
        same.append(torch.equal(got.out, expected.out)
                    and torch.equal(got.residual_out, expected.residual_out))
    over = comm.input_buffer(40)  # over capacity: a plain tensor, and the unfused path
    over.copy_(torch.ones(40, 80))
    same.append(bool(torch.all(comm(over).out == world)))
    return {"same": same, "stats": comm.stats()}


def quant_edges(rank: int, world: int, values: torch.Tensor, quant: str, scale: float,
                layout: str) -> dict[str, Any]:
    """Plain all-reduce + quantisation of ``values`` (rank 0) + zeros (the others): the sum is
    exactly ``values``, so the quantised bytes can be compared with the reference."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=values.shape[0], hidden_dim=values.shape[1],
                                 dtype=values.dtype, quant=quant)
    x = values if rank == 0 else torch.zeros_like(values)
    res = comm(x, quant=quant, scale=scale, layout=layout)
    return {"backend": comm.backend, "out": res.out, "quant_out": res.quant_out.view(torch.uint8),
            "scale_out": res.scale_out}
