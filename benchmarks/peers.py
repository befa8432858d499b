"""arfuse's fused call beside vLLM's and SGLang's CPU shared-memory all-reduce (alone and with
their own fused add + RMSNorm) and DeepSpeed's ``inference_all_reduce``, in one run.

vLLM's CPU backend and SGLang's CPU path each ship a shared-memory all-reduce followed by a
fused add + RMSNorm kernel of their own. This script builds those from the peers' unchanged
sources, which the user points to, and times them the way ``arfuse bench`` times its rows.

Getting the sources (nothing of the peers is kept in this repository; any checkout of the
projects will do, and only the files below are read):

    git clone --depth 1 https://github.com/vllm-project/vllm /path/to/vllm
    git clone --depth 1 https://github.com/sgl-project/sglang /path/to/sglang

or, from a clone already on disk, just the few files needed, outside this repository:

    mkdir -p ~/peer-src/vllm ~/peer-src/sglang
    git -C vllm archive HEAD csrc/cpu | tar -x -C ~/peer-src/vllm
    git -C sglang archive HEAD sgl-kernel/csrc/cpu | tar -x -C ~/peer-src/sglang
    git -C vllm rev-parse HEAD > ~/peer-src/vllm/COMMIT       # recorded in the report
    git -C sglang rev-parse HEAD > ~/peer-src/sglang/COMMIT

Read from ``--vllm-src`` (a vLLM source root): ``csrc/cpu/shm.cpp``, ``csrc/cpu/layernorm.cpp``
and the headers they include (``cpu_types.hpp``, ``cpu_types_x86.hpp``). From ``--sglang-src``
(an SGLang source root, optional): ``sgl-kernel/csrc/cpu/interface.cpp``, ``shm.cpp``,
``norm.cpp`` and their headers (``shm.h``, ``x86_64/shm.h``, ``common.h``, ``vec.h``). Each
peer is compiled with torch's ``cpp_extension`` into a library of its own, beside a binding of
a few lines (``peers_vllm.cpp``, ``peers_sglang.cpp``) that registers the peer's functions as
torch ops with the peer's own schemas, so a call goes through torch's dispatcher as it does in
the peer. Flags: the peers' own for x86 with AVX-512 (``VLLM_FLAGS`` from vLLM's
``cmake/cpu_extension.cmake``, the ``_C`` target it loads where the CPU has AVX-512 BF16;
``SGLANG_FLAGS`` from sgl-kernel's ``csrc/cpu/CMakeLists.txt``). On a CPU without AVX-512,
what vLLM itself runs there: its ``_C_AVX2`` target has no shm all-reduce, so the ``vllm`` row
is ``torch.distributed``'s all-reduce on the group (vLLM's CPU communicator's fallback) and
``vllm+norm`` adds vLLM's ``fused_add_rms_norm`` built as that target builds it
(``VLLM_AVX2_FLAGS``); sgl-kernel builds for AVX-512 only, and its rows are left out.

Rows (hidden 4096 by default, 2 ranks, one thread each pinned to its own core, everything in
place): ``shm-inplace`` arfuse's fused all-reduce + residual add + RMSNorm; ``shm-allreduce``
arfuse's all-reduce alone (the same op without residual and weight); with ``--modes`` also the
fused call forced one-shot (``shm-oneshot``; ``shm-oneshot-noring``: each block of the copied
input at its rows' offsets in the slot instead of round the ring) and two-shot
(``shm-twoshot``), the rows taking turns on one workspace; ``vllm`` vLLM's
``shm_allreduce`` alone; ``vllm+norm`` it then vLLM's ``fused_add_rms_norm``; ``sglang`` and
``sglang+norm`` the same with sgl-kernel's ``shm_allreduce`` and ``fused_add_rmsnorm_cpu``
(16-bit dtypes only: sgl-kernel dispatches that kernel for bf16 and fp16); ``deepspeed``
DeepSpeed's ``inference_all_reduce`` alone (``EXTRAS=bench ./scripts/setup.sh``). Before any
timing, each row's result at every size is checked against a float64 reference; a row that
differs is dropped from that size and the report says by how much, so a broken build cannot
give a fast wrong figure. Timing is ``arfuse.bench.timing.measure``: every row warmed up, its
inputs restored before each call (untimed), rows interleaved in rounds, per-rank medians, the
slowest rank's median kept. ``--runs`` repeats the whole job; the table gives the median over
runs and each row as a multiple of arfuse's.

    python benchmarks/peers.py --vllm-src ~/peer-src/vllm \\
        --sglang-src ~/peer-src/sglang --runs 3 \\
        --out benchmarks/results/epyc-zen5-avx512/peers

Writes ``peers.json`` (machine, peers' commits, flags and file hashes, every run's rows, the
correctness checks) and ``peers.txt`` in ``--out``. How vLLM's algorithm differs from arfuse's:
``benchmarks/peers.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
EPS = 1e-6
TOKENS = (1, 8, 64, 512, 2048)
DTYPES = ("bf16", "fp32")
FUSED = "shm-inplace"  # arfuse's row, named as in `arfuse bench`
ALONE = "shm-allreduce"  # arfuse's all-reduce alone, as the peers' rows without "+norm"
# --modes: the fused call forced one-shot (its copy round the slot's ring, or at its rows'
# offsets) or two-shot: (mode, ring blocks); None: the kernel's own
MODES: dict[str, tuple[str, int | None]] = {
    "shm-oneshot": ("oneshot", None), "shm-oneshot-noring": ("oneshot", 0),
    "shm-twoshot": ("twoshot", None)}
ROWS = (FUSED, ALONE, *MODES, "vllm", "vllm+norm", "sglang", "sglang+norm", "deepspeed")

VLLM_FLAGS = ("-O2", "-DNDEBUG", "-std=c++20", "-fopenmp", "-DVLLM_CPU_EXTENSION", "-mf16c",
              "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mamx-bf16",
              "-mamx-tile", "-mavx512bf16", "-mavx512vnni", "-DCPU_CAPABILITY_AMXBF16",
              "-DPEER_VLLM_SHM")
"""vLLM's x86 ``_C`` target (RelWithDebInfo: -O2 -DNDEBUG, without -g), C++20 (the last
define is the binding's: it declares the shm ops)."""
VLLM_AVX2_FLAGS = ("-O2", "-DNDEBUG", "-std=c++20", "-fopenmp", "-DVLLM_CPU_EXTENSION",
                   "-mf16c", "-mavx2")
