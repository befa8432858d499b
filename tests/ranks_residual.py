"""Rank bodies for the residual across ranks: each rank's own residual, a promised replicated
residual, and the check that it is the same everywhere. Module level, so they can be pickled."""

from __future__ import annotations

import time
from typing import Any

import torch


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


def residual_check_through_the_operator(rank: int, world: int) -> dict[str, Any]:
    """replicated_residual="check", residuals that differ on the last rank, called through
    the workspace's torch operator (which skips the op's check); then a call through the op
    (the group must still be in step)."""
    import arfuse

    tokens, hidden = 4, 64
    comm = arfuse.FusedAllReduce(max_token_num=tokens, hidden_dim=hidden, dtype=torch.bfloat16,
                                 backend="shm", strict=True, timeout_s=20.0,
                                 replicated_residual="check")
    residual = torch.full((tokens, hidden), 1.0 + (rank == world - 1), dtype=torch.bfloat16)
    x = torch.full((tokens, hidden), float(rank + 1), dtype=torch.bfloat16)
    weight = torch.ones(hidden, dtype=torch.bfloat16)
    handle = comm.workspace.handle  # type: ignore[attr-defined]
    report: dict[str, Any] = {"path": comm.workspace.path}  # type: ignore[attr-defined]
    try:
        outs = torch.ops.arfuse.shm_fused_allreduce(handle, x, residual, weight, 1e-6, 0.0, 0,
                                                    0.0, None, None)
        report["residual_out"] = outs[1][0, 0].item()
    except ValueError as exc:
        report["error"] = str(exc)
    same = torch.ones(tokens, hidden, dtype=torch.bfloat16)
    report["after"] = comm(x, residual=same, weight=weight, eps=1e-6).residual_out[0, 0].item()
    comm.close()
    return report
