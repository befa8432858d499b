"""The decision: settings + topology + spec -> Plan. Pure: no I/O, no logging, no collectives.

Every rank computes the plan from the same merged facts, so every rank gets the same plan (R7).
The table is DESIGN 3.3; each rule cites the field failure it designs out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import sizing
from .settings import Settings
from .spec import Spec
from .topology import Topology

FUSED_BACKENDS: tuple[str, ...] = ("mnnvl", "trtllm", "shm")
FLASHINFER_SMS = frozenset({90, 100, 103})
TRTLLM_SMS_FROM_0_6_17 = frozenset({120, 121})
MNNVL_WORLD_SIZES = frozenset({2, 4, 8, 16, 32, 64})
TRTLLM_WORLD_SIZES = frozenset({2, 4, 8, 16})
SHM_MAX_WORLD_SIZE = 16
FLASHINFER_MIN = (0, 6, 13)


def version_tuple(version: str | None) -> tuple[int, ...]:
    """``"0.6.13.post1"`` -> ``(0, 6, 13)``; ``None`` or junk -> ``()``."""
    if not version:
        return ()
    parts: list[int] = []
    for piece in version.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


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
            "",
            f"  {'candidate':<8} {'viable':<7} why",
        ]
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


# --- hard requirements (R2), one function per backend: "" when met, else why not -----------

def _common_flashinfer(topo: Topology, spec: Spec, sms: frozenset[int]) -> str:
    if topo.device != "cuda":
        return f"needs CUDA, device is {topo.device}"
    if topo.flashinfer is None:
        return "flashinfer is not importable (pip install 'arfuse[flashinfer]')"
    if version_tuple(topo.flashinfer) < FLASHINFER_MIN:
        return f"flashinfer {topo.flashinfer} is older than 0.6.13"
    if topo.sm is None:
        return "GPU compute capability unknown"
    if topo.sm not in sms:
        return f"SM {topo.sm} not supported (needs one of {sorted(sms)})"
    if spec.row_bytes % 16:
        return f"hidden*elem_size = {spec.row_bytes} bytes is not a multiple of 16"
    return ""


def _mnnvl_requirement(topo: Topology, spec: Spec) -> str:
    why = _common_flashinfer(topo, spec, FLASHINFER_SMS)
    if why:
        return why
    if topo.world_size not in MNNVL_WORLD_SIZES:
        return f"world size {topo.world_size} not in {sorted(MNNVL_WORLD_SIZES)}"
    if topo.multicast is None:
        return "NVSwitch multicast unknown on some rank (treated as absent; vLLM #48071)"
    if not topo.multicast:
        return "no NVSwitch multicast on every rank (vLLM #48071: null multicast pointer)"
    if topo.node_count > 1 and not topo.fabric:
        return (f"{topo.node_count} nodes without an MNNVL fabric "
                "(vLLM #45800: rendezvous hangs)")
    return ""


def _trtllm_requirement(topo: Topology, spec: Spec) -> str:
    sms = FLASHINFER_SMS
    if version_tuple(topo.flashinfer) >= (0, 6, 17):
        sms = sms | TRTLLM_SMS_FROM_0_6_17
    why = _common_flashinfer(topo, spec, sms)
    if why:
        return why
    if topo.world_size not in TRTLLM_WORLD_SIZES:
        return f"world size {topo.world_size} not in {sorted(TRTLLM_WORLD_SIZES)}"
    if topo.node_count > 1:
        return f"single node only, the group spans {topo.node_count} nodes"
    return ""


def _shm_requirement(topo: Topology, spec: Spec) -> str:
    if topo.device != "cpu":
        return f"needs CPU tensors, device is {topo.device}"
    if topo.node_count > 1:
        return f"single node only, the group spans {topo.node_count} nodes"
    if not 2 <= topo.world_size <= SHM_MAX_WORLD_SIZE:
        return f"world size {topo.world_size} not in 2..{SHM_MAX_WORLD_SIZE}"
    return ""


_REQUIREMENTS: dict[str, Callable[[Topology, Spec], str]] = {
    "mnnvl": _mnnvl_requirement,
    "trtllm": _trtllm_requirement,
    "shm": _shm_requirement,
}


def requirement(backend: str, topo: Topology, spec: Spec) -> str:
    """Why ``backend`` cannot run on ``topo`` for ``spec`` ("" when it can)."""
    if backend == "torch":
        return ""
    return _REQUIREMENTS[backend](topo, spec)


def quant_fusion(backend: str, topo: Topology, spec: Spec) -> bool:
    """Whether ``backend`` fuses the requested quantisation (not a viability requirement)."""
    if spec.quant is None or backend == "torch":
        return False
    if backend == "shm":
        return True
    if spec.quant == "nvfp4" and ((topo.sm or 0) < 100 or spec.dtype == "fp32"):
        return False
    if backend == "mnnvl":
        return version_tuple(topo.flashinfer) >= FLASHINFER_MIN
    return True  # trtllm: FP8 on every supported version, NVFP4 checked above


def _auto_order(topo: Topology) -> tuple[str, ...]:
    return ("mnnvl", "trtllm") if topo.device == "cuda" else ("shm",)


def resolve(settings: Settings, topology: Topology, spec: Spec,
            unavailable: Mapping[str, str] | None = None) -> Plan:
    """The plan for ``spec`` on ``topology`` under ``settings`` (DESIGN 3.3).

    ``unavailable`` names backends this installation or some rank's probe cannot run, with why;
    they are listed but never offered.
    """
    unavailable = unavailable or {}
    requested = settings.backend
    explicit = requested != "auto"
    if requested == "trtllm" and topology.node_count > 1:
        raise ValueError(
            f"backend 'trtllm' does not support multi-node all-reduce: the group spans "
            f"{topology.node_count} nodes; use 'mnnvl' (needs an MNNVL fabric) or 'auto'"
        )

    warnings: list[str] = []
    candidates: list[Candidate] = []
    if explicit:
        order: tuple[str, ...] = (requested,) if requested != "torch" else ()
    else:
        order = _auto_order(topology)
    for backend in order:
        why = requirement(backend, topology, spec) or unavailable.get(backend, "")
        if not why and backend == "trtllm" and not explicit and not topology.nvlink_all_pairs:
            # R3: without NVLink between every pair, trtllm fusion is slower than not fusing.
            why = ("auto skips trtllm without NVLink between all pairs: it measured ~10x slower "
                   "than unfused (vLLM #48071)")
        fuses_quant = not why and quant_fusion(backend, topology, spec)
        candidates.append(Candidate(backend, not why, why or "meets every requirement",
                                    fuses_quant))
        if explicit and why:
            warnings.append(f"requested backend {backend!r} cannot run here: {why}")

    unfused_allowed = not settings.strict or requested == "torch"
    torch_reason = ("unfused: all-reduce then the epilogue; runs everywhere" if unfused_allowed
                    else "ARFUSE_STRICT=1 forbids the unfused fallback")
    candidates.append(Candidate("torch", unfused_allowed, torch_reason))

    viable = [c for c in candidates if c.viable]
    if not viable:
        reasons = "; ".join(f"{c.backend}: {c.reason}" for c in candidates[:-1])
        raise ValueError(f"ARFUSE_STRICT=1 and no fused backend can run here ({reasons})")
    chosen = viable[0]
    fused_viable = [c for c in viable if c.backend in FUSED_BACKENDS]
    if spec.quant and chosen.backend != "torch" and not chosen.quant_fusion:
        warnings.append(f"{chosen.backend} cannot fuse {spec.quant} here; it runs as a separate "
                        "step after the fused op")
    if not explicit and chosen.backend == "torch" and topology.world_size > 1:
        warnings.append("no fused backend can run here; using the unfused torch.distributed path")
    workspace_bytes, capacity = sizing.predict(chosen.backend, topology.world_size, spec)
    return Plan(
        requested=requested,
        explicit=explicit,
        strict=settings.strict,
        candidates=tuple(candidates),
        backend=chosen.backend,
        allow_fallback=not explicit and len(fused_viable) > 1,
        fused=chosen.backend in FUSED_BACKENDS,
        quant_fusion=chosen.quant_fusion,
        node_count=topology.node_count,
        world_size=topology.world_size,
        device=topology.device,
        spec=spec,
        workspace_bytes=workspace_bytes,
        max_fused_tokens=capacity,
        warnings=tuple(warnings),
    )
