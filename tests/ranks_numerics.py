"""Rank bodies for the numerics tests: every case against the float64 reference, the
quantised bytes, and the same bits whichever way the shm backend copies or reduces (zero-copy
inputs, cached or streaming copies, one- or two-shot). Module level, so they can be pickled."""

from __future__ import annotations

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


def ring(rank: int, world: int) -> dict[str, Any]:
    """One-shot calls whose copied input goes round the slot's ring (more blocks than the ring
    holds), between calls that do not, each rank with a ring of its own size (3, 8 or none):
    the same bits as two-shot, also when rank 0 wrote its input into the slot itself (its rows
    at their own offsets); and the ring each rank said its input went round (its arrival
    line's ring word)."""
    import arfuse
    from arfuse.backends.shm.layout import ARRIVE_OFFSET, CACHE_LINE, RING_OFFSET

    hidden, max_tokens = 1040, 300  # fp32: 15 rows a 64 KiB block, 20 blocks at 300 tokens
    comm = arfuse.FusedAllReduce(max_token_num=max_tokens, hidden_dim=hidden,
                                 dtype=torch.float32, backend="shm", strict=True, timeout_s=30)
    workspace: Any = comm.workspace
    workspace.set_ring_blocks((3, 8, 0)[rank])
    gen = torch.Generator().manual_seed(17 + rank)
    weight = torch.rand(hidden, generator=gen) + 0.5
    view = workspace._view_or_private()
    line = ARRIVE_OFFSET + CACHE_LINE * rank + RING_OFFSET

    def ring_word() -> int:  # this rank's, for the call just made (its parity)
        first_buffer_next = workspace._comm.next_input_offset() == workspace.layout.slot_offset(
            rank, 0)
        parity = 1 if first_buffer_next else 0
        return int(view[line + 4 * parity:line + 4 * parity + 4].view(torch.int32))

    report: dict[str, Any] = {"differ": [], "ring": []}
    for tokens, zero_copy in ((300, False), (7, False), (300, True), (121, False),
                              (120, False), (300, True), (299, False)):
        x = torch.randn(tokens, hidden, generator=gen)
        residual = torch.randn(tokens, hidden, generator=gen)
        got = {}
        for mode in ("twoshot", "oneshot"):
            workspace.set_mode(mode)
            source = x
            if zero_copy and rank == 0 and mode == "oneshot":
                source = comm.input_buffer(tokens)
                source.copy_(x)
            got[mode] = comm(source, residual=residual, weight=weight)
        report["ring"].append(ring_word())
        for field in ("out", "residual_out"):
            a, b = getattr(got["oneshot"], field), getattr(got["twoshot"], field)
            if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                report["differ"].append(f"{tokens} tokens zero_copy={zero_copy} {field}")
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
