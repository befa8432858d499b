"""Two builds of the shm kernel in the same two ranks: calls alternate between them in blocks,
so drift of a shared machine (10-20% between runs on a 2-core VM) hits both alike.

    python benchmarks/ab_kernels.py --a /tmp/old/src --b src --tokens 64,512 --dtype bf16,fp32

Each source tree is built by its own ``arfuse`` package (``build.build_tree``: ``build.load()``
with the tree first on PYTHONPATH; the kernel cache keys builds by source hash), and both compiled
modules are loaded into each rank, each over a shared segment of its own. Per dtype, token
count and form (``inplace``: ``out=x, residual_out=residual``, as vLLM calls it; ``new``: new
output tensors; ``new-read``: new output tensors, then one read of both, timed with the call,
as the next op's first pass over them; ``plain``: the all-reduce alone, in place;
``plain-new``: the all-reduce alone into a new tensor, as vLLM's out-of-place all-reduce),
every round runs a block of calls of each build (the first calls of a block untimed), the
builds' order rotating from round to round, after warm-up rounds that outlast the kernel's
copy-mode trial; the table gives each build's median and the ratio B / A.
``--a-stores``/``--b-stores`` set how each build stores a call's own outputs (auto, cached,
streaming; trees that have ``set_output_stores``): one tree as A and B compares the modes.
``--a-replicated``/``--b-replicated`` give a build the promise of a residual that is the same on
every rank (``set_replicated_residual``; the residual here is drawn alike on every rank).
Both trees need a module-local ``ShmComm`` (bindings.cpp), i.e. a tree from the commit that
introduced this script on. The inputs are rewritten before every call, untimed.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from shm_common import DTYPES

from arfuse.backends.shm import layout as shm_layout
from arfuse.backends.shm.build import build_tree, load_file
from arfuse.backends.shm.workspace import oneshot_bytes
from arfuse.launch import init_from_env, launch, pin_to_core

DTYPE_CODE = {"bf16": 0, "fp16": 1, "fp32": 2}
FORMS = ("inplace", "new", "new-read", "plain", "plain-new")
STORES = ("auto", "cached", "streaming")  # the kernel's output-store codes are the indices
EPS = 1e-6


@dataclass(frozen=True)
class Options:
    modules: tuple[str, str]
    tokens: tuple[int, ...]
    dtypes: tuple[str, ...]
    forms: tuple[str, ...]
    hidden: int
    rounds: int
    warm_rounds: int
    block: int
    out: str
    stores: tuple[str, str] = ("auto", "auto")
    replicated: tuple[bool, bool] = (False, False)


def make_comms(modules: list[ModuleType], rank: int, world: int, opts: Options,
               keep: list[Any]) -> dict[tuple[str, int], Any]:
    """One ShmComm per (dtype, build), each over a segment file both ranks map."""
    comms = {}
    max_tokens = max(opts.tokens)
    for dname in opts.dtypes:
        element = torch.tensor([], dtype=DTYPES[dname]).element_size()
        layout = shm_layout.ShmLayout(world, max_tokens, opts.hidden, element)
        for i, module in enumerate(modules):
            path = Path(f"/dev/shm/arfuse-ab-{os.environ['MASTER_PORT']}-{dname}-{i}")
            if rank == 0:
                with open(path, "wb") as f:
                    f.truncate(layout.total_bytes)
            dist.barrier()
            f = open(path, "r+b")  # noqa: SIM115 - kept open while the mapping lives
            mapped = mmap.mmap(f.fileno(), layout.total_bytes)
            memory = torch.frombuffer(mapped, dtype=torch.uint8)
            keep.extend((f, mapped, memory))
            comms[(dname, i)] = module.ShmComm(
                memory.data_ptr(), world, rank, max_tokens, opts.hidden, DTYPE_CODE[dname],
                shm_layout.HEADER_BYTES, layout.slot_bytes, layout.input_bytes, 30.0, 8 * 1024)
            if hasattr(comms[(dname, i)], "set_oneshot_bytes"):  # the workspace's rule
                comms[(dname, i)].set_oneshot_bytes(*oneshot_bytes(world, None))
            if opts.stores[i] != "auto":
                comms[(dname, i)].set_output_stores(STORES.index(opts.stores[i]))
            if opts.replicated[i]:
                comms[(dname, i)].set_replicated_residual(True)
            dist.barrier()
            if rank == 0:
                path.unlink()
    return comms


def body(rank: int, world: int, opts: Options) -> int:
    torch.set_num_threads(1)
    init_from_env("cpu")
    pin_to_core(rank, world)
    modules = [load_file(p) for p in opts.modules]
    keep: list[Any] = []
    comms = make_comms(modules, rank, world, opts, keep)
    gen = torch.Generator().manual_seed(7 + rank)
    same_everywhere = torch.Generator().manual_seed(11)  # the residual, replicated as in TP
    rows = []
    for dname in opts.dtypes:
        dtype = DTYPES[dname]
        weight = (torch.rand(opts.hidden, generator=gen) + 0.5).to(dtype)
        for tokens in opts.tokens:
            x0 = torch.randn(tokens, opts.hidden, generator=gen).to(dtype)
            r0 = torch.randn(tokens, opts.hidden, generator=same_everywhere).to(dtype)
            x, residual = x0.clone(), r0.clone()
            for form in opts.forms:
                times: list[list[float]] = [[], []]
                # warm up past the copy-mode trial (cached and streaming calls in turn), so
                # that the timed calls run the mode each build decided
                trial = max(int(m.copy_trial_calls) for m in modules)
                warm = max(opts.warm_rounds, -(-trial // (2 + opts.block)) + 1)
                for round_ in range(warm + opts.rounds):
                    for turn in range(2):
                        i = (round_ + turn) % 2  # A first in even rounds, B first in odd
                        comm = comms[(dname, i)]
                        for k in range(2 + opts.block):
                            x.copy_(x0)
                            residual.copy_(r0)
                            t0 = time.perf_counter_ns()
                            if form == "inplace":
                                comm.run(x, residual, weight, EPS, 0.0, 0, 0.0, x,
                                         residual)
                            elif form == "new":
                                comm.run(x, residual, weight, EPS, 0.0, 0, 0.0, None,
                                         None)
                            elif form == "new-read":
                                outs = comm.run(x, residual, weight, EPS, 0.0, 0, 0.0,
                                                None, None)
                                for t in outs[:2]:
                                    t.view(torch.int64).sum()
                            elif form == "plain":
                                comm.run(x, None, None, EPS, 0.0, 0, 0.0, x, None)
                            else:
                                comm.run(x, None, None, EPS, 0.0, 0, 0.0, None, None)
                            took = (time.perf_counter_ns() - t0) / 1e3
                            if k >= 2 and round_ >= warm:
                                times[i].append(took)
                a, b = (statistics.median(t) for t in times)
                rows.append({"dtype": dname, "tokens": tokens, "form": form, "a_us": a,
                             "b_us": b, "b_over_a": b / a, "calls": len(times[0])})
    if rank == 0:
        report(rows, opts, modules)
    dist.barrier()
    return 0


def report(rows: list[dict[str, Any]], opts: Options, modules: list[ModuleType]) -> None:
    from arfuse.machine import cpu_model

    isa = sorted({str(m.isa) for m in modules})
    print(f"{cpu_model()}, kernel {' / '.join(isa)}, hidden {opts.hidden}, world size 2, "
          f"output stores A {opts.stores[0]}, B {opts.stores[1]}, replicated residual "
          f"A {opts.replicated[0]}, B {opts.replicated[1]}, "
          f"median us of {rows[0]['calls']} calls per build and row")
    print(f"{'dtype':>5} {'tokens':>6} {'form':>8} {'A':>10} {'B':>10} {'B/A':>7}")
    for r in rows:
        print(f"{r['dtype']:>5} {r['tokens']:>6} {r['form']:>8} {r['a_us']:>10.1f} "
              f"{r['b_us']:>10.1f} {r['b_over_a']:>7.3f}")
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(
            {"cpu": cpu_model(), "kernel_isa": isa, "modules": list(opts.modules),
             "output_stores": list(opts.stores), "replicated_residual": list(opts.replicated),
             "hidden": opts.hidden, "rounds": opts.rounds, "block": opts.block,
             "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, indent=2))
        print(f"wrote {opts.out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="source tree A (the baseline)")
    parser.add_argument("--b", required=True, help="source tree B")
    parser.add_argument("--tokens", default="1,8,64,512,2048")
    parser.add_argument("--dtype", default="bf16,fp32")
    parser.add_argument("--forms", default="inplace,new,plain")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warm-rounds", type=int, default=3)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--out", default="")
    parser.add_argument("--a-stores", default="auto", choices=STORES,
                        help="how build A stores a call's own outputs (set_output_stores; "
                             "the same tree for A and B compares the modes)")
    parser.add_argument("--b-stores", default="auto", choices=STORES)
    parser.add_argument("--a-replicated", action="store_true",
                        help="build A with replicated_residual (set_replicated_residual)")
    parser.add_argument("--b-replicated", action="store_true")
    args = parser.parse_args()
    forms = tuple(args.forms.split(","))
    if not set(forms) <= set(FORMS):
        parser.error(f"--forms: use some of {', '.join(FORMS)}")
    dtypes = tuple(args.dtype.split(","))
    if not set(dtypes) <= set(DTYPE_CODE):
        parser.error(f"--dtype: use some of {', '.join(DTYPE_CODE)}")
    try:
        modules = (build_tree(args.a), build_tree(args.b))
    except ValueError as exc:  # a tree without a compiled kernel
        raise SystemExit(str(exc)) from None
    opts = Options(modules, tuple(int(t) for t in args.tokens.split(",")), dtypes, forms,
                   args.hidden, args.rounds, args.warm_rounds, args.block, args.out,
                   (args.a_stores, args.b_stores), (args.a_replicated, args.b_replicated))
    env = {"OMP_NUM_THREADS": "1", "ARFUSE_LOG": "warning"}
    return launch(body, 2, opts, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
