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


def _alone_up_to(limit: int | None) -> None:
    """Calls after one whose host partial has at most ``limit`` bytes cross on each host's
    first rank alone, larger ones on every rank (``None``: the library's limit)."""
    if limit is not None:
        from arfuse.backends.hier import workspace

        workspace.ALONE_MAX_BYTES = limit


def _halves_over(limit: int | None) -> None:
    """Chunks of more than ``limit`` fp32 bytes cross in halves where they can (``None``: the
    library's limit)."""
    if limit is not None:
        from arfuse.backends.hier import link

        link.HALVES_MIN_BYTES = limit


def numerics(rank: int, world: int, dtypes: list[str], tokens: list[int],
             hidden: int, alone_max: int | None = None,
             halves_min: int | None = None) -> dict[str, Any]:
    """Every pattern against the float64 reference; digests of every output (the test
    compares them across ranks); the out bytes against the documented sum order."""
    import arfuse
    from arfuse.call_checks import CallArgs
    from arfuse.epilogue import apply
    from arfuse.torch_types import TORCH_DTYPES

    _alone_up_to(alone_max)
    _halves_over(halves_min)
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


def mismatched(rank: int, world: int, kind: str,
               alone_max: int | None = None) -> dict[str, Any]:
    """Rank ``world - 1`` calls with other arguments (``kind``: tokens, pattern, or over the
    capacity; ``host-tokens``, ``host-capacity``: the second host's ranks, alike among
    themselves); every rank must raise ``MismatchedCall``, then a matching call must work."""
    import arfuse

    _alone_up_to(alone_max)
    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=64, dtype=torch.float32,
                                 timeout_s=20)
    odd = rank == world - 1 or (kind.startswith("host-") and rank >= world // 2)
    kind = kind.removeprefix("host-")
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


def crossings(rank: int, world: int, tokens: list[int],
              alone_max: int | None = None, halves_min: int | None = None) -> dict[str, Any]:
    """Calls of ``tokens`` in turn (bf16, with a residual and RMSNorm): how many exchanges
    between hosts each one made and the bytes this rank sent in them (the data rides with the
    verdicts, or the signature, when its size is the last call's), how many were finished by
    the torch backend's sum and epilogue (``backends/torch/finish``), the residual_out value
    each gave."""
    import arfuse
    from arfuse import collective
    from arfuse.backends.torch import workspace

    _alone_up_to(alone_max)
    _halves_over(halves_min)
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


def killed(rank: int, world: int, victim: int,
           alone_max: int | None = None) -> dict[str, Any]:
    """``victim`` dies before its second call; every other rank must raise within the
    timeout, naming what it can."""

    import arfuse

    _alone_up_to(alone_max)
    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=64, dtype=torch.float32,
                                 timeout_s=10)
    comm(torch.ones(4, 64))
    if rank == victim:
        os._exit(3)
    return _the_call_and_the_next(comm)


def _the_call_and_the_next(comm: Any) -> dict[str, Any]:
    """A call of 4 tokens: its error (class and text, "" for none), the ranks it names silent,
    the seconds it took; then what the next call raised ("" for nothing)."""
    import time

    import arfuse

    started = time.monotonic()
    found: dict[str, Any] = {"error": "", "silent": []}
    try:
        comm(torch.ones(4, 64))
    except arfuse.ArfuseError as exc:
        found = {"error": f"{type(exc).__name__}: {exc}",
                 "silent": list(getattr(exc, "silent", None) or [])}
    found["seconds"] = time.monotonic() - started
    try:
        comm(torch.ones(4, 64))
        found["next"] = ""
    except arfuse.ArfuseError as exc:
        found["next"] = type(exc).__name__
    return found


def over_capacity(rank: int, world: int,
                  alone_max: int | None = None) -> dict[str, Any]:
    """Calls over the capacity (on the torch backend, announced on hier's steps) between calls
    under it, with a residual and RMSNorm: the residual_out values and the workspace's count
    of calls over capacity."""
    import arfuse

    _alone_up_to(alone_max)
    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=64, dtype=torch.float32,
                                 timeout_s=20)
    got = []
    for t in (4, 17, 17, 4, 40, 1):
        out = comm(torch.full((t, 64), float(rank + 1)), residual=torch.ones(t, 64),
                   weight=torch.ones(64))
        assert out.residual_out is not None
        got.append(float(out.residual_out.mean()))
    found = {"backend": comm.backend, "values": got, "stats": comm.stats()}
    comm.close()
    return found


def first_link_down(rank: int, world: int) -> dict[str, Any]:
    """Rank 0's exchange between hosts never happens (its link is down) in a call of few
    tokens, which crosses on each host's first rank alone: every rank must raise within the
    timeouts, the next call ``WorkspaceBroken``."""
    import time

    import arfuse
    from arfuse import collective

    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=64, dtype=torch.float32,
                                 timeout_s=10)
    comm(torch.ones(4, 64))
    if rank == 0:
        real = collective.gather_rows

        def down(x: torch.Tensor, ctx: Any, phase: str, backend: str, call: int,
                 *args: Any) -> Any:
            if phase != "call-signature":
                return real(x, ctx, phase, backend, call, *args)
            time.sleep(ctx.timeout_s)
            raise arfuse.CallTimeout(phase, backend, None, ctx.timeout_s)

        collective.gather_rows = down  # type: ignore[assignment]
    return _the_call_and_the_next(comm)


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
