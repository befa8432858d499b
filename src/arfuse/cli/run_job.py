"""The job ``arfuse run`` starts on every rank (``cli/run.py`` checks its flags and starts the
ranks): the row-parallel layer, the fused call checked against the float64 reference of the
whole layer, and both paths timed side by side. Apart from the verb so that a bad flag is
refused before torch is imported."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..digest import digest
from ..pattern import Pattern, quant_output
from ..quant import caller_scale
from ..reference import expected
from ..torch_types import TORCH_DTYPES, device_of
from .run import in_features
from .run_checks import (
    EPS,
    TOLERANCE,
    RunOptions,
    SizeResult,
    quant_matches,
    relative_error,
    rmsnorm,
    rounds_of,
    time_pair,
)


def _say(rank: int, text: str = "") -> None:
    if rank == 0:
        print(text, flush=True)


@dataclass(frozen=True)
class _Layer:
    """The row-parallel linear layer: the whole weight (for the reference), this rank's column
    shard of it, and the norm's weight."""

    weight_full: torch.Tensor
    weight_shard: torch.Tensor
    gamma: torch.Tensor
    width: int
    shard: int


def _make_layer(rank: int, world: int, opts: RunOptions, gen: torch.Generator) -> _Layer:
    dtype, device = TORCH_DTYPES[opts.dtype], device_of(opts.device)
    width = in_features(opts.hidden, world)
    shard = width // world
    weight_full = (torch.randn(opts.hidden, width, generator=gen) / math.sqrt(width)).to(dtype)
    gamma = (torch.rand(opts.hidden, generator=gen) + 0.5).to(dtype).to(device)
    weight_shard = weight_full[:, rank * shard:(rank + 1) * shard].contiguous().to(device)
    return _Layer(weight_full, weight_shard, gamma, width, shard)


def _check_size(comm: Any, layer: _Layer, tokens: int, rank: int, world: int, opts: RunOptions,
                gen: torch.Generator) -> SizeResult:
    """One token count: the layer on every rank, the fused op, its outputs against the float64
    reference of the whole layer in one process, then both paths timed."""
    import torch.distributed as dist

    dtype, device = TORCH_DTYPES[opts.dtype], device_of(opts.device)
    act = torch.randn(tokens, layer.width, generator=gen).to(dtype)
    residual = torch.randn(tokens, opts.hidden, generator=gen).to(dtype).to(device)
    a_shard = act[:, rank * layer.shard:(rank + 1) * layer.shard].contiguous().to(device)
    partial = a_shard @ layer.weight_shard.t()
    first = comm(partial, residual=residual, weight=layer.gamma, eps=EPS)
    scale = caller_scale(quant_output(opts.quant, opts.scale_format),
                         first.out.abs().max().float().item())
    result = comm(partial, residual=residual, weight=layer.gamma, eps=EPS, quant=opts.quant,
                  scale=scale, **quant_keywords(opts))
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest(result.out, result.residual_out,
                                            result.quant_out, result.scale_out))
    identical = len(set(digests)) == 1
    want = expected([act.double().cpu() @ layer.weight_full.double().cpu().t()],
                    Pattern("residual_rmsnorm"), residual.cpu(), layer.gamma.cpu(), EPS)
    assert want.residual_out is not None and result.residual_out is not None
    out_err = relative_error(result.out, want.out)
    res_err = relative_error(result.residual_out, want.residual_out)
    quant_ok = quant_matches(result, opts.quant, scale, opts.group_size, opts.scale_format)
    ok = identical and quant_ok and max(out_err, res_err) <= TOLERANCE[opts.dtype]
    fused_us, unfused_us = _time_side_by_side(comm, partial, residual, layer.gamma, opts, scale)
    return SizeResult(tokens, out_err, res_err, identical, quant_ok, fused_us, unfused_us, ok)