"""vLLM's ``_C_AVX2`` target, what vLLM loads on an x86 CPU without AVX-512: its sources leave
``shm.cpp`` out (``cmake/cpu_extension.cmake``) and its bindings register ``init_shm_manager``
only under ``__AVX512F__`` (``csrc/cpu/torch_bindings.cpp``), so vLLM's CPU communicator
all-reduces with ``torch.distributed`` on the group (``cpu_communicator.py``); its
``layernorm.cpp`` is built."""
SGLANG_FLAGS = ("-O3", "-DNDEBUG", "-std=c++17", "-Wno-unknown-pragmas", "-march=x86-64-v4",
                "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8",
                "-fopenmp", "-DSGLANG_CPU_FP8_CVT_FTZ")
"""sgl-kernel's x86 flags (Release), C++17."""

TOLERANCE = {"bf16": 3e-2, "fp16": 3e-3, "fp32": 1e-4}
"""Absolute and relative bound on a row's difference from the float64 reference: a few
roundings of the dtype (the peers round the sum before they add the residual); a wrong sum
or a missing rank is off by about 1."""


@dataclass(frozen=True)
class Peer:
    """One peer's library: where its files are, how it is compiled, the ops it registers."""

    name: str  # vllm, sglang: the row names and the ops' namespace (peer_<name>)
    root: str
    sources: tuple[str, ...]
    includes: tuple[str, ...]
    flags: tuple[str, ...]
    binding: str


