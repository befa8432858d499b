"""``mnnvl`` and ``trtllm``: FlashInfer's fused all-reduce on NVIDIA GPUs (DESIGN 3.3, 4).

This module holds their descriptors (pure): hard requirements, quantisation fusion, and the
bytes each allocates per rank for the FlashInfer version the topology names (``sizes``; the
primary version is 0.7.2.post1, the oldest supported 0.6.13). ``workspace`` creates and runs
them.
"""

from __future__ import annotations

from ...catalog import BackendDescriptor, Footprint
from ...pattern import Pattern
from ...sizing import largest_fitting
from ...spec import Spec
from ...topology import Topology
from . import group_rules, moe_rules
from .sizes import (
    MIN_VERSION,
    UINT32_MAX,
    mnnvl_bytes,
    mnnvl_need,
    mnnvl_requested_buffer,
    mnnvl_usable_buffer,
    mnnvl_use_oneshot,
    sizing_version,
    trtllm_bytes,
    trtllm_capacity,
    version_tuple,
)

__all__ = ["DESCRIPTORS", "MIN_VERSION", "mnnvl_buffer_bytes", "mnnvl_footprint", "mnnvl_need",
           "mnnvl_use_oneshot", "trtllm_footprint", "version_tuple"]

SUPPORTED_SMS = frozenset({90, 100, 103})
TRTLLM_SMS_FROM_0_6_17 = frozenset({120, 121})
MNNVL_WORLD_SIZES = frozenset({2, 4, 8, 16, 32, 64})
TRTLLM_WORLD_SIZES = frozenset({2, 4, 8, 16})
FP8_DYNAMIC_FROM = (0, 6, 15)
"""Patterns 10/11 (per-token dynamic FP8) exist in both backends from 0.6.15 (trtllm_ar.py,
allreduce.py); the kernels' scale rule is the same through 0.7.2.post1."""


def _common_unmet(topology: Topology, spec: Spec, sms: frozenset[int]) -> str:
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


def mnnvl_unmet(topology: Topology, spec: Spec) -> str:
    why = _common_unmet(topology, spec, SUPPORTED_SMS)
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
    buffer = mnnvl_requested_buffer(sizing_version(topology.flashinfer), topology.world_size,
                                    spec.max_tokens, spec.row_bytes)
    if buffer > UINT32_MAX:
        # the constructor raises ValueError on every rank: refuse before any rank enters it
        return (f"one mnnvl buffer would need {buffer} bytes, above FlashInfer's limit of "
                f"{UINT32_MAX} (UINT32_MAX); lower max_token_num")
    return ""


def trtllm_unmet(topology: Topology, spec: Spec) -> str:
    sms = SUPPORTED_SMS
    if version_tuple(topology.flashinfer) >= (0, 6, 17):
        sms = sms | TRTLLM_SMS_FROM_0_6_17
    why = _common_unmet(topology, spec, sms)
    if why:
        return why
    if topology.world_size not in TRTLLM_WORLD_SIZES:
        return f"world size {topology.world_size} not in {sorted(TRTLLM_WORLD_SIZES)}"
    if topology.node_count > 1:
        return f"single node only, the group spans {topology.node_count} nodes"
    return ""


def trtllm_auto_skip(topology: Topology, spec: Spec) -> str:
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


def _fusable(topology: Topology, spec: Spec, pattern: Pattern) -> bool:
    """FlashInfer's patterns: the all-reduce alone, or with (residual and) RMSNorm, then
    optionally quantised (it has no quantisation without RMSNorm). NVFP4 needs SM >= 100 and a
    16-bit dtype; ``fp8_dynamic`` (patterns 10/11) needs a FlashInfer that has the patterns
    (``FP8_DYNAMIC_FROM``); ``fp8_group`` is trtllm's alone (``group_rules``), so not here, nor
    is an output of the table that FlashInfer has no pattern for (the op quantises it apart)."""
    if pattern.quant is None:
        return True
    if not pattern.norm:
        return False
    if pattern.quant == "nvfp4":
        return (topology.sm or 0) >= 100 and spec.dtype != "fp32"
    if pattern.quant == "fp8_dynamic":
        return version_tuple(topology.flashinfer) >= FP8_DYNAMIC_FROM
    # fp8_group is trtllm's alone; an output FlashInfer has no pattern for is not fused
    return pattern.quant == "fp8"


