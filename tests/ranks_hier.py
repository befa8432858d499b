"""Rank bodies of test_hier.py: the hierarchical backend on a group that spans hosts (two
"hosts" named by a topology file on one machine, or real ones in namespaces). Module level,
so they can be pickled or started by path."""

from __future__ import annotations

import os
from typing import Any

import torch

from arfuse.digest import digest
from arfuse.scenarios import check_result, make_inputs, run_pattern

PATTERNS = ("plain", "norm", "norm_residual", "fp8", "nvfp4", "in_place", "slot")


def _hosts_of(world: int) -> list[list[int]]:
    """Ranks by host as the topology file names them: the first half, then the second."""
    half = world // 2
    return [list(range(half)), list(range(half, world))]


def _documented_sum(xs: list[torch.Tensor], world: int) -> torch.Tensor:
    """The backend's sum order: each host's rows in local rank order, then hosts in host
    order, all in fp32."""
    partials = []
    for members in _hosts_of(world):
        acc = xs[members[0]].float().clone()
        for r in members[1:]:
            acc.add_(xs[r].float())
        partials.append(acc)
    total = partials[0].clone()
    for p in partials[1:]:
        total.add_(p)
    return total


def numerics(rank: int, world: int, dtypes: list[str], tokens: list[int],
             hidden: int) -> dict[str, Any]:
    """Every pattern against the float64 reference; digests of every output (the test
    compares them across ranks); the out bytes against the documented sum order."""
    import arfuse
    from arfuse.call_checks import CallArgs
    from arfuse.epilogue import apply
    from arfuse.torch_types import TORCH_DTYPES

    ranks = list(range(world))
    report: dict[str, Any] = {"digests": {}, "worst": 0.0, "order_exact": True}
    for dtype in dtypes:
        comm = arfuse.FusedAllReduce(max_token_num=max(tokens), hidden_dim=hidden,
                                     dtype=TORCH_DTYPES[dtype], timeout_s=30)
        report["backend"] = comm.backend
        report["explain"] = comm.plan.explain()
        for k, t in enumerate(tokens):
            xs, residual, weight = make_inputs(40 + k, t, hidden, dtype, ranks)
            for pattern in PATTERNS:
                if pattern == "nvfp4" and dtype == "fp32":
                    continue
                got = run_pattern(comm, pattern, xs[rank], residual, weight)
                report["worst"] = max(report["worst"], check_result(
                    pattern, dtype, xs, residual, weight, got))
                report["digests"][f"{dtype}/{t}/{pattern}"] = [
                    digest(v) for v in (got.out, got.residual_out, got.quant_out,
                                        got.scale_out) if v is not None]
                if pattern == "norm_residual":
                    want = apply(_documented_sum(xs, world), CallArgs(
                        x=xs[rank], residual=residual, weight=weight, eps=1e-5))
                    report["order_exact"] &= bool(torch.equal(want.out, got.out))
            dyn = comm(xs[rank], residual=residual, weight=weight, eps=1e-5,
                       quant="fp8_dynamic")
            report["digests"][f"{dtype}/{t}/fp8_dynamic"] = [
                digest(dyn.quant_out), digest(dyn.scale_out)]
            grouped = comm(xs[rank], residual=residual, weight=weight, eps=1e-5,
                           quant="fp8_group", layout="ue8m0_packed", group_size=32)
            want = apply(_documented_sum(xs, world), CallArgs(
                x=xs[rank], residual=residual, weight=weight, eps=1e-5, quant="fp8_group",
                layout="ue8m0_packed", group_size=32))
            report["order_exact"] &= bool(torch.equal(want.quant_out.view(torch.uint8),
                                                      grouped.quant_out.view(torch.uint8)))
            report["digests"][f"{dtype}/{t}/fp8_group"] = [
                digest(grouped.quant_out), digest(grouped.scale_out)]
        report["stats"] = comm.stats()
        comm.close()
    return report


