"""Per-rank bodies for the tests of what the ranks of a group must agree on before and during
calls: a rank's local error at construction, ops that pair across one another, the backend
table, quantisation and layout of a call."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch


def _outcome(make: Any) -> str:
    try:
        made = make()
    except Exception as exc:  # the test checks the class and the text
        return f"{type(exc).__name__}: {exc}"
    close = getattr(made, "close", None)
    if close is not None:
        close()
    return "made"


def local_error_then_recovery(rank: int, world: int, bad_rank: int, bad: dict[str, Any],
                              env: dict[str, str]) -> dict[str, str]:
    """Rank ``bad_rank`` makes its op with ``bad`` keywords or ``env``, the others with valid
    ones; then every rank makes valid ops and calls them (twice over, ``destroy_all`` between):
    what each step gave on this rank."""
    import arfuse

    good = {"max_token_num": 8, "hidden_dim": 64, "dtype": torch.float32, "timeout_s": 30.0}
    report: dict[str, str] = {}
    saved = {name: os.environ.get(name) for name in env}
    if rank == bad_rank:
        os.environ.update(env)
    try:
        report["bad"] = _outcome(lambda: arfuse.FusedAllReduce(
            **({**good, **bad} if rank == bad_rank else good)))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    for step in ("after", "after destroy_all"):
        comm = arfuse.FusedAllReduce(**good)
        out = comm(torch.full((2, 64), float(rank + 1))).out
        report[step] = f"{comm.backend}: {out[0, 0].item():g}"
        comm.close()
        arfuse.destroy_all()
    return report


def vllm_local_error_then_recovery(rank: int, world: int) -> dict[str, str]:
    """The vLLM drop-in's getter with a wrong rank on rank 1 (a local ValueError), then right."""
    import torch.distributed as dist

    from arfuse.integrations import vllm

    group = dist.group.WORLD
    report = {"bad": _outcome(lambda: vllm.get_fi_ar_workspace(
        world, rank if rank == 0 else 0, 8, 64, torch.float32, group))}
    report["after"] = repr(vllm.get_fi_ar_workspace(world, rank, 8, 64, torch.float32, group))
    report["resolve"] = repr(vllm.resolve_fi_ar_backend(group))
    vllm.destroy_fi_ar_workspace()
    return report


def quantised_calls_that_differ(rank: int, world: int, backend: str, tokens: int,
                                calls: list[tuple[Any, ...]]) -> dict[str, str]:
    """Rank r calls with ``calls[min(r, len - 1)]`` as (quant, layout[, group_size]),
    ``tokens`` rows of bf16 on an op of capacity 4 on ``backend``: how that call and a
    matching one after it end on this rank."""
    import arfuse

    hidden = 64
    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=hidden, dtype=torch.bfloat16,
                                 backend=backend, timeout_s=30.0)
    quant, layout, *group = calls[min(rank, len(calls) - 1)]
    x = torch.ones(tokens, hidden, dtype=torch.bfloat16)
    weight = torch.ones(hidden, dtype=torch.bfloat16)
    scale = None if quant in (None, "fp8_dynamic", "fp8_group") else 0.5
    extra = {"group_size": group[0]} if group else {}
    report: dict[str, str] = {"backend": comm.backend}
    try:
        comm(x, weight=weight, quant=quant, scale=scale, layout=layout, **extra)
        report["call"] = "returned"
    except Exception as exc:  # the test checks the class and the text
        report["call"] = f"{type(exc).__name__}: {exc}"
    after = comm(x, weight=weight, quant="fp8", scale=0.5)
    report["after"] = f"{after.quant_out.float()[0, 0].item():g}"
    report["stats"] = repr(comm.stats())
    comm.close()
    return report


def backend_registered_on_one_rank(rank: int, world: int) -> str:
    """Rank 0 registers a backend the others lack, then every rank makes an op."""
    import arfuse

    if rank == 0:
        arfuse.register(arfuse.BackendDescriptor(
            name="extra", fused=True, devices=("cpu",), auto_rank=None,
            implementation="arfuse.backends.torch.workspace:TorchBackend"))
    return _outcome(lambda: arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64,
                                                  dtype=torch.float32, timeout_s=30.0))


def backend_registered_with_other_fields(rank: int, world: int, field: str) -> str:
    """Every rank registers a backend of the same name whose ``field`` differs between the
    ranks (``auto_rank``: auto would try it first on rank 0 only; ``unmet``: it could run on
    rank 1 only, where auto tries it first), then every rank makes an op."""
    import arfuse
    from arfuse.catalog import Footprint

    kinds: dict[str, Any] = {
        "auto_rank": {"auto_rank": -1 if rank == 0 else None},
        "unmet": {"unmet": (lambda topology, spec: "") if rank == 1 else
                  (lambda topology, spec: "needs a part this host lacks"),
                  "auto_rank": -1},
    }
    arfuse.register(arfuse.BackendDescriptor(
        name="extra", fused=True, devices=("cpu",),
        implementation="arfuse.backends.torch.workspace:TorchBackend",
        fuses=lambda topology, spec, pattern: True,
        footprint=lambda world, spec, topology: Footprint(0, spec.max_tokens), **kinds[field]))
    return _outcome(lambda: arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64,
                                                  dtype=torch.float32, timeout_s=15.0))


def unfused_backend_blocked(rank: int, world: int) -> str:
    """``torch.probe@1=raise`` with ARFUSE_BACKEND=torch: the one backend asked for is blocked
    on rank 1."""
    import arfuse

    return _outcome(lambda: arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64,
                                                  dtype=torch.float32, timeout_s=30.0))


