"""One rank of ``arfuse bench``: per dtype and size, every row timed side by side
(``timing.measure``), the floor's rates measured, each row's figures recorded; rank 0 returns
the report."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..moe_workload import make_expert_rows
from ..torch_types import TORCH_DTYPES
from .baselines import (
    clean_deepspeed_segments,
    deepspeed_path,
    deepspeed_rows,
    deepspeed_setup,
    torch_row,
)
from .floor import Rates, Traffic, measure_rates, moe_traffic, traffic
from .machine import machine_record
from .moe import FUSED_ROW, expert_bytes, moe_rows
from .options import BASELINE, EPS, OVER_CAPACITY, BenchOptions
from .overhead import python_overhead
from .timing import WARMUP, Row, measure, run_tag, slowest_medians, summary


@dataclass
class _Rank:
    """What one rank holds over the run, and what it has found so far."""

    opts: BenchOptions
    world: int
    ds: Any
    ds_note: str
    tag: int
    progress: Any
    gen: torch.Generator
    same_everywhere: torch.Generator  # the residual: replicated, as in TP
    results: list[dict[str, Any]] = field(default_factory=list)
    overhead: dict[str, Any] = field(default_factory=dict)
    negotiation: dict[str, Any] = field(default_factory=dict)
    copy_modes: dict[str, dict[str, str]] = field(default_factory=dict)


def _usable_cores() -> set[int]:
    import os

    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


def _progress(rank: int, opts: BenchOptions) -> Any:
    if rank != 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    import threading

    # tqdm's default lock is a multiprocessing semaphore, which a rank (ended by os._exit)
    # would leak; one process draws the bar, so a thread lock is enough
    tqdm.set_lock(threading.RLock())
    return tqdm(total=len(opts.dtypes) * len(opts.tokens), desc="arfuse bench", unit="size",
                file=sys.stderr)


def _fused_ops(st: _Rank, dname: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """The op on the shm backend (its negotiation timed), and one with a replicated residual."""
    import arfuse

    opts = st.opts
    t0 = time.perf_counter()
    comm = arfuse.FusedAllReduce(max_token_num=max(opts.tokens), hidden_dim=opts.hidden,
                                 dtype=dtype, backend="shm", strict=True)
    st.negotiation[dname] = {"seconds": time.perf_counter() - t0,
                             "path": getattr(comm.workspace, "path", "")}
    replicated = arfuse.FusedAllReduce(max_token_num=max(opts.tokens),
                                       hidden_dim=opts.hidden, dtype=dtype,
                                       backend="shm", strict=True,
                                       replicated_residual=True)
    return comm, replicated


def _unfused_ops(st: _Rank, dtype: torch.dtype) -> dict[str, Any]:
    """The ops of the rows ``arfuse-torch`` and ``shm-over``, where ``--backends`` names
    them."""
    import arfuse

    opts = st.opts
    ops: dict[str, Any] = {}
    if "arfuse-torch" in opts.backends:
        ops["arfuse-torch"] = arfuse.FusedAllReduce(
            max_token_num=max(opts.tokens), hidden_dim=opts.hidden, dtype=dtype,
            backend="torch", strict=True)
    if "shm-over" in opts.backends:
        ops["shm-over"] = arfuse.FusedAllReduce(max_token_num=OVER_CAPACITY,
                                                hidden_dim=opts.hidden, dtype=dtype,
                                                backend="shm", strict=True)
    return ops


def _unfused_rows(ops: dict[str, Any], tokens: int, work: torch.Tensor,
                  res_work: torch.Tensor, weight: torch.Tensor, reset_both: Any,
                  q: dict[str, Any]) -> dict[str, Row]:
    """Each of ``ops`` called in place, as the user's two lines run."""
    return {name: (lambda c=op, x=work, r=res_work, w=weight: c(
                x, residual=r, weight=w, eps=EPS, out=x, residual_out=r, **q), reset_both)
            for name, op in ops.items() if name != "shm-over" or tokens > OVER_CAPACITY}


def _resets(x: torch.Tensor, work: torch.Tensor, residual: torch.Tensor,
            res_work: torch.Tensor) -> tuple[Any, Any]:
    """What restores a row's inputs before each call: ``work`` alone, or with ``res_work``."""

    def reset(work: torch.Tensor = work, x: torch.Tensor = x) -> None:
        work.copy_(x)

    def reset_both(work: torch.Tensor = work, x: torch.Tensor = x,
                   res_work: torch.Tensor = res_work, residual: torch.Tensor = residual) -> None:
        work.copy_(x)
        res_work.copy_(residual)

    return reset, reset_both