def moe(rank: int, world: int, hidden: int) -> dict[str, Any]:
    """A MoE finalize call through the backend, against its reference."""
    import arfuse
    from arfuse.scenarios.calls import make_moe_inputs

    ranks = list(range(world))
    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=hidden, dtype=torch.float32,
                                 timeout_s=30)
    worst = 0.0
    for pattern in ("moe_finalize", "moe_reduce"):
        inputs, xs = make_moe_inputs(7, pattern, 8, hidden, "fp32", ranks,
                                     {r: 4 for r in ranks}, set())
        _, residual, weight = make_inputs(7, 8, hidden, "fp32", ranks)
        got = run_pattern(comm, pattern, inputs[rank], residual, weight)
        worst = max(worst, check_result(pattern, "fp32", xs, residual, weight, got))
    backend = comm.backend
    comm.close()
    return {"backend": backend, "worst": worst, "out": digest(got.out)}


def mismatched(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Rank ``world - 1`` calls with other arguments (``kind``: tokens, pattern, or over the
    capacity); every rank must raise ``MismatchedCall``, then a matching call must work."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=64, dtype=torch.float32,
                                 timeout_s=20)
    odd = rank == world - 1
    tokens = 5 if (odd and kind == "tokens") else 17 if (odd and kind == "capacity") else 4
    x = torch.ones(tokens, 64)
    weight = torch.ones(64)
    error = ""
    # a matched call of 4 tokens first: in the odd call, the ranks whose chunk has its size
    # send their data with the verdicts, the odd rank (other tokens) its verdict alone
    comm(torch.ones(4, 64))
    try:
        if odd and kind == "pattern":
            comm(x, weight=weight)
        else:
            comm(x)
    except arfuse.MismatchedCall as exc:
        error = str(exc)
    after = comm(torch.full((4, 64), float(rank))).out
    backend = comm.backend
    comm.close()
    return {"backend": backend, "error": error, "after": float(after[0, 0])}


def crossings(rank: int, world: int, tokens: list[int]) -> dict[str, Any]:
    """Calls of ``tokens`` in turn (bf16, with a residual and RMSNorm): how many exchanges
    between hosts each one made and the bytes this rank sent in them (the data rides with the
    verdicts, or the signature, when its size is the last call's), how many were finished by
    the torch backend's sum and epilogue (``backends/torch/finish``), the residual_out value
    each gave."""
    import arfuse
    from arfuse import collective
    from arfuse.backends.torch import workspace

    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=64, dtype=torch.bfloat16,
                                 timeout_s=20)
    real_finish, epilogues = workspace.finish, []

    def counted_finish(*args: Any) -> Any:
        epilogues.append(1)
        return real_finish(*args)

    workspace.finish = counted_finish
    counts, sent, values = [], [], []
    try:
        for t in tokens:
            before = (collective.TRAFFIC.collectives, collective.TRAFFIC.bytes_sent)
            got = comm(torch.full((t, 64), float(rank + 1), dtype=torch.bfloat16),
                       residual=torch.ones(t, 64, dtype=torch.bfloat16),
                       weight=torch.ones(64, dtype=torch.bfloat16))
            counts.append(collective.TRAFFIC.collectives - before[0])
            sent.append(collective.TRAFFIC.bytes_sent - before[1])
            assert got.residual_out is not None
            values.append(float(got.residual_out.float().mean()))
    finally:
        workspace.finish = real_finish
    backend = comm.backend
    comm.close()
    return {"backend": backend, "counts": counts, "bytes": sent, "values": values,
            "finished_apart": len(epilogues)}


def killed(rank: int, world: int, victim: int) -> dict[str, Any]:
    """``victim`` dies before its second call; every other rank must raise within the
    timeout, naming what it can."""
    import time

    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=64, dtype=torch.float32,
                                 timeout_s=10)
    comm(torch.ones(4, 64))
    if rank == victim:
        os._exit(3)
    started = time.monotonic()
    try:
        comm(torch.ones(4, 64))
        return {"error": "", "seconds": time.monotonic() - started}
    except arfuse.ArfuseError as exc:
        found = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started,
                 "backend": comm.backend, "silent": list(getattr(exc, "silent", None) or [])}
    try:
        comm(torch.ones(4, 64))
        found["next"] = ""
    except arfuse.ArfuseError as exc:
        found["next"] = type(exc).__name__
    return found


def negotiated(rank: int, world: int) -> dict[str, Any]:
    """What the group ends with (``ARFUSE_FAULTS`` set by the test), and one checked call."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=64, dtype=torch.float32,
                                 timeout_s=20)
    got = comm(torch.full((2, 64), float(rank + 1))).out
    found = {"backend": comm.backend, "attempts": [a.describe() for a in comm.attempts],
             "value": float(got[0, 0])}
    comm.close()
    return found
