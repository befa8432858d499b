"""``arfuse explain``: what arfuse would pick, and why (DESIGN 3.7)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .. import catalog, faults, policy, settings, topology
from ..launch import JobRanks, check_ranks
from ..spec import Spec
from . import args as cli_args


def add_parser(sub: Any) -> None:
    p = sub.add_parser("explain", help="what arfuse would pick, and why")
    p.add_argument("--topology", default=None, help="topology JSON (default: this machine)")
    p.add_argument("--world-size", type=cli_args.world_size, default=None,
                   help="ranks, for this machine without --topology (default: GPUs, or 2 on CPU)")
    p.add_argument("--max-tokens", type=cli_args.call_size, default=2048,
                   help="tokens per call (2048)")
    cli_args.add_spec_flags(p)
    p.add_argument("--strict", action="store_true", default=None,
                   help="no unfused fallback (ARFUSE_STRICT=1)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


LOCAL_CHECKS_RUN = "run on this machine, as creating the op runs them"
LOCAL_CHECKS_NOT_RUN = ("not run: the plan is for the topology file, not this machine; each "
                        "rank runs them when it creates the op")


def installation_blockers() -> dict[str, str]:
    """Backends whose implementation this installation cannot import, with why."""
    from ..negotiate import backend_instance

    blocked: dict[str, str] = {}
    for name in catalog.names():
        backend = backend_instance(name)
        if isinstance(backend, str):
            blocked[name] = backend
    return blocked


def this_machine_blockers(conf: settings.Settings, world: int, device: str,
                          spec: Spec) -> dict[str, str]:
    """What the local checks of creation (``negotiate.local_blockers``: free space in the shm
    directory, a usable kernel, CUDA, FlashInfer) refuse here, for one rank of ``world`` on
    this machine, and what this installation cannot import."""
    from ..group import GroupContext
    from ..negotiate import local_blockers
    from ..rendezvous import Channel

    what_if = GroupContext(group=None, rank=0, world_size=world, device=device, key="explain",
                           channel=Channel(None, "arfuse/explain", 0, 1), settings=conf)
    return {**installation_blockers(), **local_blockers(what_if, spec)}


def resolve(conf: settings.Settings, topo: topology.Topology, spec: Spec,
            blocked: dict[str, str] | None = None) -> policy.Plan:
    """The plan, with what the ranks would refuse first raised here: a malformed
    ARFUSE_FAULTS (the same error as in the API), an explicit backend the topology refuses,
    strict with nothing fused. ``blocked``: the backends that cannot run (default: what this
    installation cannot import)."""
    faults.parse(conf.faults)
    return policy.resolve(conf, topo, spec,
                          installation_blockers() if blocked is None else blocked)


def job_settings(backend: str | None = None,
                 strict: bool | None = None) -> tuple[settings.Settings, topology.Topology | None]:
    """Before a CLI job starts its ranks, what each would fail on reading its settings, as one
    line and exit 2 here: the ARFUSE_* values, ARFUSE_FAULTS, the ARFUSE_TOPOLOGY file (which
    is returned, or None)."""
    conf = settings.load(backend=backend, strict=strict)
    faults.parse(conf.faults)
    return conf, topology.load(conf.topology_path) if conf.topology_path else None


def check_job(backend: str | None, strict: bool | None, ranks: JobRanks, device: str,
              spec: Spec) -> None:
    """``job_settings``, ranks this machine cannot hold (``launch.check_ranks``), an
    ARFUSE_TOPOLOGY file of another group size, and a plan that cannot run, with the local
    checks each rank started here will run. Ranks a launcher such as torchrun started may
    span hosts: their plan is left to the facts they gather."""
    conf, file_topology = job_settings(backend, strict)
    check_ranks(ranks, device)
    if file_topology is not None:
        file_topology.check_rank_count(ranks.world, "job")
    if ranks.started_here:
        resolve(conf, file_topology or topology.this_machine(ranks.world, device), spec,
                this_machine_blockers(conf, ranks.world, device, spec))
    elif file_topology is not None:
        resolve(conf, file_topology, spec)


def run(args: argparse.Namespace) -> int:
    conf = settings.load(backend=args.backend, strict=args.strict)
    spec = Spec(max_tokens=args.max_tokens, hidden=args.hidden, dtype=args.dtype, quant=args.quant)
    kernel = ""  # the shm kernel this machine builds, and why (this machine's plans only)
    if args.topology or conf.topology_path:
        topo = (topology.load(args.topology, "--topology") if args.topology
                else topology.load(str(conf.topology_path)))
        plan, checks = resolve(conf, topo, spec), LOCAL_CHECKS_NOT_RUN
    else:
        device = topology.default_device()
        world = args.world_size or cli_args.default_world_size(device)
        plan = resolve(conf, topology.this_machine(world, device), spec,
                       this_machine_blockers(conf, world, device, spec))
        checks = LOCAL_CHECKS_RUN
        if device == "cpu":
            from ..backends.shm import build as shm_build

            kernel = shm_build.summary()
    if args.json:
        print(json.dumps({**plan.to_dict(), "local_checks": checks,
                          **({"shm_kernel": kernel} if kernel else {})}, indent=2))
    else:
        print(f"{plan.explain()}\nlocal checks: {checks}" +
              (f"\nshm kernel here: {kernel}" if kernel else ""))
    return 0
