"""Per-rank bodies for the multi-process tests (module level, so they can be pickled)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from arfuse.digest import digest

from reference import DTYPES, EPS, FP8_SCALE, NVFP4_SCALE, Case, inputs, reference


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


def call_then_report(rank: int, world: int, mode: str | None = None) -> dict[str, Any]:
    """Two calls on shm (faults from the environment); report how each rank's second call ends."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32)
    if mode is not None:
        comm.workspace.set_mode(mode)  # type: ignore[attr-defined]
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
    for tokens in (3, 16, 5, 5, 5, 3):  # repeated sizes: the cached views of both slots
        x = torch.randn(tokens, 80, generator=gen).to(torch.bfloat16)
        r = torch.randn(tokens, 80).to(torch.bfloat16)
        before = comm.input_buffer(tokens)
        expected = comm(x, residual=r, weight=w)
        slot = comm.input_buffer(tokens)
        same.append(slot.data_ptr() != before.data_ptr())  # a call moves to the other slot
        same.append(comm.input_buffer(tokens) is slot)  # no call in between: the same slot
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


def in_place(rank: int, world: int, backend: str, mode: str | None) -> list[dict[str, Any]]:
    """Each pattern three ways: new outputs, caller-given outputs, and in place (``out=x``,
    ``residual_out=residual``). Reports whether they are bit-equal and where results went."""
    import arfuse

    hidden, dtype = 1040, torch.bfloat16  # 2080-byte rows: 70 tokens span 3 one-shot blocks
    comm = arfuse.FusedAllReduce(max_token_num=70, hidden_dim=hidden, dtype=dtype,
                                 backend=backend, timeout_s=30)
    if mode is not None:
        comm.workspace.set_mode(mode)  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(7)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    report = []
    for tokens in (1, 70):
        xs = [torch.randn(tokens, hidden, generator=gen).to(dtype) for _ in range(world)]
        base = torch.randn(tokens, hidden, generator=gen).to(dtype)
        patterns: list[tuple[str, dict[str, Any]]] = [
            ("plain", {}),
            ("norm", {"residual": base, "weight": weight}),
            ("norm-no-residual", {"weight": weight}),
            ("fp8", {"residual": base, "weight": weight, "quant": "fp8", "scale": 0.5}),
        ]
        for name, kwargs in patterns:
            expected = comm(xs[rank], **kwargs)
            out, res_out = torch.empty_like(base), torch.empty_like(base)
            given = comm(xs[rank], out=out,
                         residual_out=res_out if "weight" in kwargs else None, **kwargs)
            x = xs[rank].clone()
            inplace_kwargs = dict(kwargs)
            residual = None
            if "residual" in kwargs:
                residual = base.clone()
                inplace_kwargs["residual"] = residual
            if "weight" in kwargs and residual is not None:
                got = comm(x, out=x, residual_out=residual, **inplace_kwargs)
            elif "weight" in kwargs:  # no residual: residual_out may take x's place
                other = torch.empty_like(x)
                got = comm(x, out=other, residual_out=x, **inplace_kwargs)
            else:
                got = comm(x, out=x, **inplace_kwargs)

            def same(a: Any, b: Any) -> bool:
                return (a is None and b is None) or (
                    a is not None and b is not None and torch.equal(a, b))

            report.append({
                "case": (name, tokens),
                "is_fused_output": all(
                    isinstance(r, arfuse.FusedOutput) and len(r) == 4
                    and r.out is r[0] and r.residual_out is r[1] for r in (expected, given, got)),
                "given_equal": all(same(getattr(given, f), getattr(expected, f))
                                   for f in expected._fields),
                "given_used": given.out.data_ptr() == out.data_ptr() and (
                    given.residual_out is None or given.residual_out.data_ptr()
                    == res_out.data_ptr()),
                "inplace_equal": all(same(getattr(got, f), getattr(expected, f))
                                     for f in expected._fields),
                "inplace_used": (got.residual_out.data_ptr() == x.data_ptr()
                                 if name == "norm-no-residual" else
                                 got.out.data_ptr() == x.data_ptr() and (
                                     residual is None
                                     or got.residual_out.data_ptr() == residual.data_ptr())),
            })
    report.append({"stats": comm.stats(), "backend": comm.backend,
                   "path": getattr(comm.workspace, "path", "")})
    comm.close()
    return report


