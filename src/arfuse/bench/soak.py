"""The soak: many calls of the fused op on two real ranks, checked, with memory and descriptors
watched (DESIGN 5: "a 100,000-call soak with no mismatch and flat memory"); run by
``benchmarks/soak.py``.

Both ranks draw the same random sequence (token counts on both sides of the capacity and of the
one-/two-shot threshold, patterns plain / norm / norm+residual / fp8 / nvfp4 / in place / from
the shared slot), every K-th call is checked against the float64 reference, and resident
memory (/proc/self/statm), open descriptors (/proc/self/fd) and threads are sampled. After the
last call: destroy_all, then nothing of arfuse may be left (segments, descriptors, threads,
children).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing as mp
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..backends.shm.workspace import ONESHOT_MAX_BYTES, RING_ONESHOT_ABOVE_BYTES
from ..scenarios.calls import PATTERNS  # the kinds of call a soak draws from

DEFAULT_HIDDEN = 128              # bf16: 256 bytes a row
DEFAULT_CAPACITY = 256            # tokens the workspace holds
RSS_BOUND_MIB = 16.0              # allowed growth of resident memory after warm-up (default)
WARM_FRACTION = 0.1               # samples before this fraction of the calls are warm-up


@dataclass(frozen=True)
class Sizes:
    """The token counts a soak draws from, for one hidden size and capacity."""

    hidden: int = DEFAULT_HIDDEN
    capacity: int = DEFAULT_CAPACITY

    @property
    def oneshot_tokens(self) -> int:  # shm's one-/two-shot switch per rank
        return max(1, ONESHOT_MAX_BYTES // (self.hidden * 2))

    @property
    def ring_tokens(self) -> int:  # above this, one-shot round the slot's ring (two ranks)
        return RING_ONESHOT_ABOVE_BYTES // (self.hidden * 2)

    @property
    def over(self) -> int:  # the largest call, over capacity (runs unfused)
        return self.capacity + self.capacity // 4

    @property
    def pool(self) -> int:  # rows of random input per rank; calls take windows of it
        return 2 * self.capacity

    @property
    def edges(self) -> tuple[int, ...]:
        one, cap = self.oneshot_tokens, self.capacity
        return tuple(sorted({t for t in (1, 2, one - 1, one, one + 1, cap - 1, cap, cap + 1)
                             if t >= 1}))


def draw(rng: random.Random, sizes: Sizes) -> tuple[int, str, int]:
    """(tokens, pattern, offset) of one call: the same on every rank (same seed)."""
    roll = rng.random()
    if roll < 0.10:
        tokens = rng.choice(sizes.edges)
    elif roll < 0.50:
        tokens = rng.randint(1, sizes.oneshot_tokens)
    elif roll < 0.92:
        tokens = rng.randint(min(sizes.oneshot_tokens + 1, sizes.capacity), sizes.capacity)
    else:
        tokens = rng.randint(sizes.capacity + 1, sizes.over)
    return tokens, rng.choice(PATTERNS), rng.randint(0, sizes.pool - sizes.over)


def resident_mib() -> float:
    page = os.sysconf("SC_PAGE_SIZE")
    return int(Path("/proc/self/statm").read_text().split()[1]) * page / 2**20


def sample() -> dict[str, float]:
    """RSS as it is, and after glibc returned the free memory of its heaps (malloc_trim): the
    bound is on the second, so that memory the allocator keeps after large temporaries (the
    float64 reference, the unfused path) does not read as a leak, while a leak still does."""
    rss = resident_mib()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return {"rss_mib": resident_mib(), "rss_untrimmed_mib": rss,
            "fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task"))}


def _inputs(world: int, sizes: Sizes) -> tuple[list[Any], Any, Any]:
    """Every rank's input pool (each rank knows all, for the reference), the residual pool and
    the weight: the same on every rank."""
    import torch

    gens = [torch.Generator().manual_seed(7000 + r) for r in range(world)]
    xs = [(torch.randn(sizes.pool, sizes.hidden, generator=g) * (0.5 + 0.25 * r))
          .to(torch.bfloat16) for r, g in enumerate(gens)]
    gen = torch.Generator().manual_seed(99)
    residual_pool = torch.randn(sizes.pool, sizes.hidden, generator=gen).to(torch.bfloat16)
    weight = (torch.rand(sizes.hidden, generator=gen) + 0.5).to(torch.bfloat16)
    return xs, residual_pool, weight


def _soak_op(sizes: Sizes, opts: dict[str, Any], report: dict[str, Any]) -> Any:
    """The op of the soak, its backend and path noted in ``report``."""
    import torch

    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=sizes.capacity, hidden_dim=sizes.hidden,
                                 dtype=torch.bfloat16, timeout_s=30)
    report.update(backend=comm.backend, path=getattr(comm.workspace, "path", ""),
                  replicated_residual=comm.replicated_residual)
    if opts["output_stores"] != "auto":  # the kernel's streaming output stores at any size
        set_output_stores = getattr(comm.workspace, "set_output_stores", None)
        if set_output_stores is not None:
            set_output_stores(opts["output_stores"])
    return comm


def _soak_calls(comm: Any, rank: int, opts: dict[str, Any], inputs: tuple[list[Any], Any, Any],
                report: dict[str, Any]) -> dict[str, Any]:
    """The calls, every ``check_every``-th checked against the reference, samples taken every
    ``sample_every``; the figures (mismatches also as errors in ``report``)."""
    from ..scenarios import check_result, run_pattern

    sizes: Sizes = opts["sizes"]
    xs, residual_pool, weight = inputs
    rng = random.Random(opts["seed"])
    calls, every, every_sample = opts["calls"], opts["check_every"], opts["sample_every"]
    samples = [dict(sample(), call=0)]
    checks = mismatches = 0
    worst = 0.0
    modes: dict[str, int] = {}
    ws = comm.workspace
    started = time.perf_counter()
    for i in range(1, calls + 1):
        tokens, pattern, offset = draw(rng, sizes)
        x = xs[rank][offset:offset + tokens]
        residual = residual_pool[offset:offset + tokens]
        if tokens > sizes.capacity:
            kind = "unfused"
        else:
            mode = getattr(ws, "mode", None)
            kind = mode(tokens) if mode is not None else "fused"
        modes[kind] = modes.get(kind, 0) + 1
        result = run_pattern(comm, pattern, x, residual, weight)
        if i % every == 0:
            checks += 1
            ratio = check_result(pattern, "bf16", [t[offset:offset + tokens] for t in xs],
                                 residual, weight, result)
            worst = max(worst, ratio)
            if ratio > 1.0:
                mismatches += 1
                report["errors"].append(f"call {i}: {tokens} tokens {pattern}: "
                                        f"{ratio:.3g} x the tolerance")
        if i % every_sample == 0 or i == calls:
            samples.append(dict(sample(), call=i))
    seconds = time.perf_counter() - started
    return {"calls": calls, "seconds": seconds, "rate": calls / seconds, "checks": checks,
            "mismatches": mismatches, "worst_ratio": worst, "modes": modes, "samples": samples}


def rank_body(rank: int, world: int, port: int, opts: dict[str, Any], results: Any) -> None:
    """One rank: the soak loop, then the leak check; reports one dict on ``results``."""
    import torch
    import torch.distributed as dist

    import arfuse

    from ..scenarios import LeakBaseline

    torch.set_num_threads(1)
    report: dict[str, Any] = {"rank": rank, "errors": []}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        dist.barrier()
        baseline = LeakBaseline()
        inputs = _inputs(world, opts["sizes"])
        comm = _soak_op(opts["sizes"], opts, report)
        figures = _soak_calls(comm, rank, opts, inputs, report)
        stats = comm.stats()
        comm.close()
        del comm
        arfuse.destroy_all()
        report.update(calls=figures["calls"], seconds=figures["seconds"], rate=figures["rate"],
                      checks=figures["checks"], mismatches=figures["mismatches"],
                      worst_ratio=figures["worst_ratio"], stats=stats, modes=figures["modes"],
                      samples=figures["samples"], leaks=baseline.leaks())
    except Exception as exc:
        report["errors"].append(f"{type(exc).__name__}: {exc}")
    results.put(report)
    results.close()
    results.join_thread()  # the report is in the pipe before the process ends
    os._exit(0)  # no process-group teardown that could wait on a peer that failed


def _ranks(opts: dict[str, Any]) -> tuple[list[Any], Any]:
    """Two forked ranks on a free port (not started yet), and the queue they report on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_body, args=(r, 2, port, opts, results)) for r in range(2)]
    return procs, results


