"""The decision: settings + topology + spec -> Plan. Pure: no I/O, no logging, no collectives.

Every rank computes the plan from the same merged facts, so every rank gets the same plan (R7).
The table is DESIGN 3.3; each rule cites the field failure it designs out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import catalog
from .pattern import ALL as ALL_PATTERNS
from .pattern import ALL_REDUCE, QUANT_OUTPUTS, Pattern
from .settings import Settings
from .spec import Spec
from .topology import Topology


@dataclass(frozen=True)
class Candidate:
    backend: str
    viable: bool
    reason: str
    quant_fusion: bool = False
    fuses: tuple[str, ...] = ()
    """Names of the patterns it fuses for this spec here (``arfuse.pattern``)."""
    notes: tuple[str, ...] = ()
    """When a call of those patterns still runs in steps (``BackendDescriptor.notes``)."""

    def to_dict(self) -> dict[str, Any]:
        # notes only where there are some, so the keys of the other candidates stay as they were
        return {"backend": self.backend, "viable": self.viable, "reason": self.reason,
                "fuses": list(self.fuses), **({"notes": list(self.notes)} if self.notes else {})}


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
        lines += ["", "patterns fused (arfuse.pattern):"]
        for cand in self.candidates:
            lines.append(f"  {cand.backend:<8} {pattern_list(cand.fuses)}")
            lines.extend(f"  {'':<8} {note}" for note in cand.notes)
        lines.append("")
        kind = "fused" if self.fused else "unfused"
        lines.append(f"chosen: {self.backend} ({kind}); fallback to another fused backend: "
                     f"{'allowed' if self.allow_fallback else 'no'}")
        if spec.quant:
            fused, apart = quant_layouts(spec.quant, self.candidate(self.backend).fuses)
            how = ("fused" if not apart else "separate step after the fused op" if not fused
                   else f"fused in {', '.join(fused)}; a separate step after the fused op in "
                   f"{', '.join(apart)}")
            lines.append(f"quantisation ({spec.quant}): {how}")
        mib = self.workspace_bytes / 2**20
        lines.append(f"workspace: {mib:.2f} MiB per rank; fused capacity: "
                     f"{self.max_fused_tokens} tokens per call")
        for warning in self.warnings:
            lines.append(f"warning: {warning}")
        return "\n".join(lines)


def quant_layouts(quant: str, fuses: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The scale layouts of ``quant`` (``["-"]`` for a quant with one) whose pattern after
    residual + RMSNorm is among ``fuses``, and the others."""
    fused: list[str] = []
    apart: list[str] = []
    for output in QUANT_OUTPUTS:
        if output.quant == quant:
            name = Pattern("residual_rmsnorm", quant, output.layout).name
            (fused if name in fuses else apart).append(output.layout or "-")
    return fused, apart


def pattern_list(names: tuple[str, ...]) -> str:
    """The patterns a backend fuses, in a few words (``explain``, ``doctor``)."""
    if not names:
        return "no pattern (each step on its own)"
    if len(names) == len(ALL_PATTERNS):
        return f"all {len(names)}"
    fused = set(names)
    missing = [p for p in ALL_REDUCE if p.name not in fused]
    # a quantised pattern not fused whose unquantised one is runs in two steps (ops.run_on)
    if any(not p.quantised or p.without_quant().name not in fused for p in missing):
        return ", ".join(names)
    moe = [name for name in names if name.startswith("moe_")]
    head = f"every all-reduce pattern ({len(ALL_REDUCE)})" if not missing else (
        f"every all-reduce pattern ({len(ALL_REDUCE) - len(missing)} of {len(ALL_REDUCE)}; "
        f"{_in_steps(missing)})")
    return head + "; " + (", ".join(moe) if moe
                          else "no MoE pattern (its expert step runs on its own)")


def _in_steps(missing: list[Pattern]) -> str:
    """The quantised all-reduce patterns a backend runs as its fused op and then the
    quantisation in torch, in a few words: the outputs after RMSNorm, and any without it."""
    layouts: dict[str, list[str]] = {}
    for p in missing:
        if p.norm and p.quant is not None:
            kept = layouts.setdefault(p.quant, [])
            if p.layout and p.layout not in kept:
                kept.append(p.layout)
    parts = []
    if layouts:
        parts.append(", ".join(q + (f" ({', '.join(lay)})" if lay else "")
                               for q, lay in layouts.items())
                     + ": norm fused, quantisation in torch")
    if any(not p.norm for p in missing):
        parts.append("a quantisation without RMSNorm: the all-reduce fused, then torch")
    return "; ".join(parts)


