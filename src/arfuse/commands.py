"""The CLI commands that start ranks or inspect the machine: ``run``, ``bench``, ``doctor``."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from . import policy, settings, topology
from .spec import Spec

DEFAULT_TOKENS = "1,8,64,512"
BENCH_TOKENS = ",".join(str(2**i) for i in range(13))


def add_subcommands(sub: Any, add_spec_flags: Callable[[argparse.ArgumentParser], None],
                    positive_int: Callable[[str], int], int_list: Callable[[str], list[int]],
                    dtype_list: Callable[[str], list[str]]) -> None:
    p = sub.add_parser("run", help="the main job: row-parallel layer + fused all-reduce, "
                       "checked against a reference and timed against the unfused path")
    p.add_argument("--world-size", type=positive_int, default=2, help="ranks (2)")
    p.add_argument("--tokens", type=int_list, default=DEFAULT_TOKENS,
                   help=f"token counts ({DEFAULT_TOKENS})")
    p.add_argument("--steps", type=positive_int, default=50, help="timed steps per size (50)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when there is a GPU per rank, else cpu")
    p.add_argument("--strict", action="store_true", default=None,
                   help="fail instead of running unfused")
    add_spec_flags(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bench", help="latency sweep: shm vs torch (gloo) vs deepspeed")
    p.add_argument("--world-size", type=positive_int, default=2, help="ranks (2)")
    p.add_argument("--tokens", type=int_list, default=BENCH_TOKENS,
                   help="token counts (1,2,4,...,4096)")
    p.add_argument("--hidden", type=positive_int, default=4096, help="hidden size (4096)")
    p.add_argument("--dtype", type=dtype_list, default="bf16,fp32", help="dtypes (bf16,fp32)")
    p.add_argument("--backends", default="shm,torch,deepspeed",
                   help="rows to measure (shm,torch,deepspeed)")
    p.add_argument("--out", default="bench-out", help="folder for bench.json/.txt/.png")
    p.add_argument("--min-seconds", type=float, default=0.3,
                   help="measure each row for about this long (0.3)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("doctor", help="what this machine has, and which backends can run")
    p.add_argument("--world-size", type=positive_int, default=None,
                   help="ranks to check for (default: GPUs, or 2 on CPU)")
    p.set_defaults(func=cmd_doctor)


def _tokens(value: Any) -> tuple[int, ...]:
    if isinstance(value, str):
        return tuple(int(v) for v in value.split(","))
    return tuple(value)


def _default_device(world: int) -> str:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        return "cuda"
    return "cpu"


def cmd_run(args: argparse.Namespace) -> int:
    from .job_run import RunOptions, run_body
    from .launch import launch

    settings.load(backend=args.backend)  # a bad ARFUSE_* is one line here, not one per rank
    device = args.device or _default_device(args.world_size)
    Spec(max_tokens=max(_tokens(args.tokens)), hidden=args.hidden, dtype=args.dtype,
         quant=args.quant)
    opts = RunOptions(world_size=args.world_size, tokens=_tokens(args.tokens),
                      hidden=args.hidden, dtype=args.dtype, quant=args.quant, steps=args.steps,
                      backend=args.backend, device=device, strict=args.strict)
    # the job prints the plan itself; the log repeats it only if asked (ARFUSE_LOG=info)
    return launch(run_body, args.world_size, opts,
                  env={"ARFUSE_LOG": os.environ.get("ARFUSE_LOG", "warning")})


def cmd_bench(args: argparse.Namespace) -> int:
    from .job_bench import BenchOptions, bench_body
    from .launch import launch

    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    unknown = set(backends) - {"shm", "torch", "deepspeed"}
    if unknown:
        raise ValueError(f"--backends: unknown {sorted(unknown)}; use shm, torch, deepspeed")
    if args.world_size < 2:
        raise ValueError("--world-size must be >= 2 for a benchmark of a collective")
    dtypes = tuple(args.dtype) if not isinstance(args.dtype, str) else tuple(
        args.dtype.split(","))
    opts = BenchOptions(world_size=args.world_size, tokens=_tokens(args.tokens),
                        hidden=args.hidden, dtypes=dtypes, backends=backends, out=args.out,
                        min_seconds=args.min_seconds)
    if "deepspeed" in backends:
        _prebuild_deepspeed()
    if "shm" in backends:
        from .backends import shm_build

        shm_build.load()  # build once here, not in every rank at once
    # the report names the backend and its negotiation time; the plan log would only cut
    # through the progress bar (ARFUSE_LOG=info brings it back)
    return launch(bench_body, args.world_size, opts,
                  env={"OMP_NUM_THREADS": "1",
                       "ARFUSE_LOG": os.environ.get("ARFUSE_LOG", "warning")})


def _prebuild_deepspeed() -> None:
    """Build DeepSpeed's shm op once before the ranks start (about a minute the first time)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.accelerator import get_accelerator

        get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
    except Exception as exc:  # the bench then reports deepspeed as unavailable
        print(f"arfuse bench: deepspeed unavailable: {type(exc).__name__}: {exc}")


def cmd_doctor(args: argparse.Namespace) -> int:
    import torch

    from .backends import registry, shm, shm_build

    device = topology.default_device()
    world = args.world_size or (max(torch.cuda.device_count(), 1) if device == "cuda" else 2)
    topo = topology.this_machine(world, device)
    print(f"arfuse doctor: {topo.world_size} ranks on this machine ({device})")
    print(f"  torch {torch.__version__}; flashinfer {topo.flashinfer or 'not installed'}")
    from .machine import cpu_flags

    isa = cpu_flags() & {"avx2", "avx512f", "avx512bw", "fma", "f16c", "asimd"}
    print(f"  cores {os.cpu_count()}; ISA {' '.join(sorted(isa)) or 'unknown'}")
    if device == "cuda":
        print(f"  GPU {topo.gpu}, SM {topo.sm}; multicast/NVLink/fabric not detected yet "
              "(treated as absent)")
    cxx = shm_build.compiler()
    print(f"  C++ compiler: {cxx or 'none'}")
    module = shm_build.load()
    kernel = (f"compiled ({module.__file__})" if module
              else f"pure-torch path: {shm_build.why_not()}")
    print(f"  shm kernel: {kernel}")
    try:
        stat = os.statvfs(shm.SHM_DIR)
        print(f"  {shm.SHM_DIR}: {stat.f_bavail * stat.f_frsize / 2**30:.1f} GiB free")
    except OSError as exc:
        print(f"  {shm.SHM_DIR}: not usable ({exc.strerror})")
    missing = registry.missing()
    spec = Spec(max_tokens=2048, hidden=4096, dtype="bf16")
    print("\n  backend  can run here  why")
    for name in ("mnnvl", "trtllm", "shm", "torch"):
        why = policy.requirement(name, topo, spec) or missing.get(name, "")
        print(f"  {name:<8} {'yes' if not why else 'no':<13} {why or 'ok'}")
    plan = policy.resolve(settings.load(), topo, spec, missing)
    print(f"\n  auto picks: {plan.backend} for {world} ranks (arfuse explain shows why)")
    removed = shm.clean_stale_segments()
    print(f"  stale shm segments of dead jobs removed: {len(removed)}")
    return 0