def bad_calls(rank: int, world: int) -> dict[str, str]:
    """Every kind of bad argument: the error each raises (before any collective step)."""
    import arfuse

    hidden = 64
    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=hidden, dtype=torch.float32,
                                 timeout_s=10)
    x = torch.ones(4, hidden)
    r = torch.ones(4, hidden)
    w = torch.ones(hidden)
    big = torch.ones(8, hidden)
    attempts: dict[str, Any] = {
        "x not a tensor": lambda: comm([1.0]),
        "x 1-D": lambda: comm(torch.ones(hidden)),
        "x dtype": lambda: comm(x.double()),
        "x hidden": lambda: comm(torch.ones(4, hidden + 1)),
        "x not contiguous": lambda: comm(torch.ones(hidden, 4).t()),
        "residual without weight": lambda: comm(x, residual=r),
        "residual shape": lambda: comm(x, residual=torch.ones(3, hidden), weight=w),
        "weight shape": lambda: comm(x, weight=torch.ones(hidden + 1)),
        "eps": lambda: comm(x, weight=w, eps=0.0),
        "quant name": lambda: comm(x, weight=w, quant="int8", scale=1.0),
        "quant without scale": lambda: comm(x, weight=w, quant="fp8"),
        "nvfp4 fp32": lambda: comm(x, weight=w, quant="nvfp4", scale=1.0),
        "out shape": lambda: comm(x, out=torch.empty(3, hidden)),
        "out dtype": lambda: comm(x, out=torch.empty(4, hidden, dtype=torch.float64)),
        "out is residual": lambda: comm(x, residual=r, weight=w, out=r),
        "out partly x": lambda: comm(big[:4], out=big[2:6]),
        "residual_out without weight": lambda: comm(x, residual_out=torch.empty_like(x)),
        "residual_out is x": lambda: comm(x, residual=r, weight=w, residual_out=x),
        "out and residual_out same": lambda: comm(x, residual=r, weight=w, out=big[:4],
                                                  residual_out=big[:4]),
        "out in the shared slot": lambda: comm(x, out=comm.input_buffer(4)),
        "slot input in place": lambda: _in_place_on_slot(comm, hidden),
    }
    errors = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            errors[name] = "no error"
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    # the op still works after all that
    errors["after"] = str(bool(torch.all(comm(x).out == world)))
    comm.close()
    return errors


def _in_place_on_slot(comm: Any, hidden: int) -> Any:
    slot = comm.input_buffer(4)
    slot.fill_(1.0)
    return comm(slot, out=slot)


def copy_modes(rank: int, world: int, mode: str | None) -> dict[str, Any]:
    """Results are the same whether the copy into the shared slot uses cached or streaming
    stores (odd row sizes: unaligned heads and tails), and in auto mode every rank decides the
    same mode per size once the trial is over."""
    import arfuse

    report: dict[str, Any] = {"same": [], "modes": {}}
    # 37 fp32: one block with a tail; 4100 fp32: 3-row blocks that start 16 bytes off 32
    for dtype, hidden in ((torch.bfloat16, 1040), (torch.float32, 37), (torch.float32, 4100)):
        comm = arfuse.FusedAllReduce(max_token_num=70, hidden_dim=hidden, dtype=dtype,
                                     backend="shm", strict=True, timeout_s=30)
        workspace: Any = comm.workspace
        if mode is not None:
            workspace.set_mode(mode)
        gen = torch.Generator().manual_seed(11 + rank)
        weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
        for tokens in (1, 70):
            x = torch.randn(tokens, hidden, generator=gen).to(dtype)
            residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
            results = {}
            for copy_mode in ("cached", "streaming"):
                workspace.set_copy_mode(copy_mode)
                results[copy_mode] = comm(x, residual=residual, weight=weight)
            report["same"].append(
                torch.equal(results["cached"].out, results["streaming"].out)
                and torch.equal(results["cached"].residual_out,
                                results["streaming"].residual_out))
        workspace.set_copy_mode("auto")
        x = torch.randn(70, hidden, generator=gen).to(dtype)
        expected = comm(x, residual=x, weight=weight)  # this size's first auto call
        for _ in range(workspace.copy_trial_calls + 2):  # past the trial and the decision
            got = comm(x, residual=x, weight=weight)
            report["same"].append(torch.equal(got.out, expected.out))
        comm(x[:1], residual=x[:1], weight=weight)  # another size: one call, undecided
        report["modes"][f"{dtype}-{hidden}"] = workspace.copy_modes()
        comm.close()
    return report