def resolve(settings: Settings, topology: Topology, spec: Spec,
            blocked: Mapping[str, str] | None = None) -> Plan:
    """The plan for ``spec`` on ``topology`` under ``settings`` (DESIGN 3.3).

    ``blocked`` names backends this installation or some rank's local check cannot run, with
    why; they are listed but never offered.
    """
    blocked = blocked or {}
    requested = settings.backend
    explicit = requested != "auto"
    candidates = [_candidate(d, topology, spec, blocked, explicit)
                  for d in _fused_order(requested, topology)]
    candidates.append(_unfused_candidate(settings, blocked))
    viable = [c for c in candidates if c.viable]
    if not viable:
        raise ValueError(_nothing_viable(settings, candidates))
    chosen = viable[0]
    chosen_descriptor = catalog.get(chosen.backend)
    footprint = chosen_descriptor.footprint(topology.world_size, spec, topology)
    return Plan(
        requested=requested,
        explicit=explicit,
        strict=settings.strict,
        candidates=tuple(candidates),
        backend=chosen.backend,
        allow_fallback=not explicit and sum(catalog.get(c.backend).fused for c in viable) > 1,
        fused=chosen_descriptor.fused,
        quant_fusion=chosen.quant_fusion,
        node_count=topology.node_count,
        world_size=topology.world_size,
        device=topology.device,
        spec=spec,
        workspace_bytes=footprint.bytes_per_rank,
        max_fused_tokens=footprint.capacity,
        warnings=tuple(_warnings(candidates, chosen, explicit, topology, spec)),
        unknown_facts=tuple(topology.unknown.items()),
    )


def _fused_order(requested: str, topology: Topology) -> tuple[catalog.BackendDescriptor, ...]:
    """The fused backends to consider: the one asked for, or ``auto``'s order."""
    if requested == "auto":
        return catalog.auto_order(topology.device)
    refusal = catalog.get(requested).explicit_refusal(topology)
    if refusal:
        raise ValueError(refusal)
    return () if requested == catalog.UNFUSED else (catalog.get(requested),)


def _candidate(descriptor: catalog.BackendDescriptor, topology: Topology, spec: Spec,
               blocked: Mapping[str, str], explicit: bool) -> Candidate:
    name = descriptor.name
    why = descriptor.unmet(topology, spec) or blocked.get(name, "")
    if not why and not explicit:
        why = descriptor.auto_skip(topology, spec)
    if not why and descriptor.footprint(topology.world_size, spec, topology).capacity < 1:
        why = "its workspace would hold no call of this spec (fused capacity 0 tokens)"
    fuses = tuple(p.name for p in catalog.fused_patterns(descriptor, topology, spec))
    # the spec's quantisation as FlashInfer fuses it: after (residual and) RMSNorm, in some
    # scale layout of it (explain names the layouts)
    return Candidate(name, not why, why or "meets every requirement",
                     not why and spec.quant is not None
                     and bool(quant_layouts(spec.quant, fuses)[0]), fuses,
                     () if why else descriptor.notes(topology, spec))


def _unfused_candidate(settings: Settings, blocked: Mapping[str, str]) -> Candidate:
    """The unfused backend ends every plan, unless strict forbids it or a local check (fault
    injection) blocked it."""
    strict_forbids = settings.strict and settings.backend != catalog.UNFUSED
    why = ("ARFUSE_STRICT=1 forbids the unfused fallback" if strict_forbids
           else blocked.get(catalog.UNFUSED, ""))
    return Candidate(catalog.UNFUSED, not why,
                     why or "unfused: all-reduce then the epilogue; runs everywhere")


def _nothing_viable(settings: Settings, candidates: list[Candidate]) -> str:
    if settings.strict and settings.backend != catalog.UNFUSED:
        reasons = "; ".join(f"{c.backend}: {c.reason}" for c in candidates[:-1])
        return f"ARFUSE_STRICT=1 and no fused backend can run here ({reasons})"
    reasons = "; ".join(f"{c.backend}: {c.reason}" for c in candidates)
    return f"no backend can run here ({reasons})"


def _warnings(candidates: list[Candidate], chosen: Candidate, explicit: bool,
              topology: Topology, spec: Spec) -> list[str]:
    warnings = [f"requested backend {c.backend!r} cannot run here: {c.reason}"
                for c in candidates[:-1] if explicit and not c.viable]
    fused = catalog.get(chosen.backend).fused
    if spec.quant and fused and not chosen.quant_fusion:
        warnings.append(f"{chosen.backend} cannot fuse {spec.quant} here; it runs as a separate "
                        "step after the fused op")
    if not explicit and not fused and topology.world_size > 1:
        warnings.append("no fused backend can run here; using the unfused torch.distributed path")
    return warnings