def has_avx512() -> bool:
    """Whether this CPU has AVX-512 (vLLM's build and sgl-kernel's need it for their shm)."""
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def vllm_peer(root: Path, avx512: bool) -> Peer:
    """vLLM's library as vLLM builds it for this CPU: with AVX-512 its shm all-reduce and
    norm; without, the norm alone (``VLLM_AVX2_FLAGS``)."""
    cpu = root / "csrc" / "cpu"
    sources = ((str(cpu / "shm.cpp"),) if avx512 else ()) + (str(cpu / "layernorm.cpp"),)
    return Peer("vllm", str(root), sources, (str(root / "csrc"), str(cpu)),
                VLLM_FLAGS if avx512 else VLLM_AVX2_FLAGS, str(HERE / "peers_vllm.cpp"))


def sglang_peer(root: Path) -> Peer:
    cpu = root / "sgl-kernel" / "csrc" / "cpu"
    return Peer("sglang", str(root),
                tuple(str(cpu / f) for f in ("interface.cpp", "shm.cpp", "norm.cpp")),
                (str(cpu),), SGLANG_FLAGS, str(HERE / "peers_sglang.cpp"))


def missing_files(peer: Peer) -> list[str]:
    """The peer's files that are not where the source root says (empty: all there)."""
    return [s for s in peer.sources if not Path(s).is_file()]


def source_commit(root: str) -> str:
    """The peer tree's commit: its ``COMMIT`` file (a tree of extracted files), else git's
    answer, else "unknown"."""
    stamp = Path(root) / "COMMIT"
    if stamp.is_file():
        return stamp.read_text().strip()
    done = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def build(peer: Peer) -> dict[str, Any]:
    """Compile the peer with its binding (cached by torch's cpp_extension, rebuilt when a file
    or flag changes): what the report says of it, the library's path among it."""
    from torch.utils import cpp_extension

    print(f"building {peer.name} from {peer.root} (minutes the first time)", flush=True)
    path = cpp_extension.load(f"arfuse_peer_{peer.name}", [peer.binding, *peer.sources],
                              extra_cflags=list(peer.flags), extra_ldflags=["-fopenmp"],
                              extra_include_paths=list(peer.includes),
                              is_python_module=False, verbose=False)
    if not isinstance(path, str):  # torch returns the loaded library's path
        raise SystemExit(f"torch's cpp_extension.load gave {path!r}, not a library's path")
    files = {str(Path(s).relative_to(peer.root)): hashlib.sha256(Path(s).read_bytes())
             .hexdigest()[:16] for s in peer.sources}
    return {"root": peer.root, "commit": source_commit(peer.root), "flags": list(peer.flags),
            "sha256_16": files, "library": str(path)}


@dataclass(frozen=True)
class Options:
    tokens: tuple[int, ...]
    hidden: int
    dtypes: tuple[str, ...]
    libraries: dict[str, str]  # peer name -> its built library
    deepspeed: bool
    modes: bool  # the MODES rows too
    threads: int  # intra-op threads per rank, the peers' OpenMP threads alike
    min_seconds: float
    max_iters: int
    out: str  # this run's JSON
    notes: dict[str, Any] = field(default_factory=dict)


