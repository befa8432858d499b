"""``arfuse run --pattern moe_finalize`` (or ``moe_reduce``): each rank's expert rows, the
fused MoE call, its outputs against the float64 reference of the whole group (every rank's
expert step without rounding, summed, then residual + RMSNorm), and the call timed against
torch's expert step followed by the unfused all-reduce + add + RMSNorm."""

from __future__ import annotations

from typing import Any

import torch

from ..digest import digest
from ..moe_workload import ExpertRows, expert_step_float64, make_expert_rows, torch_expert_step
from ..pattern import Pattern, quant_output
from ..quant import caller_scale
from ..reference import expected
from ..torch_types import TORCH_DTYPES, device_of
from .run_checks import (
    EPS,
    TOLERANCE,
    RunOptions,
    SizeResult,
    quant_matches,
    relative_error,
    rmsnorm,
    time_pair,
)

NONE_EVERY = 7
"""Every seventh (token, k) entry of the finalize index is -1 (an expert not on this rank),
so the job covers the skipped entries too."""
ROUTED = 2.5  # a routed scaling factor as DeepSeek-V3's


def _inputs(tokens: int, opts: RunOptions, gen: torch.Generator) -> ExpertRows:
    rows = make_expert_rows(opts.pattern, tokens, opts.hidden, opts.top_k, opts.experts,
                            TORCH_DTYPES[opts.dtype], gen, none_every=NONE_EVERY, routed=ROUTED)
    device = device_of(opts.device)
    return ExpertRows(rows.pattern, rows.rows.to(device), rows.scales.to(device),
                      None if rows.index is None else rows.index.to(device),
                      None if rows.add is None else rows.add.to(device), rows.routed)


def _group_reference(inputs: ExpertRows, world: int) -> list[torch.Tensor]:
    """Every rank's expert step in float64, gathered (each rank made its own rows)."""
    import torch.distributed as dist

    mine = expert_step_float64(ExpertRows(
        inputs.pattern, inputs.rows.cpu(), inputs.scales.cpu(),
        None if inputs.index is None else inputs.index.cpu(),
        None if inputs.add is None else inputs.add.cpu(), inputs.routed))
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return every


def check_moe_size(comm: Any, gamma: torch.Tensor, tokens: int, world: int, opts: RunOptions,
                   gen: torch.Generator, own_gen: torch.Generator) -> SizeResult:
    """One token count of the MoE job: the checks of the plain job, on a MoE call. ``gen``
    draws what every rank has alike (the residual), ``own_gen`` this rank's expert rows."""
    import torch.distributed as dist

    from ..quant import quantize

    dtype, device = TORCH_DTYPES[opts.dtype], device_of(opts.device)
    inputs = _inputs(tokens, opts, own_gen)
    residual = torch.randn(tokens, opts.hidden, generator=gen).to(dtype).to(device)
    first = inputs.call(comm, residual=residual, weight=gamma, eps=EPS)
    scale = caller_scale(quant_output(opts.quant), first.out.abs().max().float().item())
    result = inputs.call(comm, residual=residual, weight=gamma, eps=EPS, quant=opts.quant,
                         scale=scale)
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest(result.out, result.residual_out,
                                            result.quant_out, result.scale_out))
    want = expected(_group_reference(inputs, world), Pattern("residual_rmsnorm"),
                    residual.cpu(), gamma.cpu(), EPS)
    assert want.residual_out is not None and result.residual_out is not None
    out_err = relative_error(result.out, want.out)
    res_err = relative_error(result.residual_out, want.residual_out)
    quant_ok = quant_matches(result, opts.quant, scale)
    identical = len(set(digests)) == 1
    ok = identical and quant_ok and max(out_err, res_err) <= TOLERANCE[opts.dtype]

    def fused() -> None:
        inputs.call(comm, residual=residual, weight=gamma, eps=EPS, quant=opts.quant,
                    scale=scale)

    def unfused() -> None:
        summed = torch_expert_step(inputs)
        dist.all_reduce(summed)
        out = rmsnorm(summed + residual, gamma)
        if opts.quant:
            quantize(out, quant_output(opts.quant), scale)

    fused_us, unfused_us = time_pair(fused, unfused, opts.steps, residual.is_cuda)
    return SizeResult(tokens, out_err, res_err, identical, quant_ok, fused_us, unfused_us, ok)
