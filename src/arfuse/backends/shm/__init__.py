"""``shm``: CPU ranks of one node through one shared-memory segment and a fused C++ kernel.

This module is the backend's descriptor (pure); ``backend`` creates the workspace (collective),
``segment`` the segment's file and its life on disk, ``workspace`` runs it, ``build`` compiles
the kernel, ``layout`` describes the segment.
"""

from __future__ import annotations

from ...catalog import BackendDescriptor, Footprint
from ...pattern import Pattern
from ...sizing import ceil_div
from ...spec import Spec
from ...topology import Topology
from .layout import MAX_TOKENS, MAX_WORLD, ShmLayout


def unmet(topology: Topology, spec: Spec) -> str:
    if topology.device != "cpu":
        return f"needs CPU tensors, device is {topology.device}"
    if topology.node_count > 1:
        return f"single node only, the group spans {topology.node_count} nodes"
    if not 2 <= topology.world_size <= MAX_WORLD:
        return f"world size {topology.world_size} not in 2..{MAX_WORLD}"
    if spec.max_tokens > MAX_TOKENS:
        return f"max_tokens {spec.max_tokens} is over the kernel's limit of {MAX_TOKENS}"
    return ""


def fuses(topology: Topology, spec: Spec, pattern: Pattern) -> bool:
    """Every pattern, MoE ones included, on every ISA path (NVFP4 and fp8_group where their
    rows allow it; fp8_group's group size is checked per call)."""
    return not pattern.output.problem(spec.dtype, spec.hidden)


def layout_of(world_size: int, spec: Spec) -> ShmLayout:
    return ShmLayout(world_size, spec.max_tokens, spec.hidden, spec.elem_size)


def footprint(world_size: int, spec: Spec, topology: Topology) -> Footprint:
    """The segment, shared by the group: each rank reserves its own slots."""
    return Footprint(ceil_div(layout_of(world_size, spec).total_bytes, world_size),
                     spec.max_tokens)


DESCRIPTORS = (BackendDescriptor(
    name="shm", fused=True, devices=("cpu",), auto_rank=0,
    implementation="arfuse.backends.shm.backend:ShmBackend",
    unmet=unmet, fuses=fuses,
    footprint=footprint),)