def reference(xs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 sum over ranks, the residual after the add, and RMSNorm of it times weight."""
    total = torch.stack([x.double() for x in xs]).sum(0)
    new_residual = residual.double() + total
    rms = torch.rsqrt(new_residual.pow(2).mean(-1, keepdim=True) + EPS)
    return total, new_residual, new_residual * rms * weight.double()


def worst_error(got: torch.Tensor, want: torch.Tensor, dname: str) -> float:
    """How far ``got`` is from ``want`` in units of the dtype's tolerance (<= 1: within)."""
    tol = TOLERANCE[dname]
    excess = (got.double() - want).abs() / (tol + tol * want.abs())
    return float(excess.max())


def _peer_ops(rank: int, world: int, opts: Options, tag: int) -> dict[str, Any]:
    """Load each built peer and set up its shared memory as the peer's framework does; its
    segments are unlinked as soon as every rank has mapped them (nothing left in /dev/shm)."""
    import torch.distributed as dist

    ops: dict[str, Any] = {}
    if "vllm" in opts.libraries:
        torch.ops.load_library(opts.libraries["vllm"])
        vllm = torch.ops.peer_vllm
        vllm.openmp_threads(opts.threads)
        if not hasattr(vllm, "init_shm_manager"):  # vLLM's build without AVX-512
            ops["vllm"] = (vllm, None)
            return ops | _sglang_ops(rank, world, opts, tag)
        name = f"arfuse_peers_vllm_{tag}"
        # vLLM's _CPUSHMDistributed: init, barrier, join, barrier; threads: torch's
        handle = vllm.init_shm_manager(name, world, rank, torch.get_num_threads())
        dist.barrier()
        vllm.join_shm_manager(handle, name)
        dist.barrier()
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/{name}_{rank}")
        ops["vllm"] = (vllm, handle)
    return ops | _sglang_ops(rank, world, opts, tag)


def _sglang_ops(rank: int, world: int, opts: Options, tag: int) -> dict[str, Any]:
    """sgl-kernel's ops, its shared memory set up as SGLang does (none when not built)."""
    import torch.distributed as dist

    ops: dict[str, Any] = {}
    if "sglang" in opts.libraries:
        torch.ops.load_library(opts.libraries["sglang"])
        sgl = torch.ops.peer_sglang
        sgl.openmp_threads(opts.threads)
        # sgl-kernel names its segments as DeepSpeed does, from MASTER_ADDR and MASTER_PORT:
        # a port of its own here, or it would share DeepSpeed's segments in this process
        port = os.environ["MASTER_PORT"]
        os.environ["MASTER_PORT"] = f"{port}sgl{tag}"
        os.environ["LOCAL_SIZE"] = str(world)  # sgl-kernel uses shm only when all are local
        try:
            sgl.initialize(world, rank)
        finally:
            os.environ["MASTER_PORT"] = port
        dist.barrier()
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_"
                      f"{os.environ['MASTER_ADDR']}_{port}sgl{tag}_{rank}")
        ops["sglang"] = sgl
    return ops


def _rows(comm: Any, peers: dict[str, Any], ds: Any, dname: str, work: torch.Tensor,
          res_work: torch.Tensor, weight: torch.Tensor, modes: bool) -> dict[str, Any]:
    """Every row's call on ``work`` and ``res_work`` in place (the peers': their own ops,
    through torch's dispatcher)."""
    import torch.distributed as dist

    workspace = comm.workspace
    kernel_ring = workspace.ring_blocks

    def fused(mode: str | None = None, ring: int | None = None) -> Any:
        def call() -> None:
            if modes:  # each row's own mode: the rows take turns on one workspace
                workspace.set_mode(mode)
                workspace.set_ring_blocks(kernel_ring if ring is None else ring)
            comm(work, residual=res_work, weight=weight, eps=EPS, out=work,
                 residual_out=res_work)
        return call

    def alone() -> None:
        if modes:
            workspace.set_mode(None)
            workspace.set_ring_blocks(kernel_ring)
        comm(work, out=work)

    rows: dict[str, Any] = {FUSED: fused(), ALONE: alone}
    if modes:
        rows.update({name: fused(mode, ring) for name, (mode, ring) in MODES.items()})
    if "vllm" in peers:
        vllm, handle = peers["vllm"]

        def vllm_allreduce() -> None:
            if handle is None:  # vLLM without its shm op: torch.distributed on the group
                dist.all_reduce(work)
            else:
                vllm.shm_allreduce(handle, work)

        def vllm_norm() -> None:
            vllm_allreduce()
            vllm.fused_add_rms_norm(work, res_work, weight, EPS)

        rows["vllm"] = vllm_allreduce
        rows["vllm+norm"] = vllm_norm
    if "sglang" in peers:
        sgl = peers["sglang"]

        def sglang_norm() -> None:
            sgl.shm_allreduce(work, 0)  # 0: c10d's ReduceOp SUM, as SGLang passes it
            sgl.fused_add_rmsnorm_cpu(work, res_work, weight, EPS)

        rows["sglang"] = lambda: sgl.shm_allreduce(work, 0)
        if dname != "fp32":  # sgl-kernel's fused_add_rmsnorm_cpu: bf16 and fp16 only
            rows["sglang+norm"] = sglang_norm
    if ds is not None:
        rows["deepspeed"] = lambda: ds.inference_all_reduce(work)
    return rows


