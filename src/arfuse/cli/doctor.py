"""``arfuse doctor``: what this machine has, and for each backend whether it can run here."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .. import catalog, policy, settings, topology
from ..dtypes import DTYPES
from ..spec import Spec
from . import args as cli_args
from .explain import this_machine_blockers


def add_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="what this machine has, and which backends can run")
    p.add_argument("--world-size", type=cli_args.world_size, default=None,
                   help="ranks to check for (default: GPUs, or 2 on CPU)")
    p.set_defaults(func=run)


def _value(value: object, why: str | None) -> str:
    if value is None:
        return f"unknown ({why or 'not reported'})"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def gpu_lines(facts: topology.LocalFacts, topo: topology.Topology) -> list[str]:
    """Each GPU fact of this process's device with its value, or why it is unknown (an unknown
    fact is treated as absent, so this is where to look when ``auto`` does not fuse)."""
    why = facts.unknown
    lines = [f"  GPU {_value(facts.gpu, why.get('gpu'))}, SM {_value(facts.sm, why.get('sm'))}"
             f"{f' ({facts.gpu_id})' if facts.gpu_id else ''}",
             f"  multicast:     {_value(facts.multicast, why.get('multicast'))}"]
    if facts.nvlink_peers is None:
        nvlink = _value(None, why.get("nvlink_all_pairs"))
    else:
        count = len(facts.nvlink_peers)
        nvlink = f"P2P to {count} other GPU{'' if count == 1 else 's'} of this host"
        if topo.world_size > 1:
            every = _value(topo.nvlink_all_pairs, topo.unknown.get("nvlink_all_pairs"))
            nvlink += f"; every pair of {topo.world_size} ranks: {every}"
    lines.append(f"  NVLink:        {nvlink}")
    fabric = _value(facts.fabric, why.get("fabric"))
    if facts.fabric:
        fabric += f" (cluster {facts.fabric_cluster}, clique {facts.fabric_clique})"
    lines.append(f"  MNNVL fabric:  {fabric}")
    return lines


def run(args: argparse.Namespace) -> int:
    import torch

    from ..backends.shm import build as shm_build
    from ..backends.shm import segment as shm_segment
    from ..machine import cpu_flags

    device = topology.default_device()
    world = args.world_size or cli_args.default_world_size(device)
    facts = topology.local_facts(device)
    topo = topology.this_machine(world, device, facts)
    print(f"arfuse doctor: {topo.world_size} ranks on this machine ({device})")
    print(f"  torch {torch.__version__}; flashinfer {topo.flashinfer or 'not installed'}")
    isa = cpu_flags() & {"avx2", "avx512f", "avx512bw", "fma", "f16c", "asimd", "bf16"}
    print(f"  cores {os.cpu_count()}; ISA {' '.join(sorted(isa)) or 'unknown'}")
    if device == "cuda":
        for line in gpu_lines(facts, topo):
            print(line)
    print(f"  C++ compiler: {shm_build.compiler() or 'none'}")
    module = shm_build.load()
    print(f"  shm kernel: {shm_build.summary()}")
    if module is not None:
        print(f"  shm kernel file: {module.__file__}")
    if module is not None:
        print(f"  own outputs: {_output_stores(module)}")
    directory = shm_segment.segment_dir()
    try:
        stat = os.statvfs(directory)
        print(f"  {directory}: {stat.f_bavail * stat.f_frsize / 2**30:.1f} GiB free")
    except OSError as exc:
        print(f"  {directory}: not usable ({exc.strerror})")
    conf = settings.load()
    spec = Spec(max_tokens=2048, hidden=4096, dtype="bf16")
    blocked = this_machine_blockers(conf, world, device, spec)  # what creation checks here
    print("\n  backend  can run here  why")
    for descriptor in catalog.descriptors():
        why = descriptor.unmet(topo, spec) or blocked.get(descriptor.name, "")
        print(f"  {descriptor.name:<8} {'yes' if not why else 'no':<13} {why or 'ok'}")
    plan = policy.resolve(conf, topo, spec, blocked)
    print("\n  patterns each fuses here (arfuse.pattern; a MoE pattern a backend does not fuse "
          "runs its expert step first)")
    for cand in plan.candidates:
        print(f"  {cand.backend:<8} {policy.pattern_list(cand.fuses)}")
    print(f"\n  {picks_label(conf)}: {plan.backend} for {world} ranks (arfuse explain shows why)")
    removed = shm_segment.clean_stale_segments()
    print(f"  stale shm segments of dead jobs removed: {len(removed)}")
    return 0


def picks_label(conf: settings.Settings) -> str:
    """Who picks: auto, or the settings the environment sets (doctor resolves with them)."""
    chosen = [f"{settings.ENV_VARS[key]}={value}" for key, value in
              (("backend", conf.backend), ("strict", int(conf.strict))) if value not in ("auto", 0)]
    return "auto picks" if not chosen else f"with {', '.join(chosen)} arfuse picks"


def _output_stores(module: Any) -> str:
    """When the kernel build stores a call's own outputs with streaming stores
    (stream_output_min_bytes per dtype, counted over all of a call's own outputs)."""
    by_size: dict[str, list[str]] = {}
    for dtype in DTYPES.values():
        size = int(module.stream_output_min_bytes(dtype.code))
        by_size.setdefault("never" if size >= 2**62 else f"{size / 2**20:g} MiB",
                           []).append(dtype.name)
    if list(by_size) == ["never"]:
        return "cached stores at every size (this build never streams them)"
    return ("streaming stores once a call's come to "
            + ", ".join(f"{text} ({', '.join(names)})" for text, names in by_size.items())
            + "; smaller calls, and in place: cached")