def ops_called_in_other_orders(rank: int, world: int, backend: str,
                               hidden_b: int) -> dict[str, Any]:
    """Two ops on one group, A (hidden 64) and B (``hidden_b``: 64 shares A's workspace);
    rank 0 calls A then B, the others B then A. What each call gave, what a call of each op
    gave afterwards, and a fresh op after ``destroy_all``."""
    import arfuse

    def make(hidden: int) -> Any:
        return arfuse.FusedAllReduce(max_token_num=8, hidden_dim=hidden, dtype=torch.float32,
                                     backend=backend, strict=backend != "torch",
                                     timeout_s=30.0)

    def call(op: Any, hidden: int) -> str:
        try:
            out = op(torch.full((2, hidden), float(rank + 1))).out
        except Exception as exc:  # the test checks the class and the text
            return f"{type(exc).__name__}: {exc}"
        return f"{out[0, 0].item():g}"

    ops = {"A": (make(64), 64), "B": (make(hidden_b), hidden_b)}
    order = ["A", "B"] if rank == 0 else ["B", "A"]
    report: dict[str, Any] = {"path": getattr(ops["A"][0].workspace, "path", backend),
                              "shared": ops["A"][0].workspace is ops["B"][0].workspace}
    report["first"] = call(*ops[order[0]])
    report["second"] = call(*ops[order[1]])
    report["A after"] = call(*ops["A"])
    report["B after"] = call(*ops["B"])
    arfuse.destroy_all()
    report["fresh"] = call(make(hidden_b), hidden_b)
    arfuse.destroy_all()
    return report


def ranks_in_different_modes(rank: int, world: int) -> dict[str, str]:
    """Rank 1 forces two-shot through the workspace's test hook, rank 0 keeps one-shot."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 backend="shm", strict=True, timeout_s=30.0)
    if rank == 1:
        comm.workspace.set_mode("twoshot")  # type: ignore[attr-defined]
    report: dict[str, str] = {}
    try:
        comm(torch.ones(4, 64))
        report["call"] = "returned"
    except Exception as exc:  # the test checks the class and the text
        report["call"] = f"{type(exc).__name__}: {exc}"
    comm.workspace.set_mode(None)  # type: ignore[attr-defined]
    report["after"] = f"{comm(torch.ones(1, 64)).out[0, 0].item():g}"
    comm.close()
    return report


def store_keys_after_a_call_timeout(rank: int, world: int) -> dict[str, bool]:
    """Rank 0's torch call times out (rank 1 never calls): whether the key it left in the
    group's store is there, and whether it is still there once the next op has been made."""
    import time

    import torch.distributed as dist

    import arfuse

    store = dist.distributed_c10d._get_process_group_store(dist.group.WORLD)
    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 backend="torch", timeout_s=1.0)
    key = f"arfuse/{comm.workspace.ctx.key}/timeout/call-signature/1/0"
    report: dict[str, bool] = {}
    if rank == 0:
        try:
            comm(torch.ones(2, 64))
        except arfuse.CallTimeout:
            report["timed out"] = True
        report["left"] = store.check([key])
    else:
        time.sleep(4.0)  # past rank 0's timeout and its look at the others
    # the next ops of the group (shm: no collective on the process group)
    for _ in range(2):
        arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                              backend="shm", timeout_s=30.0).close()
    report["after"] = store.check([key])
    return report


def contexts_left_after_a_local_error(rank: int, world: int) -> dict[str, int]:
    """Rank 1 makes its op with a bad hidden size; with the cyclic collector off, how many
    group contexts and members each rank still holds once the error is handled (0: nothing
    waits for a garbage collection)."""
    import gc

    import arfuse
    from arfuse.group import GroupContext, Member

    gc.collect()
    gc.disable()
    try:
        with contextlib.suppress(ValueError, arfuse.PeerAborted):
            arfuse.FusedAllReduce(max_token_num=8, hidden_dim=0 if rank == 1 else 64,
                                  dtype=torch.float32, timeout_s=30.0)
        left = sum(isinstance(o, (GroupContext, Member)) for o in gc.get_objects())
    finally:
        gc.enable()
    return {"left": left}


def one_call_per_epilogue(rank: int, world: int, backend: str) -> dict[str, Any]:
    """One bf16 call of each epilogue: its worst error relative to the float64 reference, and
    a digest of its outputs (the ranks must agree bit for bit)."""
    import arfuse
    from arfuse.digest import digest
    from arfuse.pattern import Pattern
    from arfuse.reference import expected

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=256, dtype=torch.bfloat16,
                                 backend=backend, strict=backend != "torch", timeout_s=30.0)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(5, 256, generator=gen).bfloat16() for _ in range(world)]
    residual = torch.randn(5, 256, generator=gen).bfloat16()
    weight = (torch.rand(256, generator=gen) + 0.5).bfloat16()
    report: dict[str, Any] = {"backend": comm.backend, "errors": {}, "digests": {}}
    for epilogue in ("none", "rmsnorm", "residual_rmsnorm"):
        pattern = Pattern(epilogue)
        kwargs: dict[str, Any] = {"weight": weight} if pattern.norm else {}
        if epilogue == "residual_rmsnorm":
            kwargs["residual"] = residual
        got = comm(xs[rank], **kwargs)
        want = expected(xs, pattern, residual, weight).out
        report["errors"][epilogue] = float(
            ((got.out.double() - want).abs().max() / want.abs().max()).item())
        report["digests"][epilogue] = digest(*got)
    comm.close()
    return report
