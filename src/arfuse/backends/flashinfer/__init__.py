"""``mnnvl`` and ``trtllm``: FlashInfer's fused all-reduce on NVIDIA GPUs (DESIGN 3.3, 4).

This module holds their descriptors (pure): hard requirements, quantisation fusion, and the
bytes each allocates per rank (FlashInfer 0.6.13). ``workspace`` creates and runs them.
"""

from __future__ import annotations

from ...catalog import BackendDescriptor, Footprint
from ...sizing import MIB, ceil_div, largest_fitting
from ...spec import Spec
from ...topology import Topology

SUPPORTED_SMS = frozenset({90, 100, 103})
TRTLLM_SMS_FROM_0_6_17 = frozenset({120, 121})
MNNVL_WORLD_SIZES = frozenset({2, 4, 8, 16, 32, 64})
TRTLLM_WORLD_SIZES = frozenset({2, 4, 8, 16})
MIN_VERSION = (0, 6, 13)


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


def _common_blocker(topology: Topology, spec: Spec, sms: frozenset[int]) -> str:
    if topology.device != "cuda":
        return f"needs CUDA, device is {topology.device}"
    if topology.flashinfer is None:
        return "flashinfer is not importable (pip install 'arfuse[flashinfer]')"
    if version_tuple(topology.flashinfer) < MIN_VERSION:
        return f"flashinfer {topology.flashinfer} is older than 0.6.13"
    if topology.sm is None:
        return "GPU compute capability unknown"
    if topology.sm not in sms:
        return f"SM {topology.sm} not supported (needs one of {sorted(sms)})"
    if spec.row_bytes % 16:
        return f"hidden*elem_size = {spec.row_bytes} bytes is not a multiple of 16"
    return ""


def mnnvl_blocker(topology: Topology, spec: Spec) -> str:
    why = _common_blocker(topology, spec, SUPPORTED_SMS)
    if why:
        return why
    if topology.world_size not in MNNVL_WORLD_SIZES:
        return f"world size {topology.world_size} not in {sorted(MNNVL_WORLD_SIZES)}"
    if topology.multicast is None:
        return "NVSwitch multicast unknown on some rank (treated as absent; vLLM #48071)"
    if not topology.multicast:
        return "no NVSwitch multicast on every rank (vLLM #48071: null multicast pointer)"
    if topology.node_count > 1 and not topology.fabric:
        return (f"{topology.node_count} nodes without an MNNVL fabric "
                "(vLLM #45800: rendezvous hangs)")
    return ""


def trtllm_blocker(topology: Topology, spec: Spec) -> str:
    sms = SUPPORTED_SMS
    if version_tuple(topology.flashinfer) >= (0, 6, 17):
        sms = sms | TRTLLM_SMS_FROM_0_6_17
    why = _common_blocker(topology, spec, sms)
    if why:
        return why
    if topology.world_size not in TRTLLM_WORLD_SIZES:
        return f"world size {topology.world_size} not in {sorted(TRTLLM_WORLD_SIZES)}"
    if topology.node_count > 1:
        return f"single node only, the group spans {topology.node_count} nodes"
    return ""


def trtllm_auto_blocker(topology: Topology, spec: Spec) -> str:
    """R3: without NVLink between every pair, trtllm fusion is slower than not fusing."""
    if topology.nvlink_all_pairs:
        return ""
    return ("auto skips trtllm without NVLink between all pairs: it measured ~10x slower than "
            "unfused (vLLM #48071)")


def trtllm_explicit_refusal(topology: Topology) -> str:
    if topology.node_count <= 1:
        return ""
    return (f"backend 'trtllm' does not support multi-node all-reduce: the group spans "
            f"{topology.node_count} nodes; use 'mnnvl' (needs an MNNVL fabric) or 'auto'")


def _nvfp4_fusable(topology: Topology, spec: Spec) -> bool:
    return spec.quant != "nvfp4" or ((topology.sm or 0) >= 100 and spec.dtype != "fp32")


def mnnvl_fuses_quant(topology: Topology, spec: Spec) -> bool:
    return (spec.quant is not None and _nvfp4_fusable(topology, spec)
            and version_tuple(topology.flashinfer) >= MIN_VERSION)


def trtllm_fuses_quant(topology: Topology, spec: Spec) -> bool:
    return spec.quant is not None and _nvfp4_fusable(topology, spec)


# --- bytes per rank (FlashInfer 0.6.13) ---------------------------------------------------------

def trtllm_footprint(world_size: int, spec: Spec, topology: Topology) -> Footprint:
    """About 4 * tp * S per rank, S = max_tokens * hidden * elem (DESIGN 4)."""
    return Footprint(4 * world_size * spec.max_tokens * spec.row_bytes, spec.max_tokens)


def mnnvl_use_oneshot(world_size: int, tokens: int, row_bytes: int) -> bool:
    return tokens * world_size * row_bytes <= MIB


def mnnvl_need(world_size: int, tokens: int, row_bytes: int) -> int:
    """Bytes of one buffer a call of ``tokens`` uses in the mode FlashInfer picks for it."""
    if mnnvl_use_oneshot(world_size, tokens, row_bytes):
        return tokens * world_size * row_bytes
    return 2 * ceil_div(tokens, world_size) * world_size * row_bytes


def mnnvl_buffer_bytes(world_size: int, spec: Spec) -> int:
    """One of the three rotating buffers (B in DESIGN 4)."""
    oneshot_tokens = min(MIB // (world_size * spec.row_bytes), spec.max_tokens)
    return max(oneshot_tokens * world_size * spec.row_bytes,
               2 * ceil_div(spec.max_tokens, world_size) * world_size * spec.row_bytes)


def mnnvl_footprint(world_size: int, spec: Spec, topology: Topology) -> Footprint:
    """Triple-buffered: only one buffer serves a call (vLLM #50877), so capacity is the largest
    token count whose mode fits one buffer (R1)."""
    buffer = mnnvl_buffer_bytes(world_size, spec)
    capacity = largest_fitting(spec.max_tokens, lambda tokens: mnnvl_need(
        world_size, tokens, spec.row_bytes) <= buffer)
    return Footprint(3 * buffer, capacity)


DESCRIPTORS = (
    BackendDescriptor(
        name="mnnvl", fused=True, devices=("cuda",), auto_rank=0,
        implementation="arfuse.backends.flashinfer.workspace:MnnvlBackend",
        blocker=mnnvl_blocker, fuses_quant=mnnvl_fuses_quant, footprint=mnnvl_footprint),
    BackendDescriptor(
        name="trtllm", fused=True, devices=("cuda",), auto_rank=1,
        implementation="arfuse.backends.flashinfer.workspace:TrtllmBackend",
        blocker=trtllm_blocker, auto_blocker=trtllm_auto_blocker,
        explicit_refusal=trtllm_explicit_refusal, fuses_quant=trtllm_fuses_quant,
        footprint=trtllm_footprint),
)