def _print_table(rank: int, world: int, rows: list[SizeResult], opts: RunOptions,
                 stats: Any) -> None:
    _say(rank, "")
    _say(rank, f"{'tokens':>7} {'max err':>9} {'resid err':>9} {'identical':>9} "
         f"{'quant':>5} {'fused us':>10} {'unfused us':>10} {'speedup':>8}  check")
    for r in rows:
        _say(rank, f"{r.tokens:>7} {r.out_err:>9.2e} {r.res_err:>9.2e} "
             f"{'yes' if r.identical else 'NO':>9} "
             f"{('ok' if r.quant_ok else 'BAD') if opts.quant else '-':>5} {r.fused_us:>10.1f} "
             f"{r.unfused_us:>10.1f} {r.unfused_us / r.fused_us:>7.1f}x  "
             f"{'ok' if r.ok else 'MISMATCH'}")
    _say(rank, f"\nworld size {world}, hidden {opts.hidden}, {opts.dtype}, quant "
         f"{opts.quant or 'none'}, {math.prod(rounds_of(opts.steps))} timed steps per size "
         f"and path; latency = median per call on "
         f"rank 0; unfused = torch.distributed all_reduce + add + RMSNorm"
         f"{' + quantisation' if opts.quant else ''}{_moe_words(opts)}; stats {stats}")


def _moe_words(opts: RunOptions) -> str:
    if opts.pattern == "residual_rmsnorm":
        return ""
    what = (f"top_k {opts.top_k} of {opts.experts} experts, a shared expert"
            if opts.pattern == "moe_finalize" else f"{opts.top_k} experts' rows")
    return (f"; {opts.pattern} ({what}), fused, against torch's expert step (gather + bmm) "
            "before the unfused path")


def run_body(rank: int, world: int, opts: RunOptions) -> int:
    import torch.distributed as dist

    import arfuse

    from ..launch import init_from_env, pin_to_core

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world) if opts.device == "cpu" else 1)
    init_from_env(opts.device)
    pinned = pin_to_core(rank, world) if opts.device == "cpu" else False
    comm = arfuse.FusedAllReduce(max_token_num=max(opts.tokens), hidden_dim=opts.hidden,
                                 dtype=TORCH_DTYPES[opts.dtype], backend=opts.backend,
                                 quant=opts.quant, strict=opts.strict, device=opts.device)
    _say(rank, comm.plan.explain())
    _say(rank, f"negotiated: {comm.backend} ({'; '.join(a.describe() for a in comm.attempts)})"
         f"{'; ranks pinned to cores' if pinned else ''}"
         f"{'; residual promised the same on every rank' if comm.replicated_residual else ''}")
    gen = torch.Generator().manual_seed(20261129)
    layer = _make_layer(rank, world, opts, gen)
    if opts.pattern == "residual_rmsnorm":
        rows = [_check_size(comm, layer, tokens, rank, world, opts, gen)
                for tokens in opts.tokens]
    else:
        from .run_moe import check_moe_size

        # each rank's expert rows are its own; the residual is every rank's alike, as in TP
        own_gen = torch.Generator().manual_seed(20261129 + 7919 * (rank + 1))
        rows = [check_moe_size(comm, layer.gamma, tokens, world, opts, gen, own_gen)
                for tokens in opts.tokens]
    _print_table(rank, world, rows, opts, comm.stats())
    comm.close()
    dist.barrier()
    failures = sum(not r.ok for r in rows)
    if failures:
        print(f"arfuse run: rank {rank}: {failures} size(s) did not match the reference",
              file=sys.stderr, flush=True)
        return 1
    return 0


def quant_keywords(opts: RunOptions) -> dict[str, Any]:
    """The call's ``layout`` (``--scale-format``) and ``group_size`` (``--group-size``),
    where given."""
    kwargs: dict[str, Any] = {}
    if opts.scale_format is not None:
        kwargs["layout"] = opts.scale_format
    if opts.group_size is not None:
        kwargs["group_size"] = opts.group_size
    return kwargs


def _time_side_by_side(comm: Any, partial: torch.Tensor, residual: torch.Tensor,
                       gamma: torch.Tensor, opts: RunOptions,
                       scale: float | None) -> tuple[float, float]:
    """Median microseconds of the fused op and of the unfused path (``time_pair``)."""
    import torch.distributed as dist

    from ..quant import quantize

    def fused() -> None:
        comm(partial, residual=residual, weight=gamma, eps=EPS, quant=opts.quant, scale=scale,
             **quant_keywords(opts))

    def unfused() -> None:
        summed = partial.clone()
        dist.all_reduce(summed)
        pre = summed + residual
        out = rmsnorm(pre, gamma)
        if opts.quant:
            quantize(out, quant_output(opts.quant, opts.scale_format), scale,
                     opts.group_size or 0)

    return time_pair(fused, unfused, opts.steps, partial.is_cuda)