def _check(rows: dict[str, Any], reset: Any, xs: list[torch.Tensor], residual: torch.Tensor,
           weight: torch.Tensor, work: torch.Tensor, res_work: torch.Tensor, dname: str
           ) -> dict[str, float]:
    """Each row's worst error on this rank (in tolerances): a call on fresh inputs against the
    float64 reference; an all-reduce alone is checked on its sum, a fused row on its output
    and its new residual."""
    total, new_residual, out = reference(xs, residual, weight)
    errors = {}
    for name, call in rows.items():
        reset()
        call()
        if name.endswith("+norm") or name == FUSED or name in MODES:
            errors[name] = max(worst_error(work, out, dname),
                               worst_error(res_work, new_residual, dname))
        else:
            errors[name] = worst_error(work, total, dname)
    return errors


def _agreed_errors(errors: dict[str, float]) -> dict[str, float]:
    """Every row's worst error over all ranks (collective)."""
    import torch.distributed as dist

    worst = torch.tensor(list(errors.values()), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(errors, worst.tolist(), strict=True))


def _run_size(st: dict[str, Any], dname: str, tokens: int, comm: Any) -> None:
    """One size: inputs, the checks, the timing of the rows that passed, their figures."""
    import torch.distributed as dist

    from arfuse.bench.options import BenchOptions
    from arfuse.bench.timing import WARMUP, measure, slowest_medians, summary
    from arfuse.torch_types import TORCH_DTYPES

    opts: Options = st["opts"]
    dtype = TORCH_DTYPES[dname]
    x = torch.randn(tokens, opts.hidden, generator=st["gen"]).to(dtype)
    residual = torch.randn(tokens, opts.hidden, generator=st["same"]).to(dtype)
    weight = st["weights"][dname]
    work, res_work = x.clone(), residual.clone()

    def reset() -> None:
        work.copy_(x)
        res_work.copy_(residual)

    xs = [torch.empty(x.shape) for _ in range(st["world"])]
    dist.all_gather(xs, x.float())  # exact for the 16-bit dtypes; any dtype gloo sends
    rows = _rows(comm, st["peers"], st["ds"], dname, work, res_work, weight, opts.modes)
    errors = _agreed_errors(_check(rows, reset, xs, residual, weight, work, res_work, dname))
    st["checks"].append({"dtype": dname, "tokens": tokens,
                         "worst_error_in_tolerances": errors, "tolerance": TOLERANCE[dname]})
    passed = {name: (call, reset) for name, call in rows.items() if errors[name] <= 1.0}
    bench_opts = BenchOptions(world_size=st["world"], tokens=opts.tokens, hidden=opts.hidden,
                              dtypes=opts.dtypes, backends=(), out="",
                              min_seconds=opts.min_seconds, max_iters=opts.max_iters)
    times, _ = measure(passed, bench_opts, WARMUP + comm.workspace.copy_trial_calls)
    slowest = slowest_medians(times)
    for name, row_times in times.items():
        st["results"].append({"dtype": dname, "tokens": tokens, "row": name,
                              "bytes_per_rank": x.numel() * x.element_size(),
                              **summary(row_times),
                              "slowest_rank_median_us": slowest[name]})