def _collect(procs: list[Any], results: Any, started: float, limit_s: float,
             problems: list[str]) -> dict[int, dict[str, Any]]:
    """The ranks' reports, waited for up to ``limit_s`` from ``started``; a rank still running
    then is killed (a problem)."""
    reports: dict[int, dict[str, Any]] = {}
    while len(reports) < 2 and time.monotonic() - started < limit_s:
        with contextlib.suppress(Exception):
            report = results.get(timeout=0.5)
            reports[report["rank"]] = report
        if len(reports) < 2 and not any(p.is_alive() for p in procs) and results.empty():
            break
    for p in procs:
        p.join(5)
        if p.is_alive():
            problems.append(f"rank pid {p.pid} did not finish within {limit_s:g} s (killed)")
            os.kill(p.pid or 0, signal.SIGKILL)
            p.join(5)
    return reports


def _rank_problems(rank: int, report: dict[str, Any], calls: int,
                   rss_bound_mib: float) -> list[str]:
    """What one rank's report shows wrong: errors, leaks, growth of memory after warm-up,
    descriptors or threads (its growth is noted in ``report``)."""
    problems = [f"rank {rank}: {e}" for e in report["errors"][:5]]
    problems += [f"rank {rank} leaks: {leak}" for leak in report.get("leaks", [])]
    samples = report.get("samples", [])
    warm = [s for s in samples if s["call"] >= WARM_FRACTION * calls] or samples[-1:]
    if warm:
        growth = samples[-1]["rss_mib"] - warm[0]["rss_mib"]
        report["rss_growth_after_warmup_mib"] = growth
        if growth > rss_bound_mib:
            problems.append(f"rank {rank}: resident memory grew {growth:.1f} MiB after "
                            f"warm-up (bound {rss_bound_mib:g} MiB)")
        if samples[-1]["fds"] != samples[0]["fds"]:
            problems.append(f"rank {rank}: descriptors {samples[0]['fds']} -> "
                            f"{samples[-1]['fds']}")
        if samples[-1]["threads"] != warm[0]["threads"]:
            problems.append(f"rank {rank}: threads {warm[0]['threads']} -> "
                            f"{samples[-1]['threads']}")
    return problems