def _shm_rows(comm: Any, replicated: Any, x: torch.Tensor, work: torch.Tensor,
              residual: torch.Tensor, res_work: torch.Tensor, weight: torch.Tensor,
              resets: tuple[Any, Any], q: dict[str, Any]) -> dict[str, Row]:
    """The fused op's rows: new outputs, in place, from the shared slot, replicated (``q``:
    the quantisation's keywords, ``BenchOptions.quant_keywords``)."""
    reset, reset_both = resets
    slot: list[torch.Tensor] = []

    def into_slot(c: Any = comm, x: torch.Tensor = x, slot: list[torch.Tensor] = slot,
                  res_work: torch.Tensor = res_work, residual: torch.Tensor = residual) -> None:
        # the layer writes its output into the shared slot
        slot[:] = [c.input_buffer(x.shape[0])]
        slot[0].copy_(x)
        res_work.copy_(residual)

    return {
        "shm": (lambda c=comm, x=work, r=residual, w=weight: c(
            x, residual=r, weight=w, eps=EPS, **q), reset),
        "shm-inplace": (lambda c=comm, x=work, r=res_work, w=weight: c(
            x, residual=r, weight=w, eps=EPS, out=x, residual_out=r, **q), reset_both),
        "shm-slot": (lambda c=comm, s=slot, r=res_work, w=weight: c(
            s[0], residual=r, weight=w, eps=EPS, residual_out=r, **q), into_slot),
        "shm-replicated": (lambda c=replicated, x=work, r=residual, w=weight: c(
            x, residual=r, weight=w, eps=EPS, **q), reset),
        "shm-inplace-replicated": (lambda c=replicated, x=work, r=res_work, w=weight: c(
            x, residual=r, weight=w, eps=EPS, out=x, residual_out=r, **q), reset_both)}


def _unfused_quantisation(opts: BenchOptions) -> Any:
    """What the unfused rows run after their RMSNorm with ``--quant``: the torch epilogue's
    quantisation step (None without)."""
    if opts.quant is None:
        return None
    from ..pattern import quant_output
    from ..quant import quantize

    output = quant_output(opts.quant, opts.scale_format)
    return lambda out: quantize(out, output, None, opts.group_size or 0)


def _entry(st: _Rank, dname: str, tokens: int, backend: str, size: int, times: list[float],
           faults: int, mode: str, rates: Rates, moved: Traffic | None) -> dict[str, Any]:
    """One row's figures at one size: times, page faults, and its floor where it has one
    (``moved``: the bytes the row must move, None: no floor stated)."""
    stats = summary(times)
    entry: dict[str, Any] = {"dtype": dname, "tokens": tokens, "backend": backend,
                             "bytes_per_rank": size, **stats,
                             "page_faults_per_call": faults / len(times)}
    if moved is not None:
        floor_us = rates.floor_s(moved) * 1e6
        entry.update(moved_bytes=moved.total, traffic=asdict(moved),
                     copy_gib_s=rates.copy / 2**30,
                     fresh_write_gib_s=rates.fresh_write / 2**30,
                     floor_us=floor_us, x_floor=stats["median_us"] / floor_us)
        measured_s = rates.measured_floor_s(moved)
        if measured_s is not None and rates.peer is not None:
            entry.update(peer_read_gib_s=rates.peer.read / 2**30,
                         shared_write_gib_s=rates.peer.shared_write / 2**30,
                         measured_floor_us=measured_s * 1e6,
                         x_measured_floor=stats["median_us"] / (measured_s * 1e6))
    if backend.startswith("shm"):
        entry["mode"] = mode
    if backend.startswith("deepspeed"):
        entry["path"] = deepspeed_path(dname, st.ds_note)
    return entry


def _run_size(st: _Rank, dname: str, dtype: torch.dtype, tokens: int, weight: torch.Tensor,
              comm: Any, replicated: Any, unfused: dict[str, Any]) -> None:
    """Every row at one token count, timed side by side, then the floor's rates."""
    opts = st.opts
    x = torch.randn(tokens, opts.hidden, generator=st.gen).to(dtype)
    residual = torch.randn(tokens, opts.hidden, generator=st.same_everywhere).to(dtype)
    work = x.clone()  # what a row reads and may overwrite
    res_work = residual.clone()
    resets = _resets(x, work, residual, res_work)
    candidates: dict[str, Row] = {}
    mode = "twoshot"
    if comm is not None:
        mode = comm.workspace.mode(tokens)
        candidates.update(_shm_rows(comm, replicated, x, work, residual, res_work, weight,
                                    resets, opts.quant_keywords()))
    after = _unfused_quantisation(opts)
    if "torch" in opts.backends:
        candidates["torch"] = torch_row(work, res_work, weight, resets[1], after)
    candidates.update(_unfused_rows(unfused, tokens, work, res_work, weight, resets[1],
                                    opts.quant_keywords()))
    if st.ds is not None:
        candidates.update(deepspeed_rows(st.ds, work, res_work, weight, resets[1], after))
    # the shm rows warm up past the copy-mode trial: timed calls run the chosen mode
    workspace: Any = None if comm is None else comm.workspace
    trial = 0 if workspace is None else workspace.copy_trial_calls
    rows, faults = measure(candidates, opts, WARMUP + trial)
    size = tokens * opts.hidden * x.element_size()
    rates = measure_rates(size, st.tag)
    slowest = slowest_medians(rows)
    for backend, times in rows.items():
        entry = _entry(st, dname, tokens, backend, size, times, faults[backend], mode, rates,
                       traffic(backend, size, st.world, mode))
        entry["slowest_rank_median_us"] = slowest[backend]
        st.results.append(entry)