def body(rank: int, world: int, opts: Options) -> int:
    """One rank of one run: every dtype and size; rank 0 writes the run's JSON."""
    import torch.distributed as dist

    import arfuse
    from arfuse.bench.baselines import clean_deepspeed_segments, deepspeed_setup
    from arfuse.bench.machine import machine_record
    from arfuse.bench.timing import run_tag
    from arfuse.launch import init_from_env, pin_to_core
    from arfuse.torch_types import TORCH_DTYPES

    torch.set_num_threads(opts.threads)
    ds, ds_note = None, "not requested"
    if opts.deepspeed:
        ds, ds_note = deepspeed_setup(rank)
    init_from_env("cpu")
    pinned = pin_to_core(rank, world, opts.threads)  # after init: gloo's threads stay free
    tag = run_tag()
    st: dict[str, Any] = {"opts": opts, "world": world, "ds": ds, "results": [],
                          "checks": [], "peers": _peer_ops(rank, world, opts, tag),
                          "gen": torch.Generator().manual_seed(1234 + rank),
                          "same": torch.Generator().manual_seed(4321), "weights": {}}
    omp = {name: int(ops[0].openmp_threads(0) if name == "vllm" else ops.openmp_threads(0))
           for name, ops in st["peers"].items()}
    for dname in opts.dtypes:
        dtype = TORCH_DTYPES[dname]
        st["weights"][dname] = (torch.rand(opts.hidden, generator=st["same"]) + 0.5).to(dtype)
        comm = arfuse.FusedAllReduce(max_token_num=max(opts.tokens), hidden_dim=opts.hidden,
                                     dtype=dtype, backend="shm", strict=True)
        for tokens in opts.tokens:
            _run_size(st, dname, tokens, comm)
            if rank == 0:
                print(f"  {dname} {tokens} tokens done", flush=True)
        comm.close()
    dist.barrier()
    if ds is not None:
        clean_deepspeed_segments()
    if rank == 0:
        report = {"machine": machine_record(pinned, world, opts.threads), "deepspeed": ds_note,
                  "openmp_threads": omp, "options": {k: v for k, v in asdict(opts).items()
                                                     if k != "notes"},
                  **opts.notes, "checks": st["checks"], "results": st["results"]}
        Path(opts.out).write_text(json.dumps(report, indent=1))
    return 0


