"""Rank bodies for the arguments of a call: caller-given outputs and in place, every kind of
bad argument (each an error naming it, before any collective step), views into the shared
segment, tensors that hold no plain values. Module level, so they can be pickled."""

from __future__ import annotations

from typing import Any

import torch

from harness import outcome


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


def requires_grad_destination(rank: int, world: int, backend: str) -> dict[str, Any]:
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 backend=backend)
    x = torch.ones(2, 64, requires_grad=True)
    result = outcome(lambda: comm(x, out=x))
    result["version"] = x._version
    ok = comm(torch.ones(2, 64)).out
    result["then_works"] = bool(torch.all(ok == world))
    comm.close()
    return result


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
    errors = {name: outcome(lambda call=call: comm(**call))
              for name, call in bad_tensor_calls(4, 64, torch.float32).items()}
    ok = comm(torch.ones(2, 64)).out
    errors["then"] = {"works": bool(torch.all(ok == world)), "backend": comm.backend}
    comm.close()
    return errors
