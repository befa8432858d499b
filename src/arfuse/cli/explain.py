"""``arfuse explain``: what arfuse would pick, and why (DESIGN 3.7)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .. import catalog, faults, policy, settings, topology
from ..spec import Spec
from . import args as cli_args


def add_parser(sub: Any) -> None:
    p = sub.add_parser("explain", help="what arfuse would pick, and why")
    p.add_argument("--topology", default=None, help="topology JSON (default: this machine)")
    p.add_argument("--world-size", type=cli_args.positive_int, default=None,
                   help="ranks, for this machine without --topology (default: GPUs, or 2 on CPU)")
    p.add_argument("--max-tokens", type=cli_args.positive_int, default=2048,
                   help="tokens per call (2048)")
    cli_args.add_spec_flags(p)
    p.add_argument("--strict", action="store_true", default=None,
                   help="no unfused fallback (ARFUSE_STRICT=1)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _topology(args: argparse.Namespace, conf: settings.Settings) -> topology.Topology:
    if args.topology:
        return topology.load(args.topology, "--topology")
    if conf.topology_path:
        return topology.load(conf.topology_path)
    device = topology.default_device()
    world = args.world_size or cli_args.default_world_size(device)
    return topology.this_machine(world, device)


def installation_blockers() -> dict[str, str]:
    """Backends whose implementation this installation cannot import, with why."""
    from ..negotiate import backend_instance

    blocked: dict[str, str] = {}
    for name in catalog.names():
        backend = backend_instance(name)
        if isinstance(backend, str):
            blocked[name] = backend
    return blocked


def resolve(conf: settings.Settings, topo: topology.Topology, spec: Spec) -> policy.Plan:
    """The plan, with what the ranks would refuse first raised here: a malformed
    ARFUSE_FAULTS (the same error as in the API), an explicit backend the topology refuses,
    strict with nothing fused."""
    faults.parse(conf.faults)
    return policy.resolve(conf, topo, spec, installation_blockers())


def job_settings(backend: str | None = None,
                 strict: bool | None = None) -> tuple[settings.Settings, topology.Topology | None]:
    """Before a CLI job starts its ranks, what each would fail on reading its settings, as one
    line and exit 2 here: the ARFUSE_* values, ARFUSE_FAULTS, the ARFUSE_TOPOLOGY file (which
    is returned, or None)."""
    conf = settings.load(backend=backend, strict=strict)
    faults.parse(conf.faults)
    return conf, topology.load(conf.topology_path) if conf.topology_path else None


def check_job(backend: str | None, strict: bool | None, world_size: int, device: str,
              spec: Spec) -> None:
    """``job_settings``, and a plan that cannot run or CUDA that is not there."""
    conf, file_topology = job_settings(backend, strict)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
            raise ValueError(f"--device cuda: this machine has {torch.cuda.device_count()} "
                             f"usable CUDA device(s) for {world_size} ranks")
    resolve(conf, file_topology or topology.this_machine(world_size, device), spec)


def run(args: argparse.Namespace) -> int:
    conf = settings.load(backend=args.backend, strict=args.strict)
    topo = _topology(args, conf)
    spec = Spec(max_tokens=args.max_tokens, hidden=args.hidden, dtype=args.dtype, quant=args.quant)
    plan = resolve(conf, topo, spec)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.explain())
    return 0