def summarise(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per dtype, size and row: the median over runs of the slowest rank's median, every
    run's figure, and the multiple of arfuse's (``FUSED``) median at that size (None where
    arfuse's row is missing)."""
    figures: dict[tuple[str, int, str], list[float]] = {}
    for results in runs:
        for r in results:
            figures.setdefault((r["dtype"], r["tokens"], r["row"]), []).append(
                r["slowest_rank_median_us"])
    medians = {key: statistics.median(v) for key, v in figures.items()}
    rows = []
    for (dname, tokens, row), median in medians.items():
        fused = medians.get((dname, tokens, FUSED))
        rows.append({"dtype": dname, "tokens": tokens, "row": row, "median_us": median,
                     "per_run_us": figures[(dname, tokens, row)],
                     "x_arfuse": None if fused is None else median / fused})
    return rows


def table(summary: list[dict[str, Any]], machine: dict[str, Any], runs: int) -> str:
    """The summary as text: per dtype, microseconds per row and size, and the multiple of
    arfuse's (> 1: slower than arfuse)."""
    lines = [f"{machine.get('cpu', '?')}; {machine.get('isa', '?')}; arfuse kernel "
             f"{machine.get('kernel_isa', '?')}; torch {machine.get('torch', '?')}; "
             f"{machine.get('world_size', 2)} ranks x {machine.get('threads_per_rank', 1)} "
             f"thread(s), pinned: "
             f"{machine.get('ranks_pinned', '?')}",
             f"median us of the slowest rank, median over {runs} run(s); (x arfuse: the "
             f"row's time over {FUSED}'s)"]
    for dname in dict.fromkeys(r["dtype"] for r in summary):
        these = [r for r in summary if r["dtype"] == dname]
        names = [n for n in ROWS if any(r["row"] == n for r in these)]
        lines += ["", f"{dname}", f"{'tokens':>7}" + "".join(f" {n:>19}" for n in names)]
        for tokens in sorted({r["tokens"] for r in these}):
            by = {r["row"]: r for r in these if r["tokens"] == tokens}
            cells = []
            for n in names:
                r = by.get(n)
                if r is None:
                    cells.append(f" {'-':>19}")
                elif n == FUSED or r["x_arfuse"] is None:
                    cells.append(f" {r['median_us']:>19.1f}")
                else:
                    cells.append(f" {r['median_us']:>10.1f} ({r['x_arfuse']:>5.2f}x)")
            lines.append(f"{tokens:>7}" + "".join(cells))
    return "\n".join(lines)


def failed_checks(checks: list[dict[str, Any]]) -> list[str]:
    """One line per row and size whose result was off the reference (and so not timed)."""
    return [f"{c['dtype']} {c['tokens']} tokens: {row} off by {err:.3g} tolerances"
            for c in checks for row, err in c["worst_error_in_tolerances"].items()
            if err > 1.0]


def main() -> int:
    from arfuse.backends.shm import build as shm_build
    from arfuse.bench.baselines import prebuild_deepspeed
    from arfuse.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-src", required=True, help="a vLLM source root (csrc/cpu)")
    parser.add_argument("--sglang-src", default=None,
                        help="an SGLang source root (sgl-kernel/csrc/cpu); optional")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--dtype", default=",".join(DTYPES))
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=0.3,
                        help="about this long of timed calls per row and size (0.3)")
    parser.add_argument("--max-iters", type=int, default=400)
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="threads per rank: arfuse's intra-op threads and the peers' OpenMP "
                             "threads, each rank pinned to that many cores where there are "
                             "enough (1)")
    parser.add_argument("--modes", action="store_true",
                        help="also the fused call forced one-shot (with and without the ring) "
                             "and two-shot")
    parser.add_argument("--out", default="benchmarks/results/peers-now")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    avx512 = has_avx512()
    peers = [vllm_peer(Path(args.vllm_src).resolve(), avx512)]
    if args.sglang_src and not avx512:
        print("sgl-kernel builds for x86-64-v4 (AVX-512) only: its rows left out")
    elif args.sglang_src:
        peers.append(sglang_peer(Path(args.sglang_src).resolve()))
    for peer in peers:
        if missing_files(peer):
            parser.error(f"--{peer.name}-src {peer.root}: missing "
                         f"{', '.join(missing_files(peer))} (see the docstring for the files)")
    built = {peer.name: build(peer) for peer in peers}
    if shm_build.load() is None:
        raise SystemExit(f"arfuse's shm kernel is unavailable: {shm_build.why_not()}")
    deepspeed = False
    if not args.no_deepspeed:
        why = prebuild_deepspeed()
        deepspeed = not why
        if why:
            print(f"deepspeed unavailable, its row left out: {why}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = str(args.threads)
    os.environ["OMP_NUM_THREADS"] = threads  # the ranks' OpenMP, the peers' loops among it
    runs = []
    for i in range(args.runs):
        opts = Options(tokens=tuple(int(t) for t in args.tokens.split(",")),
                       hidden=args.hidden, dtypes=tuple(args.dtype.split(",")),
                       libraries={n: b["library"] for n, b in built.items()},
                       deepspeed=deepspeed, modes=args.modes, threads=args.threads,
                       min_seconds=args.min_seconds,
                       max_iters=args.max_iters, out=str(out / f"run{i}.json"),
                       notes={"peers": built})
        print(f"run {i + 1}/{args.runs}", flush=True)
        code = launch(body, 2, opts, env={"OMP_NUM_THREADS": threads, "ARFUSE_LOG": "warning"})
        if code != 0:
            raise SystemExit(f"run {i + 1} failed with exit status {code}")
        runs.append(json.loads(Path(opts.out).read_text()))
    summary = summarise([r["results"] for r in runs])
    text = table(summary, runs[0]["machine"], args.runs)
    failed = [line for r in runs for line in failed_checks(r["checks"])]
    if failed:
        text += "\n\nnot timed (result off the reference):\n" + "\n".join(failed)
    print(text)
    (out / "peers.txt").write_text(text + "\n")
    (out / "peers.json").write_text(json.dumps(
        {"machine": runs[0]["machine"], "deepspeed": runs[0]["deepspeed"], "peers": built,
         "openmp_threads": runs[0]["openmp_threads"], "runs": args.runs,
         "options": runs[0]["options"], "summary": summary,
         "checks": [r["checks"] for r in runs], "per_run": [r["results"] for r in runs]},
        indent=1))
    for i in range(args.runs):
        (out / f"run{i}.json").unlink()  # each run's figures are in peers.json
    print(f"wrote {out / 'peers.txt'}, {out / 'peers.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