def one_vs_two_shot(rank: int, world: int) -> list[str]:
    """The same calls forced one-shot and two-shot, special values included (NaN, signaling
    NaN, infinities, -0): returns what differs bit for bit (nothing, when the modes agree)."""
    import arfuse

    special = {torch.bfloat16: (0x7F81, 0x7FC0, 0x7F80, 0xFF80, 0x8000),
               torch.float16: (0x7C01, 0x7E00, 0x7C00, 0xFC00, 0x8000),
               torch.float32: (0x7F800001, 0x7FC00000, 0x7F800000, -0x800000, -0x80000000)}
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    differ = []
    for dtype, codes in special.items():
        hidden, tokens = 1040, 24
        comm = arfuse.FusedAllReduce(max_token_num=tokens, hidden_dim=hidden, dtype=dtype,
                                     backend="shm", strict=True, timeout_s=30)
        gen = torch.Generator().manual_seed(5 + rank)
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
        raw = x.view(bits[dtype])
        for i, code in enumerate(codes):  # a special value on some rows of every rank
            raw[3 * i + rank, 7 * i] = code if code < 2 ** 15 or dtype == torch.float32 \
                else code - 2 ** 16
        weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
        patterns = {"plain": {}, "norm": {"residual": residual, "weight": weight},
                    "norm-no-residual": {"weight": weight},
                    "fp8": {"residual": residual, "weight": weight, "quant": "fp8", "scale": 0.5}}
        for name, kwargs in patterns.items():
            results = []
            for mode in ("oneshot", "twoshot"):
                comm.workspace.set_mode(mode)  # type: ignore[attr-defined]
                results.append(comm(x, **kwargs))
            for field in ("out", "residual_out", "quant_out"):
                a, b = getattr(results[0], field), getattr(results[1], field)
                if a is None and b is None:
                    continue
                if a.dtype in bits:
                    a, b = a.view(bits[a.dtype]), b.view(bits[b.dtype])
                else:
                    a, b = a.view(torch.uint8), b.view(torch.uint8)
                if not torch.equal(a, b):
                    differ.append(f"{dtype} {name} {field}")
        comm.close()
    return differ