def _run_moe_size(st: _Rank, dname: str, dtype: torch.dtype, tokens: int,
                  weight: torch.Tensor, comm: Any) -> None:
    """A MoE bench's rows at one token count (``bench.moe``): the fused call and torch's
    expert step before each unfused path, timed side by side, then the floor's rates for the
    call's whole working set."""
    opts = st.opts
    inputs = make_expert_rows(opts.pattern, tokens, opts.hidden, opts.top_k, opts.experts,
                              dtype, st.gen)
    residual = torch.randn(tokens, opts.hidden, generator=st.same_everywhere).to(dtype)
    candidates = moe_rows(comm, inputs, residual, weight, st.ds, "torch" in opts.backends)
    mode = "twoshot" if comm is None else comm.workspace.mode(tokens)
    trial = 0 if comm is None else comm.workspace.copy_trial_calls
    rows, faults = measure(candidates, opts, WARMUP + trial)
    size = tokens * opts.hidden * residual.element_size()
    rows_bytes, add_bytes = expert_bytes(inputs)
    rates = measure_rates(size + rows_bytes, st.tag)
    for backend, times in rows.items():
        moved = moe_traffic(size, rows_bytes, add_bytes, st.world) if backend == FUSED_ROW \
            else None
        st.results.append(_entry(st, dname, tokens, backend, size, times, faults[backend],
                                 mode, rates, moved))


def _run_dtype(st: _Rank, dname: str) -> None:
    """Every size of one dtype, then the op's Python overhead and the copy modes it chose."""
    dtype = TORCH_DTYPES[dname]
    comm = replicated = None
    if "shm" in st.opts.backends:
        comm, replicated = _fused_ops(st, dname, dtype)
    weight = (torch.rand(st.opts.hidden, generator=st.gen) + 0.5).to(dtype)
    moe = st.opts.pattern != "residual_rmsnorm"
    unfused = {} if moe else _unfused_ops(st, dtype)
    for tokens in st.opts.tokens:
        if moe:
            _run_moe_size(st, dname, dtype, tokens, weight, comm)
        else:
            _run_size(st, dname, dtype, tokens, weight, comm, replicated, unfused)
        if st.progress is not None:
            st.progress.update(1)
    if comm is not None and not moe:
        st.overhead[dname] = python_overhead(comm, weight, st.opts.hidden)
        st.copy_modes[dname] = {str(size): mode for size, mode in
                                comm.workspace.copy_modes().items()}
    if comm is not None:
        comm.close()
    for op in unfused.values():
        op.close()
    if replicated is not None:
        replicated.close()


def bench_body(rank: int, world: int, opts: BenchOptions) -> dict[str, Any] | None:
    """One rank's run (collective: every rank calls it); the report on rank 0, else None."""
    import torch.distributed as dist

    from ..launch import init_from_env, pin_to_core

    torch.set_num_threads(opts.threads)
    ds, ds_note = (None, "not requested")
    if "deepspeed" in opts.backends:
        ds, ds_note = deepspeed_setup(rank)
    init_from_env("cpu")
    # after init: gloo's threads stay free (see pin_to_core)
    pinned = pin_to_core(rank, world, opts.threads)
    if not pinned and rank == 0:
        from ..log import logger

        logger.warning("arfuse bench: ranks not pinned: %d ranks x %d threads need %d cores, "
                       "this process may use %d; the figures include their contention",
                       world, opts.threads, world * opts.threads, len(_usable_cores()))
    progress = _progress(rank, opts)
    st = _Rank(opts=opts, world=world, ds=ds, ds_note=ds_note, tag=run_tag(),
               progress=progress, gen=torch.Generator().manual_seed(1234 + rank),
               same_everywhere=torch.Generator().manual_seed(4321))
    for dname in opts.dtypes:
        _run_dtype(st, dname)
    if progress is not None:
        progress.close()
    dist.barrier()
    if rank != 0:
        return None
    report = {"machine": machine_record(pinned, world, opts.threads), "options": asdict(opts),
              "deepspeed": ds_note, "baseline": BASELINE, "results": st.results,
              "python_overhead": st.overhead, "negotiation": st.negotiation,
              "copy_modes": st.copy_modes}
    if ds is not None:
        clean_deepspeed_segments()
    return report
