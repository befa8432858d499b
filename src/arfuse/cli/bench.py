"""``arfuse bench``: latency sweep of the fused op against what users run without arfuse.

Rows, measured side by side in one run on the same ranks (each rank's main thread pinned to one
core, after the process group exists so gloo's I/O threads are not confined with it, when the
machine has a core per rank; one torch thread; warm-up excluded). Before every call, untimed,
each row's input is written afresh, as a layer's output would be (and what a row updates in
place is restored), so every row starts from the same cache state:

* ``shm``: arfuse's fused all-reduce + residual + RMSNorm on the shm backend, new output
  tensors;
* ``shm-inplace``: the same in place, ``out=x`` and ``residual_out=residual`` (as vLLM's
  ``fused_add_rms_norm``): no fresh output buffers to pull into the cache;
* ``shm-slot``: in place, with the layer's output written straight into the rank's shared
  input slot (``FusedAllReduce.input_buffer``), which also saves the copy into shared memory;
* ``shm-replicated``, ``shm-inplace-replicated``: ``shm`` and ``shm-inplace`` with
  ``replicated_residual=True`` (the residual is the same on every rank here, as in tensor
  parallelism): two-shot sizes finish other ranks' rows from their ``residual_out``;
* ``torch``: ``torch.distributed.all_reduce`` (gloo) + eager add + RMSNorm: the baseline;
* ``deepspeed``: ``deepspeed.comm.inference_all_reduce`` alone, and ``deepspeed+norm`` with the
  eager add + RMSNorm, when deepspeed is importable.

Also measured: arfuse's Python overhead per call on top of the kernel (see ``_overhead``),
negotiation time, page faults per timed call, and each row's memory floor: the bytes it must
move (``traffic``) at one core's copy rate, and each kind of byte at its own rate measured in
the same run (``Rates``: lines shared with a peer's core, both ways; new output tensors).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..log import logger
from ..torch_types import TORCH_DTYPES
from . import args as cli_args

EPS = 1e-6
BASELINE = "torch"


@dataclass(frozen=True)
class BenchOptions:
    world_size: int
    tokens: tuple[int, ...]
    hidden: int
    dtypes: tuple[str, ...]
    backends: tuple[str, ...]
    out: str
    min_seconds: float = 0.3
    max_iters: int = 400


def _iters(seconds_per_call: float, opts: BenchOptions) -> int:
    return int(min(opts.max_iters, max(10, opts.min_seconds / max(seconds_per_call, 1e-7))))


def _rmsnorm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    pre = x + residual
    pf = pre.float()
    return (pf * torch.rsqrt(pf.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).to(x.dtype)


ROUNDS = 5
WARMUP = 5


def _measure(rows: dict[str, tuple[Any, Any]], opts: BenchOptions, shm_warmup: int = WARMUP
             ) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Per-call microseconds of every row, after warm-up, interleaved in rounds so that drift
    of a shared machine hits every row alike, and the page faults of its timed calls. Every
    rank runs the same counts (collectives)."""
    import torch.distributed as dist

    counts: dict[str, int] = {}
    for name, (fn, reset) in rows.items():
        for _ in range(shm_warmup if name.startswith("shm") else WARMUP):
            if reset:
                reset()
            fn()
        if reset:
            reset()
        start = time.perf_counter()
        fn()
        probe = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)
        counts[name] = max(2, _iters(float(probe.item()), opts) // ROUNDS)
    times: dict[str, list[float]] = {name: [] for name in rows}
    faults: dict[str, int] = dict.fromkeys(rows, 0)
    dist.barrier()
    for _ in range(ROUNDS):
        for name, (fn, reset) in rows.items():
            for _ in range(counts[name]):
                if reset:
                    reset()
                f0 = _minor_faults()
                t0 = time.perf_counter_ns()
                fn()
                elapsed = time.perf_counter_ns() - t0
                faults[name] += _minor_faults() - f0
                times[name].append(elapsed / 1e3)
    return times, faults


def _run_tag() -> int:
    """A number every rank of this run agrees on (rank 0's pid): names the run's files."""
    import torch.distributed as dist

    tag = torch.tensor([os.getpid()], dtype=torch.int64)
    dist.broadcast(tag, 0)
    return int(tag.item())


def _minor_faults() -> int:
    """Page faults of this process so far: a row whose outputs come from fresh pages pays
    them inside its call (the allocator returned the previous call's memory to the system)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median_us": statistics.median(ordered),
            "p90_us": ordered[min(len(ordered) - 1, int(0.9 * (len(ordered) - 1) + 0.5))],
            "iters": len(ordered)}


def _deepspeed_setup(rank: int) -> tuple[Any, str]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        import deepspeed.comm as ds_dist
        from deepspeed.comm import comm as ds_comm
    except Exception as exc:
        return None, f"deepspeed not importable: {type(exc).__name__}: {exc}"
    # DeepSpeed's shm op reads LOCAL_SIZE (torchrun sets LOCAL_WORLD_SIZE) and crashes
    # without it
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE",
                                                       os.environ.get("WORLD_SIZE", "1")))
    deepspeed.init_distributed(dist_backend="gloo")
    level = getattr(ds_comm.cdb, "shm_vector_kernel_level", None)
    return ds_dist, f"deepspeed {deepspeed.__version__}, shm kernel level {level}"


def _deepspeed_path(dtype: str, note: str) -> str:
    """DeepSpeed's CPU guard: fp32 needs kernel level 1 (AVX2), bf16/fp16 level 2 (AVX-512)."""
    try:
        level = int(note.rsplit(" ", 1)[-1])
    except ValueError:
        return "unknown"
    need = 1 if dtype == "fp32" else 2
    return "shm kernel" if level >= need else "gloo fallback (no AVX-512 for 16-bit here)"


def bench_body(rank: int, world: int, opts: BenchOptions) -> int:
    import torch.distributed as dist

    import arfuse

    from ..launch import init_from_env, pin_to_core

    torch.set_num_threads(1)
    ds, ds_note = (None, "not requested")
    if "deepspeed" in opts.backends:
        ds, ds_note = _deepspeed_setup(rank)
    init_from_env("cpu")
    pinned = pin_to_core(rank, world)  # after init: gloo's threads stay free (see pin_to_core)
    progress = _progress(rank, opts)
    run_tag = _run_tag()
    results: list[dict[str, Any]] = []
    overhead: dict[str, Any] = {}
    negotiation: dict[str, Any] = {}
    copy_modes: dict[str, dict[str, str]] = {}
    gen = torch.Generator().manual_seed(1234 + rank)
    same_everywhere = torch.Generator().manual_seed(4321)  # the residual: replicated, as in TP
    for dname in opts.dtypes:
        dtype = TORCH_DTYPES[dname]
        comm = replicated = None
        if "shm" in opts.backends:
            t0 = time.perf_counter()
            comm = arfuse.FusedAllReduce(max_token_num=max(opts.tokens), hidden_dim=opts.hidden,
                                         dtype=dtype, backend="shm", strict=True)
            negotiation[dname] = {"seconds": time.perf_counter() - t0,
                                  "path": getattr(comm.workspace, "path", "")}
            replicated = arfuse.FusedAllReduce(max_token_num=max(opts.tokens),
                                               hidden_dim=opts.hidden, dtype=dtype,
                                               backend="shm", strict=True,
                                               replicated_residual=True)
        weight = (torch.rand(opts.hidden, generator=gen) + 0.5).to(dtype)
        for tokens in opts.tokens:
            x = torch.randn(tokens, opts.hidden, generator=gen).to(dtype)
            residual = torch.randn(tokens, opts.hidden, generator=same_everywhere).to(dtype)
            work = x.clone()  # what a row reads and may overwrite
            res_work = residual.clone()

            def reset(work: torch.Tensor = work, x: torch.Tensor = x) -> None:
                work.copy_(x)

            def reset_both(work: torch.Tensor = work, x: torch.Tensor = x,
                           res_work: torch.Tensor = res_work,
                           residual: torch.Tensor = residual) -> None:
                work.copy_(x)
                res_work.copy_(residual)

            candidates: dict[str, tuple[Any, Any]] = {}
            mode = "twoshot"
            if comm is not None:
                mode = comm.workspace.mode(tokens)  # type: ignore[attr-defined]
                candidates["shm"] = (lambda c=comm, x=work, r=residual, w=weight: c(
                    x, residual=r, weight=w, eps=EPS), reset)
                candidates["shm-inplace"] = (lambda c=comm, x=work, r=res_work, w=weight: c(
                    x, residual=r, weight=w, eps=EPS, out=x, residual_out=r), reset_both)
                slot: list[torch.Tensor] = []

                def into_slot(c: Any = comm, x: torch.Tensor = x,
                              slot: list[torch.Tensor] = slot, res_work: torch.Tensor = res_work,
                              residual: torch.Tensor = residual) -> None:
                    # the layer writes its output into the shared slot
                    slot[:] = [c.input_buffer(x.shape[0])]
                    slot[0].copy_(x)
                    res_work.copy_(residual)

                candidates["shm-slot"] = (lambda c=comm, s=slot, r=res_work, w=weight: c(
                    s[0], residual=r, weight=w, eps=EPS, residual_out=r), into_slot)
                candidates["shm-replicated"] = (lambda c=replicated, x=work, r=residual,
                                                w=weight: c(x, residual=r, weight=w, eps=EPS),
                                                reset)
                candidates["shm-inplace-replicated"] = (
                    lambda c=replicated, x=work, r=res_work, w=weight: c(
                        x, residual=r, weight=w, eps=EPS, out=x, residual_out=r), reset_both)
            if "torch" in opts.backends:
                candidates["torch"] = (lambda w_=work, r=residual, w=weight: _rmsnorm_add(
                    _all_reduce(dist, w_), r, w), reset)
            if ds is not None:
                candidates["deepspeed"] = (lambda w_=work: ds.inference_all_reduce(w_), reset)
                candidates["deepspeed+norm"] = (
                    lambda w_=work, r=residual, w=weight: _rmsnorm_add(
                        _ds_all_reduce(ds, w_), r, w), reset)
            # the shm rows warm up past the copy-mode trial: timed calls run the chosen mode
            workspace: Any = None if comm is None else comm.workspace
            trial = 0 if workspace is None else workspace.copy_trial_calls
            rows, faults = _measure(candidates, opts, WARMUP + trial)
            size = tokens * opts.hidden * x.element_size()
            rates = measure_rates(size, run_tag)
            for backend, times in rows.items():
                summary = _summary(times)
                entry: dict[str, Any] = {"dtype": dname, "tokens": tokens, "backend": backend,
                                         "bytes_per_rank": size, **summary,
                                         "page_faults_per_call": faults[backend] / len(times)}
                moved = traffic(backend, size, world, mode)
                if moved is not None:
                    floor_us = rates.floor_s(moved) * 1e6
                    entry.update(moved_bytes=moved.total, traffic=asdict(moved),
                                 copy_gib_s=rates.copy / 2**30,
                                 fresh_write_gib_s=rates.fresh_write / 2**30,
                                 floor_us=floor_us, x_floor=summary["median_us"] / floor_us)
                    measured_s = rates.measured_floor_s(moved)
                    if measured_s is not None and rates.peer is not None:
                        entry.update(peer_read_gib_s=rates.peer.read / 2**30,
                                     shared_write_gib_s=rates.peer.shared_write / 2**30,
                                     measured_floor_us=measured_s * 1e6,
                                     x_measured_floor=summary["median_us"] / (measured_s * 1e6))
                if backend.startswith("shm"):
                    entry["mode"] = mode
                if backend.startswith("deepspeed"):
                    entry["path"] = _deepspeed_path(dname, ds_note)
                results.append(entry)
            if progress is not None:
                progress.update(1)
        if comm is not None:
            overhead[dname] = _overhead(comm, weight, opts)
            copy_modes[dname] = {str(size): mode for size, mode in
                                 comm.workspace.copy_modes().items()}  # type: ignore[attr-defined]
            comm.close()
        if replicated is not None:
            replicated.close()
    if progress is not None:
        progress.close()
    dist.barrier()
    if rank == 0:
        report = {"machine": _machine(pinned, world), "options": asdict(opts),
                  "deepspeed": ds_note, "baseline": BASELINE, "results": results,
                  "python_overhead": overhead, "negotiation": negotiation,
                  "copy_modes": copy_modes}
        _write(report, Path(opts.out))
    if ds is not None and rank == 0:
        _clean_deepspeed_segments()
    return 0


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank must read or write for a row's work, by where the lines are: ``local``
    (its own memory, recently used), ``shared`` (its input into shared memory: lines the peer's
    core read last, which a store must take back), ``peer`` (lines another rank's core has just
    written: each crosses between cores) and ``fresh`` (new output tensors: lines a store must
    first fetch from beyond this core's caches)."""

    local: int
    shared: int
    peer: int
    fresh: int

    @property
    def total(self) -> int:
        return self.local + self.shared + self.peer + self.fresh


def traffic(row: str, size: int, world: int, mode: str = "twoshot") -> Traffic | None:
    """What a row moves on ``size`` bytes per rank (None: no floor stated). The fused op: its
    input into the shared slot (none when the layer wrote it there: ``shm-slot``), every
    peer's input, the residual in, ``residual_out`` and ``out`` (new tensors in ``shm``;
    ``shm-slot`` gets a new ``out``); with a replicated residual, two-shot (``mode``) reads
    the residual of its own rows only (in place the residual's lines come in all the same, to
    be overwritten). DeepSpeed's all-reduce alone: its input into shared memory, every peer's
    input, the sum back into the tensor."""
    peers = (world - 1) * size
    if row in ("shm-inplace", "shm-inplace-replicated"):
        return Traffic(local=3 * size, shared=size, peer=peers, fresh=0)
    if row == "shm":
        return Traffic(local=size, shared=size, peer=peers, fresh=2 * size)
    if row == "shm-replicated":
        residual = -(-size // world) if mode == "twoshot" else size
        return Traffic(local=residual, shared=size, peer=peers, fresh=2 * size)
    if row == "shm-slot":
        return Traffic(local=2 * size, shared=0, peer=peers, fresh=size)
    if row == "deepspeed":
        return Traffic(local=size, shared=size, peer=peers, fresh=0)
    return None


@dataclass(frozen=True)
class PeerRates:
    """Bytes per second between this rank's core and the next rank's, measured now (see
    peer_rates): reading lines the peer has just written, and writing lines the peer read."""

    read: float
    shared_write: float


@dataclass(frozen=True)
class Rates:
    """Bytes per second for one working-set size, measured in the same run on this rank's
    core: ``copy`` (read + write of a local copy: the floor's one rate), ``peer`` (None: not
    measured) and ``fresh_write`` (writing a new tensor, as the op's new outputs are)."""

    copy: float
    peer: PeerRates | None
    fresh_write: float

    def floor_s(self, moved: Traffic) -> float:
        """Seconds to move every byte at the copy rate: the floor."""
        return moved.total / self.copy

    def measured_floor_s(self, moved: Traffic) -> float | None:
        """Seconds to move each kind of byte at its own measured rate (None: a rate missing)."""
        if self.peer is None:
            return None
        return (moved.local / self.copy + moved.shared / self.peer.shared_write
                + moved.peer / self.peer.read + moved.fresh / self.fresh_write)


def copy_bandwidth(size: int, repeats: int = 64) -> float:
    """Read + write bytes per second of one core copying ``size`` bytes (the working set of a
    row of that size), measured now, on this rank's core: the rate every floor divides by."""
    size = max(size, 4096)
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    for _ in range(4):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        dst.copy_(src)
        times.append(time.perf_counter_ns() - start)
    return 2 * size / (statistics.median(times) * 1e-9)


def _one_side_rate(size: int, copy_s: float, copy_rate: float) -> float:
    """The rate of one side (its read or its write) of a copy of ``size`` bytes that took
    ``copy_s``, the other side counted at the local copy rate (each byte read or written costs
    ``1 / copy_rate`` there)."""
    other_s = size / copy_rate
    return size / max(copy_s - other_s, other_s * 1e-3)


PEER_SPIN_TIMEOUT_S = 30.0


def _exchange_copy() -> Any:
    """copy(dst, src, read_ahead): the shm kernel's own way of moving lines between cores
    (``exchange_copy``: software prefetch ahead of the reads or of the stores), so that the
    shared rates are those the kernel can reach; ``Tensor.copy_`` without a compiled kernel."""
    from ..backends.shm import build as shm_build

    module = shm_build.load()
    if module is not None:
        return module.diagnostics.exchange_copy
    return lambda dst, src, read_ahead: dst.copy_(src)


class _Flags:
    """Each rank's progress, an int64 at the head of its shared file; a rank spins on its
    neighbours' (as the op's ranks do), so no core idles in a barrier between a write and the
    read timed."""

    def __init__(self, mine: torch.Tensor, following: torch.Tensor,
                 preceding: torch.Tensor) -> None:
        self.mine, self.following, self.preceding = mine, following, preceding
        self.mine.zero_()

    def post(self, value: int) -> None:
        self.mine[0] = value

    @staticmethod
    def wait(flag: torch.Tensor, value: int) -> None:
        deadline = time.monotonic() + PEER_SPIN_TIMEOUT_S
        while int(flag[0]) < value:
            if time.monotonic() > deadline:
                raise TimeoutError(f"bench: a peer did not reach step {value} of the "
                                   f"peer-rate measurement in {PEER_SPIN_TIMEOUT_S:.0f} s")
            os.sched_yield()  # returns at once on a core of its own


def peer_rates(size: int, copy_rate: float, tag: int, repeats: int = 16) -> PeerRates | None:
    """This rank's rates with the next rank's core, through buffers in ``ARFUSE_SHM_DIR``, each
    moved as the kernel moves it (``_exchange_copy``): ``read``, a copy of the buffer the next
    rank has just written (as a rank reads a peer's slot), less its local write;
    ``shared_write``, rewriting its own buffer after the previous rank has read it (as a rank
    refills its slot), less the local read. None, on every rank,
    when a rank cannot reserve its buffer there (a full or missing directory: logged).
    Collective: every rank calls it with the same arguments."""
    import torch.distributed as dist

    from ..backends.shm.workspace import segment_dir

    rank, world = dist.get_rank(), dist.get_world_size()
    directory = segment_dir()
    size = max(size, 4096)
    if world < 2:
        return PeerRates(read=copy_rate, shared_write=copy_rate)
    flag_bytes = 4096  # the flag's own page, ahead of the buffer

    def path(r: int) -> Path:
        return directory / f"arfuse-bench-{tag}-{r}-{size}"

    reserved = 1
    try:  # reserved, not sparse: a full directory is an error here, not a SIGBUS at a store
        fd = os.open(path(rank), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, flag_bytes + size)
        finally:
            os.close(fd)
    except OSError as exc:
        reserved = 0
        logger.warning("bench: no peer rates for %d bytes: %s (%s)", size, exc.strerror,
                       path(rank))
    on_disk = bool(reserved)
    agreed = torch.tensor([reserved], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    try:
        if not agreed.item():
            return None
        mine = torch.from_file(str(path(rank)), shared=True, size=flag_bytes + size,
                               dtype=torch.uint8)
        theirs = torch.from_file(str(path((rank + 1) % world)), shared=True,
                                 size=flag_bytes + size, dtype=torch.uint8)
        reader = torch.from_file(str(path((rank - 1) % world)), shared=True,
                                 size=flag_bytes, dtype=torch.uint8)
        # this rank waits for the next (its data) and for the previous (done reading ours)
        flags = _Flags(mine[:8].view(torch.int64), theirs[:8].view(torch.int64),
                       reader[:8].view(torch.int64))
        dist.barrier()  # every flag zeroed before any is waited on; every file mapped
        path(rank).unlink()  # the mappings stay: nothing is left if a rank dies from here on
        on_disk = False
        src = torch.ones(size, dtype=torch.uint8)
        dst = torch.empty_like(src)
        buffer, peer_buffer = mine[flag_bytes:], theirs[flag_bytes:]
        copy = _exchange_copy()
        writes, reads = [], []
        for i in range(1, repeats + 3):
            start = time.perf_counter_ns()
            copy(buffer, src, False)  # lines the previous rank read last time
            writes.append(time.perf_counter_ns() - start)
            flags.post(2 * i - 1)
            flags.wait(flags.following, 2 * i - 1)
            start = time.perf_counter_ns()
            copy(dst, peer_buffer, True)
            reads.append(time.perf_counter_ns() - start)
            flags.post(2 * i)
            flags.wait(flags.preceding, 2 * i)  # the previous rank is done with our buffer
        return PeerRates(
            read=_one_side_rate(size, statistics.median(reads[2:]) * 1e-9, copy_rate),
            shared_write=_one_side_rate(size, statistics.median(writes[3:]) * 1e-9, copy_rate))
    finally:
        if on_disk:  # returned or failed before the files were mapped
            path(rank).unlink(missing_ok=True)


def fresh_write_rate(size: int, copy_rate: float, repeats: int = 16) -> float:
    """Bytes per second of writing lines this core last wrote a call's traffic ago (four
    times as many bytes of other data since), as a new output tensor's are: the allocator
    hands back the memory the previous call's outputs freed (without page faults: see
    ``page_faults_per_call``). A copy from a source in cache, less that read."""
    size = max(size, 4096)
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.zeros(size, dtype=torch.uint8)  # its pages exist, as reused memory's do
    other = torch.empty(4 * size, dtype=torch.uint8)
    times = []
    for i in range(repeats + 2):
        other.fill_(i & 0xFF)
        src.add_(0)  # the source back in cache
        start = time.perf_counter_ns()
        dst.copy_(src)
        took = time.perf_counter_ns() - start
        if i >= 2:
            times.append(took)
    return _one_side_rate(size, statistics.median(times) * 1e-9, copy_rate)


def measure_rates(size: int, tag: int) -> Rates:
    """Every rate of the floors for a working set of ``size`` bytes. Collective."""
    copy = copy_bandwidth(size)
    return Rates(copy=copy, peer=peer_rates(size, copy, tag),
                 fresh_write=fresh_write_rate(size, copy))


def _all_reduce(dist: Any, tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def _ds_all_reduce(ds: Any, tensor: torch.Tensor) -> torch.Tensor:
    ds.inference_all_reduce(tensor)  # in place; the return value differs by path
    return tensor


def _overhead(comm: Any, weight: torch.Tensor, opts: BenchOptions) -> dict[str, float]:
    """What the op costs on top of its compiled kernel, 1 token, two ways, call by call:

    * ``overhead_us``: the op minus a direct Python call of the kernel (alternating, median of
      the paired differences: drift cancels within a pair): arfuse's Python layer;
    * ``outside_kernel_us``: the op minus the time the kernel reports for its own work in that
      call (outputs, exchange, epilogue): everything else, including the Python-to-C++ call
      and wrapping new output tensors, which any compiled torch op pays; also in place
      (``outside_kernel_inplace_us``), where no new tensors are wrapped."""
    ws = comm.workspace
    kernel = getattr(ws, "_comm", None)
    if kernel is None:
        return {}
    x = torch.randn(1, opts.hidden).to(weight.dtype)
    residual = torch.randn(1, opts.hidden).to(weight.dtype)
    x2, residual2 = x.clone(), residual.clone()
    kernel.set_timing(True)
    op_t: list[float] = []
    raw_t: list[float] = []
    diffs: list[float] = []
    outside: list[float] = []
    outside_inplace: list[float] = []
    for i in range(4000 + 200):
        t0 = time.perf_counter_ns()
        comm(x, residual=residual, weight=weight, eps=EPS)
        t1 = time.perf_counter_ns()
        inside = kernel.last_call_seconds() * 1e6
        kernel.run(x, residual, weight, EPS, 0.0, 0, 0.0, True, None, None)
        t2 = time.perf_counter_ns()
        x2.copy_(x)
        residual2.copy_(residual)
        t3 = time.perf_counter_ns()
        comm(x2, residual=residual2, weight=weight, eps=EPS, out=x2, residual_out=residual2)
        t4 = time.perf_counter_ns()
        if i >= 200:
            op_t.append((t1 - t0) / 1e3)
            raw_t.append((t2 - t1) / 1e3)
            diffs.append(op_t[-1] - raw_t[-1])
            outside.append(op_t[-1] - inside)
            outside_inplace.append((t4 - t3) / 1e3 - kernel.last_call_seconds() * 1e6)
    kernel.set_timing(False)
    return {"op_median_us": statistics.median(op_t),
            "kernel_median_us": statistics.median(raw_t),
            "overhead_us": statistics.median(diffs),
            "outside_kernel_us": statistics.median(outside),
            "outside_kernel_inplace_us": statistics.median(outside_inplace),
            "calls": len(op_t)}


def _kernel_isa() -> str:
    """The instruction set the shm kernel of this run was built for (ARFUSE_SHM_ISA or the
    host's best), or why there is no compiled kernel."""
    from ..backends.shm import build as shm_build

    module = shm_build.load()
    return str(module.isa) if module is not None else f"none ({shm_build.why_not()})"


def _machine(pinned: bool, world: int) -> dict[str, Any]:
    from ..machine import cpu_flags, cpu_model

    return {"cpu": cpu_model() or platform.processor(), "cores": os.cpu_count(),
            "isa": " ".join(f for f in ("avx512f", "avx512bw", "avx2", "fma", "f16c")
                            if f in cpu_flags()),
            "kernel_isa": _kernel_isa(),
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "ranks_pinned": pinned,
            "pinning": "main thread, after init (library threads free)" if pinned else "none",
            "world_size": world,
            "threads_per_rank": 1, "date": time.strftime("%Y-%m-%d")}


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


def _clean_deepspeed_segments() -> None:
    """DeepSpeed never unlinks its /dev/shm buffers; remove the ones of this run's port."""
    port = os.environ.get("MASTER_PORT", "")
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def table(report: dict[str, Any]) -> str:
    """Median and p90 per backend and size, with the ratio to the baseline."""
    lines = []
    results = report["results"]
    for dname in report["options"]["dtypes"]:
        rows = [r for r in results if r["dtype"] == dname]
        backends = list(dict.fromkeys(r["backend"] for r in rows))
        lines.append(f"\n{dname}, hidden {report['options']['hidden']}, world size "
                     f"{report['options']['world_size']} (us: median / p90; x = {BASELINE} "
                     "median / this median)")
        head = f"{'tokens':>7}" + "".join(f" {b:>26}" for b in backends)
        lines.append(head)
        for tokens in report["options"]["tokens"]:
            by = {r["backend"]: r for r in rows if r["tokens"] == tokens}
            base = by.get(BASELINE, {}).get("median_us")
            cells = []
            for b in backends:
                r = by.get(b)
                if r is None:
                    cells.append(f" {'-':>26}")
                    continue
                ratio = f"{base / r['median_us']:.1f}x" if base else ""
                cells.append(f" {r['median_us']:>9.1f} / {r['p90_us']:>8.1f} {ratio:>6}")
            lines.append(f"{tokens:>7}" + "".join(cells))
        lines.extend(_versus_deepspeed(rows, report["options"]["tokens"]))
        lines.extend(_versus_floor(rows, report["options"]["tokens"]))
    for dname, o in report.get("python_overhead", {}).items():
        if o:
            lines.append(f"\npython overhead ({dname}, 1 token): {o['overhead_us']:.2f} us per "
                         f"call over a direct call of the compiled kernel (median of paired "
                         f"differences; op {o['op_median_us']:.2f} us, kernel called directly "
                         f"{o['kernel_median_us']:.2f} us); outside the kernel's own work: "
                         f"{o['outside_kernel_us']:.2f} us with new outputs, "
                         f"{o['outside_kernel_inplace_us']:.2f} us in place")
    for dname, modes in report.get("copy_modes", {}).items():
        lines.append(f"copy into the shared slot ({dname}, chosen by the kernel per size): "
                     + ", ".join(f"{_size(int(b))}+ {m}" for b, m in modes.items()))
    for dname, n in report.get("negotiation", {}).items():
        lines.append(f"negotiation ({dname}): {n['seconds'] * 1e3:.1f} ms ({n['path']} path)")
    if report.get("deepspeed"):
        lines.append(f"deepspeed: {report['deepspeed']}")
    m = report["machine"]
    lines.append(f"machine: {m['cpu']}, {m['cores']} cores, {m['isa']}, torch {m['torch']}, "
                 f"ranks pinned: {m['ranks_pinned']}; shm kernel built for "
                 f"{m.get('kernel_isa', 'an unrecorded ISA')}")
    return "\n".join(lines)


def _versus_deepspeed(rows: list[dict[str, Any]], tokens: list[int]) -> list[str]:
    """Each arfuse row's median as a multiple of DeepSpeed's all-reduce alone (< 1: faster)."""
    ds = {r["tokens"]: r["median_us"] for r in rows if r["backend"] == "deepspeed"}
    ours = [b for b in dict.fromkeys(r["backend"] for r in rows) if b.startswith("shm")]
    if not ds or not ours:
        return []
    lines = [f"{'':>7}" + "".join(f" {b + ' / deepspeed':>26}" for b in ours)]
    for n in tokens:
        by = {r["backend"]: r["median_us"] for r in rows if r["tokens"] == n}
        cells = [f" {by[b] / ds[n]:>25.2f}x" if b in by and n in ds else f" {'-':>26}"
                 for b in ours]
        lines.append(f"{n:>7}" + "".join(cells))
    return lines


def _versus_floor(rows: list[dict[str, Any]], tokens: list[int]) -> list[str]:
    """Each row's median as a multiple of its memory floor: the bytes it must move at the
    local copy rate measured in the same run for that working set (``floor``), and each kind
    of byte at its own measured rate (``measured``: lines from a peer's core, new outputs)."""
    floored = [b for b in dict.fromkeys(r["backend"] for r in rows)
               if any(r["backend"] == b and "x_floor" in r for r in rows)]
    if not floored:
        return []
    lines = [f"{'':>7} {'GiB/s: copy':>11} {'shared':>6} {'peer':>5} {'fresh':>5}"
             + "".join(f" {b + ' / floor, measured':>30}" for b in floored)]
    for n in tokens:
        by = {r["backend"]: r for r in rows if r["tokens"] == n and "x_floor" in r}
        if not by:
            continue
        any_row = next(iter(by.values()))
        cells = [f" {by[b]['x_floor']:>21.2f}x, {_ratio(by[b].get('x_measured_floor'))}"
                 if b in by else f" {'-':>30}" for b in floored]
        lines.append(f"{n:>7} {any_row['copy_gib_s']:>11.1f} "
                     f"{_rate(any_row.get('shared_write_gib_s')):>6} "
                     f"{_rate(any_row.get('peer_read_gib_s')):>5}"
                     f" {any_row['fresh_write_gib_s']:>5.1f}" + "".join(cells))
    lines.append("(floor: every byte the row must move at the copy rate; measured: its own "
                 "lines at the copy rate, its input into shared memory at the shared rate "
                 "(lines the peer read last), lines from the peer's core at the peer rate, new "
                 "output tensors at the fresh rate; each rate measured in this run)")
    return lines


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return f"{'-':>6}" if value is None else f"{value:>5.2f}x"


def _write(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    text = table(report)
    (out / "bench.txt").write_text(text + "\n")
    print(text, flush=True)
    try:
        plot(report, out / "bench.png")
        print(f"\nwrote {out / 'bench.json'}, {out / 'bench.txt'}, {out / 'bench.png'}")
    except ImportError:
        print(f"\nwrote {out / 'bench.json'}, {out / 'bench.txt'} (no plot: pip install "
              "'arfuse[bench]' for matplotlib)")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = report["options"]["dtypes"]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dname in zip(axes[0], dtypes, strict=True):
        rows = [r for r in report["results"] if r["dtype"] == dname]
        for backend in dict.fromkeys(r["backend"] for r in rows):
            pts = sorted((r["tokens"], r["median_us"]) for r in rows if r["backend"] == backend)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per call")
        ax.set_ylabel("median latency (us)")
        ax.set_title(f"{dname}, hidden {report['options']['hidden']}, "
                     f"{report['options']['world_size']} ranks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    m = report["machine"]
    fig.suptitle(f"arfuse bench on {m['cpu']} ({m['cores']} cores), {m['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


BENCH_TOKENS = tuple(2**i for i in range(13))
ROWS = ("shm", "torch", "deepspeed")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="latency sweep: shm vs torch (gloo) vs deepspeed")
    p.add_argument("--world-size", type=cli_args.group_size, default=None,
                   help="ranks to start (2; under torchrun: the ranks it started)")
    p.add_argument("--tokens", type=cli_args.int_list, default=BENCH_TOKENS,
                   help="token counts (1,2,4,...,4096)")
    p.add_argument("--hidden", type=cli_args.call_size, default=4096,
                   help="hidden size (4096)")
    p.add_argument("--dtype", type=cli_args.dtype_list, default=("bf16", "fp32"),
                   help="dtypes (bf16,fp32)")
    p.add_argument("--backends", default=",".join(ROWS),
                   help="rows to measure (shm,torch,deepspeed)")
    p.add_argument("--out", default="bench-out", help="folder for bench.json/.txt/.png")
    p.add_argument("--min-seconds", type=cli_args.positive_seconds, default=0.3,
                   help="measure each row for about this long (0.3)")
    p.set_defaults(func=run)


def bytes_per_rank(tokens: int, hidden: int, dtypes: tuple[str, ...]) -> int:
    """A lower bound of what one rank allocates at once: the largest size's input and
    residual, of the widest dtype."""
    return 2 * tokens * hidden * max(TORCH_DTYPES[d].itemsize for d in dtypes)


def run(args: argparse.Namespace) -> int:
    from ..launch import check_memory, job_ranks, launch
    from ..spec import Spec
    from .explain import check_job

    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    unknown = set(backends) - set(ROWS)
    if unknown or not backends:
        raise ValueError(f"--backends: {'unknown ' + str(sorted(unknown)) if unknown else 'none'}"
                         f"; use some of {', '.join(ROWS)}")
    ranks = job_ranks(args.world_size)
    if ranks.world < 2:
        raise ValueError("--world-size must be >= 2 for a benchmark of a collective")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out} is a file; give a folder for bench.json/.txt/.png")
    # what every rank would fail on, once here (one line, exit 2); the shm rows ask for shm
    # and nothing else, as the ranks do
    shm = "shm" in backends
    for dtype in args.dtype:
        check_job("shm" if shm else None, True if shm else None, ranks, "cpu",
                  Spec(max_tokens=max(args.tokens), hidden=args.hidden, dtype=dtype))
    check_memory(bytes_per_rank(max(args.tokens), args.hidden, tuple(args.dtype)), ranks,
                 f"--tokens {max(args.tokens)} --hidden {args.hidden} needs the inputs and "
                 "residuals")
    opts = BenchOptions(world_size=ranks.world, tokens=tuple(args.tokens),
                        hidden=args.hidden, dtypes=tuple(args.dtype), backends=backends,
                        out=args.out, min_seconds=args.min_seconds)
    if "deepspeed" in backends and not _prebuild_deepspeed() and backends == ("deepspeed",):
        raise ValueError("--backends deepspeed: DeepSpeed is unavailable here (see above); "
                         "nothing to measure")
    if "shm" in backends:
        from ..backends.shm import build

        build.load()  # build once here, not in every rank at once
    # the report names the backend and its negotiation time; the plan log would only cut
    # through the progress bar (ARFUSE_LOG=info brings it back)
    return launch(bench_body, ranks.world, opts,
                  env={"OMP_NUM_THREADS": "1",
                       "ARFUSE_LOG": os.environ.get("ARFUSE_LOG", "warning")})


def _prebuild_deepspeed() -> bool:
    """Build DeepSpeed's shm op once before the ranks start (about a minute the first time);
    whether it is available."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.accelerator import get_accelerator

        get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
    except Exception as exc:  # the bench then reports deepspeed as unavailable
        print(f"arfuse bench: deepspeed unavailable: {type(exc).__name__}: {exc}")
        return False
    return True