def mnnvl_fuses(topology: Topology, spec: Spec, pattern: Pattern) -> bool:
    """Quantised patterns from ``MIN_VERSION`` on; no MoE pattern (``moe_rules.TRTLLM_ONLY``:
    its expert step runs on its own, then the fused all-reduce)."""
    return not pattern.moe and _fusable(topology, spec, pattern) and (
        pattern.quant is None or version_tuple(topology.flashinfer) >= MIN_VERSION)


def trtllm_fuses(topology: Topology, spec: Spec, pattern: Pattern) -> bool:
    """The MoE patterns as FlashInfer's 6/7 run them (``moe_rules.pattern_refusal``: bf16 or
    fp16, with RMSNorm, the quantisation after); a call of one may still run its expert step
    apart (``moe_rules.call_refusal``, which ``explain`` lists as ``trtllm_notes``).
    ``fp8_group`` in the ``ue8m0_packed`` format as FlashInfer's pattern 9 runs it
    (``group_rules``; a call whose group size the launcher refuses quantises in torch)."""
    if pattern.moe:
        return not moe_rules.pattern_refusal(spec, pattern)
    if pattern.quant == group_rules.QUANT:
        return not group_rules.pattern_refusal(pattern)
    return _fusable(topology, spec, pattern)


def trtllm_notes(topology: Topology, spec: Spec) -> tuple[str, ...]:
    return moe_rules.explain_notes(spec) + group_rules.explain_notes(spec, fused=True)


def mnnvl_notes(topology: Topology, spec: Spec) -> tuple[str, ...]:
    return group_rules.explain_notes(spec, fused=False)


# --- bytes per rank, for the topology's FlashInfer version (formulas and sources: sizes.py) ----

def trtllm_footprint(world_size: int, spec: Spec, topology: Topology) -> Footprint:
    """Three IPC buffers: ``W*T*H*2`` (``*4`` for fp32 from 0.7.2), ``W*256*4`` flags and
    ``3*W*T*H*elem`` Lamport bytes, each rounded by its allocator (about ``8*W*T*H`` in 16-bit
    dtypes, ``14*W*T*H`` in fp32 before 0.7.2 and ``16*W*T*H`` from 0.7.2)."""
    version = sizing_version(topology.flashinfer)
    return Footprint(
        trtllm_bytes(version, world_size, spec.max_tokens, spec.hidden, spec.elem_size),
        trtllm_capacity(version, world_size, spec.max_tokens, spec.elem_size))


def mnnvl_buffer_bytes(world_size: int, spec: Spec, flashinfer: str | None = None) -> int:
    """What one of the three rotating buffers holds (B in DESIGN 4) on that version."""
    return mnnvl_usable_buffer(sizing_version(flashinfer), world_size, spec.max_tokens,
                               spec.row_bytes)


def mnnvl_footprint(world_size: int, spec: Spec, topology: Topology) -> Footprint:
    """Triple-buffered: only one buffer serves a call (vLLM #50877), so capacity is the largest
    token count whose mode fits one buffer (R1)."""
    version = sizing_version(topology.flashinfer)
    buffer = mnnvl_usable_buffer(version, world_size, spec.max_tokens, spec.row_bytes)
    capacity = largest_fitting(spec.max_tokens, lambda tokens: mnnvl_need(
        world_size, tokens, spec.row_bytes) <= buffer)
    return Footprint(mnnvl_bytes(version, world_size, spec.max_tokens, spec.row_bytes),
                     capacity)


DESCRIPTORS = (
    BackendDescriptor(
        name="mnnvl", fused=True, devices=("cuda",), auto_rank=0,
        implementation="arfuse.backends.flashinfer.workspace:MnnvlBackend",
        unmet=mnnvl_unmet, fuses=mnnvl_fuses, notes=mnnvl_notes, footprint=mnnvl_footprint),
    BackendDescriptor(
        name="trtllm", fused=True, devices=("cuda",), auto_rank=1,
        implementation="arfuse.backends.flashinfer.workspace:TrtllmBackend",
        unmet=trtllm_unmet, auto_skip=trtllm_auto_skip,
        explicit_refusal=trtllm_explicit_refusal, fuses=trtllm_fuses, notes=trtllm_notes,
        footprint=trtllm_footprint),
)