def _digest(report: dict[str, Any]) -> dict[str, Any]:
    """One rank's figures as the soak's result gives them."""
    samples = report.get("samples", [])
    return {
        "backend": report.get("backend"), "path": report.get("path"),
        "calls": report.get("calls"), "seconds": report.get("seconds"),
        "calls_per_s": report.get("rate"), "checks": report.get("checks"),
        "mismatches": report.get("mismatches"), "worst_ratio": report.get("worst_ratio"),
        "modes": report.get("modes"), "stats": report.get("stats"),
        "rss_mib_start": samples[0]["rss_mib"] if samples else None,
        "rss_mib_end": samples[-1]["rss_mib"] if samples else None,
        "rss_mib_max": max(s["rss_mib"] for s in samples) if samples else None,
        "rss_growth_after_warmup_mib": report.get("rss_growth_after_warmup_mib"),
        "fds_start": samples[0]["fds"] if samples else None,
        "fds_end": samples[-1]["fds"] if samples else None,
        "threads_start": samples[0]["threads"] if samples else None,
        "threads_end": samples[-1]["threads"] if samples else None,
        "leaks_after_destroy_all": report.get("leaks"), "samples": samples}


def run_soak(calls: int = 100_000, check_every: int = 50, sample_every: int = 1000,
             seed: int = 20261201, limit_s: float = 1800.0,
             output_stores: str = "auto", sizes: Sizes = Sizes(),
             rss_bound_mib: float = RSS_BOUND_MIB) -> dict[str, Any]:
    """Two ranks; returns the figures, with ``ok`` and ``problems`` (what failed, if any).
    ``output_stores``: how the shm kernel stores a call's own outputs (auto streams only far
    above this soak's sizes; ``streaming`` runs every call with own outputs through it)."""
    import torch  # noqa: F401  (loaded once, shared by the forked ranks)

    from ..backends.shm import build as shm_build
    from ..scenarios import child_pids

    if os.environ.get("ARFUSE_SHM_PURE_TORCH") != "1":
        shm_build.load()
    opts = {"calls": calls, "check_every": check_every, "sample_every": sample_every,
            "seed": seed, "output_stores": output_stores, "sizes": sizes}
    procs, results = _ranks(opts)
    started = time.monotonic()
    for p in procs:
        p.start()
    pids = [p.pid for p in procs]
    problems: list[str] = []
    reports = _collect(procs, results, started, limit_s, problems)
    wall = time.monotonic() - started
    if len(reports) < 2:
        problems.append(f"only ranks {sorted(reports)} reported")
    left = [n for n in os.listdir("/dev/shm")
            if any(n.startswith(f"arfuse-{pid}-") for pid in pids)]
    children = [c for c in child_pids() if c in pids]
    for rank, report in sorted(reports.items()):
        problems += _rank_problems(rank, report, calls, rss_bound_mib)
    if left:
        problems.append(f"segments left in /dev/shm: {left}")
    if children:
        problems.append(f"rank processes still alive: {children}")
    digest = {str(rank): _digest(report) for rank, report in sorted(reports.items())}
    return {"ok": not problems, "problems": problems, "calls": calls,
            "check_every": check_every, "sample_every": sample_every, "seed": seed,
            "hidden": sizes.hidden, "dtype": "bf16", "capacity": sizes.capacity,
            "output_stores": output_stores,
            # ARFUSE_REPLICATED_RESIDUAL=1 (the residual pool is the same on every rank)
            "replicated_residual": reports.get(0, {}).get("replicated_residual"),
            "oneshot_max_tokens": sizes.oneshot_tokens,
            "ring_oneshot_above_tokens": sizes.ring_tokens, "max_tokens_drawn": sizes.over,
            "rss_bound_mib": rss_bound_mib, "warm_up_calls": int(WARM_FRACTION * calls),
            "segments_left": left, "wall_seconds": wall, "cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "ranks": digest}


def summary(result: dict[str, Any]) -> str:
    lines = [f"soak: {result['calls']} calls on 2 ranks, hidden {result['hidden']} bf16, "
             f"capacity {result['capacity']}, one-shot up to {result['oneshot_max_tokens']} "
             f"tokens and round the slot's ring above {result['ring_oneshot_above_tokens']}, "
             f"checked every {result['check_every']}: "
             f"{'OK' if result['ok'] else 'FAILED'} in {result['wall_seconds']:.1f} s"]
    for rank, r in result["ranks"].items():
        lines.append(
            f"  rank {rank}: {r['backend']} ({r['path']}), {r['calls_per_s'] or 0:.0f} calls/s, "
            f"{r['checks']} checks, {r['mismatches']} mismatches (worst "
            f"{r['worst_ratio'] or 0:.2f} x tol), modes {r['modes']}, RSS "
            f"{r['rss_mib_start'] or 0:.1f} -> {r['rss_mib_end'] or 0:.1f} MiB (max "
            f"{r['rss_mib_max'] or 0:.1f}; +{r['rss_growth_after_warmup_mib'] or 0:.2f} after "
            f"warm-up), fds {r['fds_start']} -> {r['fds_end']}, threads {r['threads_start']} "
            f"-> {r['threads_end']}, leaks after destroy_all {r['leaks_after_destroy_all']}")
    lines += [f"  problem: {p}" for p in result["problems"]]
    return "\n".join(lines)