def mismatched_calls(rank: int, world: int, mode: str | None,
                     cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case on a fresh op: rank r calls with ``case["ranks"][min(r, len - 1)]`` as
    (tokens, pattern, quant); reports how that call and the call after it end on this rank."""
    import arfuse

    hidden = 4096  # 16 KiB fp32 rows: 4-row blocks, so 16 and 40 tokens differ in blocks
    report = []
    for case in cases:
        tokens, pattern, quant = case["ranks"][min(rank, len(case["ranks"]) - 1)]
        comm = arfuse.FusedAllReduce(max_token_num=64, hidden_dim=hidden, dtype=torch.float32,
                                     backend="shm", strict=True, timeout_s=5,
                                     quant=case.get("spec_quant"))
        if mode is not None and comm.workspace.path == "c++":  # type: ignore[attr-defined]
            comm.workspace.set_mode(mode)  # type: ignore[attr-defined]
        x = torch.full((tokens, hidden), float(rank + 1))
        if case.get("in_slot"):
            slot = comm.input_buffer(tokens)
            slot.copy_(x)
            x = slot
        kwargs: dict[str, Any] = {}
        if pattern != "plain":
            kwargs["weight"] = torch.ones(hidden)
        if pattern == "residual":
            kwargs["residual"] = torch.ones(tokens, hidden)
        if quant is not None:
            kwargs.update(quant=quant, scale=0.5)
        entry: dict[str, Any] = {"path": comm.workspace.path}  # type: ignore[attr-defined]
        started = time.monotonic()
        try:
            comm(x, **kwargs)
            entry["error"] = ""
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["seconds"] = time.monotonic() - started
        try:
            after = comm(torch.ones(2, hidden)).out
            entry["after"] = "ok" if bool(torch.all(after == world)) else f"wrong: {after}"
        except Exception as exc:
            entry["after"] = f"{type(exc).__name__}: {exc}"
        comm.close()
        report.append(entry)
    return report


def offset_views(rank: int, world: int, mode: str) -> dict[str, Any]:
    """Inputs that lie in the shared segment but not exactly at input_buffer(): an offset view
    of it as x, residual or weight inside it. Each must raise (ValueError, before any
    collective step) instead of corrupting rows; the op works on afterwards."""
    import arfuse

    hidden = 64
    comm = arfuse.FusedAllReduce(max_token_num=140, hidden_dim=hidden, dtype=torch.float32,
                                 backend="shm", strict=True, timeout_s=10)
    comm.workspace.set_mode(mode)  # type: ignore[attr-defined]
    errors: dict[str, str] = {}
    weight = torch.ones(hidden)
    for tokens in (65, 130):
        attempts = {
            "x offset": lambda t=tokens: comm(_filled(comm.input_buffer(t + 1)[1:], rank)),
            "residual in slot": lambda t=tokens: comm(
                torch.ones(t, hidden), residual=_filled(comm.input_buffer(t), 1),
                weight=weight),
            "weight in slot": lambda t=tokens: comm(
                torch.ones(t, hidden), weight=_filled(comm.input_buffer(t), 1)[0]),
        }
        for name, attempt in attempts.items():
            try:
                attempt()
                errors[f"{name} {tokens}"] = "no error"
            except Exception as exc:
                errors[f"{name} {tokens}"] = f"{type(exc).__name__}: {exc}"
        x = torch.full((tokens, hidden), float(rank + 1))
        got = comm(x).out
        errors[f"after {tokens}"] = str(bool(torch.all(got == world * (world + 1) / 2)))
    comm.close()
    return errors


def _filled(tensor: torch.Tensor, value: float) -> torch.Tensor:
    tensor.fill_(float(value) + 1.0)
    return tensor


def announce_across_capacity(rank: int, world: int) -> dict[str, Any]:
    """A call over capacity runs unfused; ``ShmWorkspace.announce`` makes it meet the shm group
    first. Every rank announcing the same call goes on; rank 0 calling within capacity while
    the others announce a call over it raises MismatchedCall everywhere (R11)."""
    import arfuse
    from arfuse.call_checks import CallArgs

    hidden = 64
    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=hidden, dtype=torch.float32,
                                 backend="shm", strict=True, timeout_s=5)
    workspace: Any = comm.workspace
    report: dict[str, Any] = {"path": workspace.path}
    workspace.announce(CallArgs(torch.ones(20, hidden)))  # the same on every rank
    report["after_same"] = bool(torch.all(comm(torch.ones(3, hidden)).out == world))
    started = time.monotonic()
    try:
        if rank == 0:
            comm(torch.ones(4, hidden))
        else:
            workspace.announce(CallArgs(torch.ones(20, hidden)))
        report["error"] = ""
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] = time.monotonic() - started
    comm.close()
    return report


def peer_rates(rank: int, world: int, blocked: int | None, directory: str) -> dict[str, Any]:
    """arfuse bench's peer rates in ``directory``; rank ``blocked`` gets a directory it cannot
    write (a full or missing ARFUSE_SHM_DIR)."""
    from pathlib import Path

    from arfuse.cli import bench

    os.environ["ARFUSE_SHM_DIR"] = str(Path(directory) / ("missing" if rank == blocked else ""))
    rates = bench.peer_rates(1 << 16, copy_rate=1e12, tag=4242)
    torch.distributed.barrier()
    return {"rate": None if rates is None else (rates.read, rates.shared_write),
            "left": sorted(p.name for p in Path(directory).iterdir())}


def calls_from_two_threads(rank: int, world: int, tokens: int, calls: int) -> dict[str, Any]:
    """Rank 0 calls one FusedAllReduce from two threads at once (inputs all 1 in one thread,
    all 100 in the other), the other ranks from one thread (2, then 200). Each call must pair
    whole calls across ranks: every output uniform, its value one of the possible sums."""
    import threading

    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=64, hidden_dim=1024, dtype=torch.float32,
                                 backend="shm", strict=True, timeout_s=20.0)
    weight = torch.ones(1024)
    seen: dict[str, list[list[float]]] = {"A": [], "B": []}
    errors: list[str] = []

    def run(tag: str, value: float) -> None:
        try:
            x = torch.full((tokens, 1024), value)
            residual = torch.zeros(tokens, 1024)
            for _ in range(calls):
                got = comm(x, residual=residual, weight=weight, eps=1e-6).residual_out
                seen[tag].append(sorted(set(got.flatten().tolist())))
        except Exception as exc:
            errors.append(f"{tag}: {type(exc).__name__}: {exc}")

    if rank == 0:
        threads = [threading.Thread(target=run, args=("A", 1.0)),
                   threading.Thread(target=run, args=("B", 100.0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        run("A", 2.0)
        run("B", 200.0)
    return {"seen": seen, "errors": errors, "path": comm.workspace.path}  # type: ignore[attr-defined]


def residual_per_rank(rank: int, world: int, replicated: bool, mode: str, in_place: bool,
                      tokens: int = 10, hidden: int = 1040) -> dict[str, Any]:
    """Each rank passes its own residual (all ``rank + 1``; x all 1 on every rank), with
    ``replicated_residual`` as given: the bytes each rank gets, and which path ran."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=tokens, hidden_dim=hidden, dtype=torch.float32,
                                 backend="shm", strict=True, timeout_s=20.0,
                                 replicated_residual=replicated)
    comm.workspace.set_mode(mode)  # type: ignore[attr-defined]
    x = torch.ones(tokens, hidden)
    residual = torch.full((tokens, hidden), float(rank + 1))
    kwargs: dict[str, Any] = {"out": x, "residual_out": residual} if in_place else {}
    got = comm(x, residual=residual, weight=torch.ones(hidden), eps=1e-6, **kwargs)
    path = comm.workspace.path  # type: ignore[attr-defined]
    comm.close()
    # every row is uniform: its value says whose residual it was finished with
    return {"residual_out": got.residual_out[:, 0].tolist(),
            "uniform": bool((got.residual_out == got.residual_out[:, :1]).all()),
            "path": path}


