"""The decision: settings + topology + spec -> Plan. Pure: no I/O, no logging, no collectives.

Every rank computes the plan from the same merged facts, so every rank gets the same plan (R7).
The table is DESIGN 3.3; each rule cites the field failure it designs out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import catalog
from .settings import Settings
from .spec import Spec
from .topology import Topology


@dataclass(frozen=True)
class Candidate:
    backend: str
    viable: bool
    reason: str
    quant_fusion: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "viable": self.viable, "reason": self.reason}


@dataclass(frozen=True)
class Plan:
    """The outcome of ``resolve``: what to try, in which order, and why."""

    requested: str
    explicit: bool
    strict: bool
    candidates: tuple[Candidate, ...]
    backend: str
    allow_fallback: bool
    fused: bool
    quant_fusion: bool
    node_count: int
    world_size: int
    device: str
    spec: Spec
    workspace_bytes: int
    max_fused_tokens: int
    warnings: tuple[str, ...] = field(default=())
    unknown_facts: tuple[tuple[str, str], ...] = field(default=())
    """(fact, why) for topology facts some rank could not read; the rules took them as absent."""

    @property
    def viable(self) -> tuple[str, ...]:
        """Backends negotiation will try, in order."""
        return tuple(c.backend for c in self.candidates if c.viable)

    def candidate(self, backend: str) -> Candidate:
        for cand in self.candidates:
            if cand.backend == backend:
                return cand
        raise KeyError(backend)

    def to_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "explicit": self.explicit,
            "backend": self.backend,
            "candidates": [c.to_dict() for c in self.candidates],
            "allow_fallback": self.allow_fallback,
            "fused": self.fused,
            "quant_fusion": self.quant_fusion,
            "node_count": self.node_count,
            "workspace_bytes": self.workspace_bytes,
            "max_fused_tokens": self.max_fused_tokens,
            "warnings": list(self.warnings),
            # only when some fact is unknown, so the keys of a fully known plan stay as they were
            **({"unknown_facts": dict(self.unknown_facts)} if self.unknown_facts else {}),
        }

    def explain(self) -> str:
        """A short human account: candidates with viable/why, the choice, bytes, capacity."""
        spec = self.spec
        quant = spec.quant or "none"
        lines = [
            f"arfuse plan: requested={self.requested}{' (strict)' if self.strict else ''}, "
            f"device={self.device}, world_size={self.world_size}, nodes={self.node_count}",
            f"spec: max_tokens={spec.max_tokens} hidden={spec.hidden} dtype={spec.dtype} "
            f"quant={quant}",
        ]
        if self.unknown_facts:
            lines.append("unknown facts (treated as absent):")
            lines.extend(f"  {name}: {why}" for name, why in self.unknown_facts)
        lines += ["", f"  {'candidate':<8} {'viable':<7} why"]
        for cand in self.candidates:
            mark = "yes" if cand.viable else "no"
            lines.append(f"  {cand.backend:<8} {mark:<7} {cand.reason}")
        lines.append("")
        kind = "fused" if self.fused else "unfused"
        lines.append(f"chosen: {self.backend} ({kind}); fallback to another fused backend: "
                     f"{'allowed' if self.allow_fallback else 'no'}")
        if spec.quant:
            lines.append(f"quantisation ({spec.quant}): "
                         f"{'fused' if self.quant_fusion else 'separate step after the fused op'}")
        mib = self.workspace_bytes / 2**20
        lines.append(f"workspace: {mib:.2f} MiB per rank; fused capacity: "
                     f"{self.max_fused_tokens} tokens per call")
        for warning in self.warnings:
            lines.append(f"warning: {warning}")
        return "\n".join(lines)


def resolve(settings: Settings, topology: Topology, spec: Spec,
            blocked: Mapping[str, str] | None = None) -> Plan:
    """The plan for ``spec`` on ``topology`` under ``settings`` (DESIGN 3.3).

    ``blocked`` names backends this installation or some rank's local check cannot run, with
    why; they are listed but never offered.
    """
    blocked = blocked or {}
    requested = settings.backend
    explicit = requested != "auto"
    order: tuple[catalog.BackendDescriptor, ...]
    if explicit:
        refusal = catalog.get(requested).explicit_refusal(topology)
        if refusal:
            raise ValueError(refusal)
        order = () if requested == catalog.UNFUSED else (catalog.get(requested),)
    else:
        order = catalog.auto_order(topology.device)

    warnings: list[str] = []
    candidates: list[Candidate] = []
    for descriptor in order:
        name = descriptor.name
        why = descriptor.blocker(topology, spec) or blocked.get(name, "")
        if not why and not explicit:
            why = descriptor.auto_blocker(topology, spec)
        if not why and descriptor.footprint(topology.world_size, spec, topology).capacity < 1:
            why = "its workspace would hold no call of this spec (fused capacity 0 tokens)"
        fuses_quant = not why and descriptor.fuses_quant(topology, spec)
        candidates.append(Candidate(name, not why, why or "meets every requirement",
                                    fuses_quant))
        if explicit and why:
            warnings.append(f"requested backend {name!r} cannot run here: {why}")

    strict_forbids = settings.strict and requested != catalog.UNFUSED
    unfused_blocked = blocked.get(catalog.UNFUSED, "")  # a local check: fault injection
    unfused_reason = ("ARFUSE_STRICT=1 forbids the unfused fallback" if strict_forbids
                      else unfused_blocked or "unfused: all-reduce then the epilogue; runs "
                      "everywhere")
    candidates.append(Candidate(catalog.UNFUSED, not strict_forbids and not unfused_blocked,
                                unfused_reason))

    viable = [c for c in candidates if c.viable]
    if not viable:
        if strict_forbids:
            reasons = "; ".join(f"{c.backend}: {c.reason}" for c in candidates[:-1])
            raise ValueError(f"ARFUSE_STRICT=1 and no fused backend can run here ({reasons})")
        reasons = "; ".join(f"{c.backend}: {c.reason}" for c in candidates)
        raise ValueError(f"no backend can run here ({reasons})")
    chosen = viable[0]
    chosen_descriptor = catalog.get(chosen.backend)
    fused_viable = [c for c in viable if catalog.get(c.backend).fused]
    if spec.quant and chosen_descriptor.fused and not chosen.quant_fusion:
        warnings.append(f"{chosen.backend} cannot fuse {spec.quant} here; it runs as a separate "
                        "step after the fused op")
    if not explicit and not chosen_descriptor.fused and topology.world_size > 1:
        warnings.append("no fused backend can run here; using the unfused torch.distributed path")
    footprint = chosen_descriptor.footprint(topology.world_size, spec, topology)
    return Plan(
        requested=requested,
        explicit=explicit,
        strict=settings.strict,
        candidates=tuple(candidates),
        backend=chosen.backend,
        allow_fallback=not explicit and len(fused_viable) > 1,
        fused=chosen_descriptor.fused,
        quant_fusion=chosen.quant_fusion,
        node_count=topology.node_count,
        world_size=topology.world_size,
        device=topology.device,
        spec=spec,
        workspace_bytes=footprint.bytes_per_rank,
        max_fused_tokens=footprint.capacity,
        warnings=tuple(warnings),
        unknown_facts=tuple(topology.unknown.items()),
    )