def replicated_residual_disagreement(rank: int, world: int) -> str:
    """Rank 0 promises a replicated residual, the others do not."""
    import arfuse

    try:
        arfuse.FusedAllReduce(max_token_num=4, hidden_dim=64, dtype=torch.float32,
                              backend="shm", timeout_s=20.0, replicated_residual=rank == 0)
    except arfuse.NegotiationError as exc:
        return str(exc)
    return "no error"


def residual_check(rank: int, world: int, same: bool, tokens: int = 10,
                   hidden: int = 1040, change: str = "one") -> dict[str, Any]:
    """replicated_residual="check": residuals the same on every rank (``same``) or, on the
    last rank, changed (``change``: ``one`` element +1; ``cancelling``: the bit patterns of
    three neighbours +1, -2, +1; ``swapped``: two elements 8191 apart exchanged); the outputs,
    or the error, of a call and of the call after it (the group must still be in step)."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=tokens, hidden_dim=hidden, dtype=torch.bfloat16,
                                 backend="shm", strict=True, timeout_s=20.0,
                                 replicated_residual="check")
    gen = torch.Generator().manual_seed(5)
    residual = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    if not same and rank == world - 1:
        change_residual(residual, change)
    x = torch.full((tokens, hidden), float(rank + 1), dtype=torch.bfloat16)
    weight = torch.ones(hidden, dtype=torch.bfloat16)
    report: dict[str, Any] = {"promised": comm.replicated_residual}
    try:
        got = comm(x, residual=residual, weight=weight, eps=1e-6)
        report["residual_out"] = got.residual_out.clone()
    except ValueError as exc:
        report["error"] = str(exc)
    after = comm(x, residual=torch.zeros(tokens, hidden, dtype=torch.bfloat16), weight=weight,
                 eps=1e-6)
    report["after"] = after.residual_out[0, 0].item()
    report["stats"] = comm.stats()
    comm.close()
    return report



def change_residual(residual: torch.Tensor, change: str) -> None:
    """Change ``residual`` in place as ``residual_check`` describes."""
    flat = residual.view(-1)
    if change == "one":
        residual[-1, 3] += 1
    elif change == "cancelling":
        bits = flat.view(torch.int16)
        bits[3] += 1
        bits[4] -= 2
        bits[5] += 1
    elif change == "swapped":
        flat[3], flat[3 + 8191] = flat[3 + 8191].clone(), flat[3].clone()
    else:
        raise ValueError(f"change={change!r}")


def release_during_operator_call(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 runs the torch operator in a thread while rank 1 is late, and meanwhile drops
    every Python reference to the kernel's ShmComm, so the operator's own reference is the
    last, released on a thread without the GIL when the call ends. The process must live on
    and the call give the sum."""
    import threading

    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 backend="shm", strict=True, timeout_s=20.0)
    ws = comm.workspace
    handle = int(ws.handle)  # type: ignore[attr-defined]
    x = torch.full((2, 64), float(rank + 1))

    def operator() -> torch.Tensor:
        return torch.ops.arfuse.shm_fused_allreduce(handle, x, None, None, 1e-6, 0.0, 0, 0.0,
                                                    False, None, None)[0]

    if rank == 1:
        time.sleep(1.5)
        return {"out": operator()[0, 0].item(), "released": False}
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["out"] = operator()[0, 0].item()
        except Exception as exc:  # reported, not raised: the thread's result is checked
            box["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.5)
    released = thread.is_alive()  # still waiting for rank 1: the operator holds the ShmComm
    comm._fast = None  # type: ignore[attr-defined]
    ws._comm = None  # type: ignore[attr-defined]
    import gc

    gc.collect()
    thread.join(30)
    return {**box, "released": released}


def residual_check_presence(rank: int, world: int, backend: str, silent: bool) -> dict[str, Any]:
    """replicated_residual="check", rank 0 passes a residual and the others do not (or, with
    ``silent``, never call): every rank's error, and then a call that matches."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=64, dtype=torch.float32,
                                 backend=backend, strict=backend != "torch", timeout_s=2.0,
                                 replicated_residual="check")
    x, weight = torch.full((4, 64), float(rank + 1)), torch.ones(64)
    report: dict[str, Any] = {}
    if silent and rank != 0:
        time.sleep(6.0)  # past rank 0's deadline, alive
        return report
    try:
        comm(x, residual=torch.ones(4, 64) if rank == 0 else None, weight=weight)
    except Exception as exc:  # the test checks the class and the text
        report["error"] = f"{type(exc).__name__}: {exc}"
    try:
        report["after"] = comm(x, residual=torch.zeros(4, 64), weight=weight).residual_out[
            0, 0].item()
    except Exception as exc:
        report["after"] = f"{type(exc).__name__}: {exc}"
    comm.close()
    return report


def topology_file_on_one_rank(rank: int, world: int, file_rank: int, path: str) -> str:
    """ARFUSE_TOPOLOGY set on rank ``file_rank`` only: what creating an op gives."""
    if rank == file_rank:
        os.environ["ARFUSE_TOPOLOGY"] = path
    else:
        os.environ.pop("ARFUSE_TOPOLOGY", None)
    import arfuse

    try:
        comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=64, dtype=torch.float32,
                                     timeout_s=10.0)
    except Exception as exc:  # the test checks the class and the text
        return f"{type(exc).__name__}: {exc}"
    comm.close()
    return f"created: {comm.plan.backend}"


def shm_create_with_a_silent_peer(rank: int, world: int, directory: str) -> str:
    """Rank 0 creates the shm segment while rank 1 never takes part: what rank 0 raises, and
    which segments of its process are left in ``directory`` (ARFUSE_SHM_DIR)."""
    from arfuse import group, settings
    from arfuse.backends.shm import workspace as shm_workspace
    from arfuse.spec import Spec

    ctx = group.make_context(group.join(None), "cpu", settings.load(timeout_s=1.0))
    ctx.channel.next_epoch()
    ctx.channel.begin("n1/shm")
    if rank != 0:
        time.sleep(3.0)  # alive, silent
        return "silent"
    try:
        shm_workspace.ShmBackend().create(ctx, Spec(max_tokens=16, hidden=64, dtype="fp32"))
        outcome = "created"
    except Exception as exc:  # the test checks the class
        outcome = type(exc).__name__
    mine = [p for p in os.listdir(directory) if p.split("-")[1:2] == [str(os.getpid())]]
    return f"{outcome}; left: {mine}"


def new_ops_after_a_broken_workspace(rank: int, world: int, backend: str) -> dict[str, Any]:
    """Both ranks make an op; rank 1 is late for its call, so rank 0 times out (rank 1's call
    may still succeed: the ranks fail apart). Then what WorkspaceBroken advises: every rank
    closes its ops, and new ones with the same settings must work."""
    import torch.distributed as dist

    import arfuse

    def make() -> Any:
        return arfuse.FusedAllReduce(max_token_num=4, hidden_dim=64, dtype=torch.float32,
                                     backend=backend, strict=True, timeout_s=1.0)

    first = make()
    x = torch.full((2, 64), float(rank + 1))
    if rank == 1:
        time.sleep(1.5)
    report: dict[str, Any] = {}
    for key in ("first", "first_again"):
        try:
            first(x)
            report[key] = "ran"
        except Exception as exc:  # the test checks the class and the text
            report[key] = f"{type(exc).__name__}: {exc}"
        if rank == 1:
            break
    dist.barrier()
    first.close()
    second = make()
    report["second"] = second(x).out[0, 0].item()
    second.close()
    return report


def rank_that_sleeps(rank: int, world: int, directory: str) -> int:
    """A launched rank that says it started (its pid in ``directory``), then sleeps."""
    Path(directory, f"rank{rank}").write_text(str(os.getpid()))
    time.sleep(60)
    return 0


def rank_with_an_exit_handler(rank: int, world: int, directory: str) -> int:
    """A launched rank whose atexit handler leaves a mark (as build.py's cleanup would)."""
    import atexit

    atexit.register(Path(directory, f"rank{rank}").write_text, "ran")
    return 0


def _mapped_bytes(start: int, end: int) -> int:
    """How many of the addresses [start, end) this process has mapped."""
    covered = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = (int(a, 16) for a in line.split()[0].split("-"))
        covered += max(0, min(high, end) - max(low, start))
    return covered


def _segments_held() -> dict[str, list[str]]:
    """This process's descriptors and mappings of arfuse segments (as the leak check sees them)."""
    from arfuse.scenarios import fd_targets, is_segment, mapped_segments

    return {"fds": sorted(t for t in fd_targets().values() if is_segment(t)),
            "maps": mapped_segments()}


def slot_view_after_close(rank: int, world: int) -> dict[str, Any]:
    """A call from this rank's slot, then close() while the slot's view is still held: what
    the view reads, whether this process still maps the segment, and whether the addresses
    are freed once the view goes (no garbage collection: reference counts alone)."""
    import gc

    import arfuse

    gc.disable()
    comm = arfuse.FusedAllReduce(max_token_num=1024, hidden_dim=1024, dtype=torch.float32,
                                 backend="shm", strict=True)
    path = comm.workspace.path  # type: ignore[attr-defined]
    start, end = comm.workspace.shared_span()  # type: ignore[union-attr]
    buf = comm.input_buffer(4)[:, :64]  # a view of a view
    buf.fill_(rank + 1.0)
    out = comm(comm.input_buffer(4)).out
    torch.distributed.barrier()  # every rank is out of its call
    comm.close()
    report: dict[str, Any] = {
        "path": path, "out": out.sum().item(), "out_in_segment": start <= out.data_ptr() < end,
        "read_after_close": buf.sum().item()}
    buf.fill_(5.0)  # writable too: the process's own memory now
    report["written_after_close"] = buf.sum().item()
    report["held_after_close"] = _segments_held()
    report["segment_bytes"] = end - start
    report["mapped_while_viewed"] = _mapped_bytes(start, end)
    del buf
    report["mapped_after_last_view"] = _mapped_bytes(start, end)
    gc.enable()
    return report


def peer_fails_in_shm_exchange(rank: int, world: int, phase: str, directory: str,
                               fails: str) -> dict[str, Any]:
    """Rank 1 fails at the shm creation exchange ``phase``: with ``fails="exchange"`` it
    announces a failure instead of its value (the others see ``PeerAborted`` there); with
    ``fails="cleanup"`` its mapped workspace fails and then freeing it raises too. What the
    other ranks hold of segments right after the failed attempt (no garbage collection), their
    attempts, and what is left in ``directory`` (ARFUSE_SHM_DIR)."""
    import gc

    import arfuse
    from arfuse import group
    from arfuse.backends.shm import workspace as shm

    gc.disable()
    if rank == 1 and fails == "exchange":
        original = group.GroupContext.all_gather

        def all_gather(self: Any, name: str, value: Any, backend: str = "-",
                       abortable: bool = True) -> list[Any]:
            if name == phase:
                self.channel.abort(f"MemoryError: injected before {phase}")
                raise MemoryError(f"injected before {phase}")
            return original(self, name, value, backend, abortable)

        group.GroupContext.all_gather = all_gather  # type: ignore[method-assign]
    if rank == 1 and fails == "cleanup":
        free = shm.ShmWorkspace._free

        def publish_identity(self: Any) -> None:
            raise MemoryError("injected after mapping")

        def failing_free(self: Any) -> None:
            free(self)
            raise RuntimeError("injected: freeing raised")

        shm.ShmWorkspace.publish_identity = publish_identity  # type: ignore[method-assign]
        shm.ShmWorkspace._free = failing_free  # type: ignore[method-assign]
    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32)
    report: dict[str, Any] = {"backend": comm.backend, "held": _segments_held(),
                              "attempts": [a.describe() for a in comm.attempts]}
    comm.close()
    torch.distributed.barrier()
    report["left"] = sorted(os.listdir(directory))
    gc.enable()
    return report


def creator_killed_at(rank: int, world: int, point: str, named: str) -> str:
    """Rank 0 SIGKILLs itself at ``point`` of the shm creation (after the exchange of that
    name returned; "named": right after it gave the segment a name); the others report what
    they raised. ``named``: "never" (the usual way), "for a peer" (rank 1 acts as if in
    another pid namespace, so rank 0 names the segment for it) or "from the start" (rank 0's
    filesystem has no unnamed files)."""
    import errno
    import signal

    import arfuse
    from arfuse import group
    from arfuse.backends.shm import workspace as shm

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == 1 and named == "for a peer":
        namespace = shm.pid_namespace()
        shm.pid_namespace = lambda: namespace + 1  # type: ignore[assignment]
    if rank == 0:
        link, all_gather, open_ = shm.os.link, group.GroupContext.all_gather, shm.os.open

        def link_then(*args: Any, **kwargs: Any) -> None:
            link(*args, **kwargs)
            if point == "named":
                die()

        def open_then(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if named == "from the start" and flags & os.O_TMPFILE == os.O_TMPFILE:
                raise OSError(errno.EOPNOTSUPP, "no unnamed files here")
            return open_(path, flags, *args, **kwargs)

        def all_gather_then(self: Any, name: str, *args: Any, **kwargs: Any) -> list[Any]:
            if name == point == "shm-name" and named == "from the start":
                die()  # named, the peers not told
            got = all_gather(self, name, *args, **kwargs)
            if name == point:
                die()
            return got

        shm.os.link = link_then  # type: ignore[assignment]
        shm.os.open = open_then  # type: ignore[assignment]
        group.GroupContext.all_gather = all_gather_then  # type: ignore[method-assign]
    try:
        arfuse.FusedAllReduce(max_token_num=64, hidden_dim=64, dtype=torch.float32,
                              backend="shm", strict=True)
    except Exception as exc:  # the test checks that the creator's death was noticed
        return type(exc).__name__
    return "created"


def shm_segment_named(rank: int, world: int, named: str) -> dict[str, Any]:
    """A shm op made the way ``named`` says (as in ``creator_killed_at``) and used: its result
    and whether anything is left in the directory."""
    import errno

    import arfuse
    from arfuse.backends.shm import workspace as shm

    if rank == 1 and named == "for a peer":
        namespace = shm.pid_namespace()
        shm.pid_namespace = lambda: namespace + 1  # type: ignore[assignment]
    if rank == 0 and named == "from the start":
        open_ = shm.os.open

        def open_then(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & os.O_TMPFILE == os.O_TMPFILE:
                raise OSError(errno.EOPNOTSUPP, "no unnamed files here")
            return open_(path, flags, *args, **kwargs)

        shm.os.open = open_then  # type: ignore[assignment]
    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 backend="shm", strict=True)
    left = sorted(os.listdir(shm.segment_dir()))
    out = comm(torch.ones(2, 64)).out
    comm.close()
    return {"out": out.sum().item(), "left": left}


def create_with_user_files_in_the_working_directory(rank: int, world: int,
                                                    directory: str) -> list[str]:
    """Ranks run in ``directory`` (their working directory), ARFUSE_SHM_DIR set but empty: a
    shm op is made, used and closed; what ``directory`` holds after."""
    import arfuse

    os.chdir(directory)
    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=32, dtype=torch.float32,
                                 backend="shm", strict=True)
    comm(torch.ones(1, 32))
    comm.close()
    torch.distributed.barrier()
    return sorted(os.listdir(directory))


def rank_finds_the_store_port_taken_before_rank0_starts(rank: int, world: int,
                                                        directory: str) -> int:
    """Rank 1 tries to bind the job's MASTER_PORT while rank 0 has not started yet: the port
    must already be held (a port found free, then bound by rank 0 later, can be taken by
    anyone in between). Then the ranks meet through it, from the environment."""
    import socket

    import torch.distributed as dist

    from arfuse.launch import init_from_env

    port = int(os.environ["MASTER_PORT"])
    checked = Path(directory, "checked")
    if rank == 1:
        with socket.socket() as other:
            try:
                other.bind(("127.0.0.1", port))
                verdict = "free"
            except OSError:
                verdict = "held"
        Path(directory, "verdict").write_text(verdict)
        checked.touch()
    else:
        for _ in range(1200):
            if checked.exists():
                break
            time.sleep(0.05)
    init_from_env("cpu", timeout_s=60)
    total = torch.ones(1)
    dist.all_reduce(total)
    return 0 if int(total.item()) == world else 1
