"""When FlashInfer runs an ``fp8_group`` call in its kernel, and when the norm runs fused and
the quantisation in torch after it (docs/design.md 3.6, 4). Pure: the descriptors, the
workspace's run and ``explain`` read the same rules, and ``tests/contract/flashinfer_contract.py``
checks them against the real 0.6.13 and 0.7.2.post1.

Read in those releases (``flashinfer/comm/allreduce.py``, ``trtllm_ar.py``,
``include/flashinfer/comm/trtllm_allreduce_fusion.cuh``), the same in both:

* ``kARResidualRMSNormPerTokenGroupFP8PackedQuant = 8`` and ``...OutPerTokenGroupFP8PackedQuant
  = 9`` (9 also writes the norm output, which every arfuse call returns: arfuse runs 9) exist
  for trtllm workspaces only; mnnvl has no per-token-group pattern;
* they write UE8M0 scales only: ``s = max(amax / 448, 1e-10)`` rounded up to a power of two by
  its bits, its exponent byte, four groups per int32; ``scale_out`` int32 ``[T, ceil(G/4)]``
  with strides ``(1, ceil(T/4)*4)`` (the unified API raises ``ValueError`` otherwise), the
  argument ``block_quant_group_size``; ``q = e4m3(y / s)`` clamped to +-448, ``y`` the norm
  output rounded to the activation dtype (bf16, fp16 and fp32 are dispatched);
* the launcher widens each block until it holds whole groups (``cluster_size`` halved,
  threads doubled) and refuses a block over 1024 threads (``FLASHINFER_CHECK``: a raise inside
  the call, on the GPU only): ``launch_refusal`` predicts that from hidden, dtype and group.

The ``fp32`` and ``fp32_column_major`` formats are not FlashInfer's: their calls run pattern 1
(residual + RMSNorm, fused) and then the quantisation in torch (``arfuse.quant.quantize``,
the reference's bytes for the kernel's norm output).
"""

from __future__ import annotations

from ...pattern import GROUP_SIZES, Pattern
from ...spec import Spec
from .moe_rules import BYTES_PER_ACCESS, MAX_BLOCK_THREADS, MAX_CLUSTER

QUANT = "fp8_group"
K_GROUP_FP8, K_OUT_GROUP_FP8 = 8, 9      # AllReduceFusionPattern
FUSED_LAYOUT = "ue8m0_packed"             # the one scale format patterns 8/9 write
MIN_BLOCK_THREADS = 128                   # the launcher widens smaller blocks to this

NOT_IN_FLASHINFER = ("fp8_group: not in FlashInfer (mnnvl has no per-token-group FP8 pattern; "
                     "8/9 run on trtllm workspaces only): norm fused, quantisation in torch")
NEEDS_NORM = "fp8_group without RMSNorm: FlashInfer quantises only after its RMSNorm"


def layout_refusal(layout: str | None) -> str:
    """Why trtllm does not quantise to this scale format in its kernel ("" when it does)."""
    if layout == FUSED_LAYOUT:
        return ""
    return (f"fp8_group {layout}: norm fused, quantisation in torch (FlashInfer's patterns "
            f"8/9 write {FUSED_LAYOUT} scales only)")


def pattern_refusal(pattern: Pattern) -> str:
    """Why trtllm does not run fp8_group ``pattern`` whole ("" when it does)."""
    if not pattern.norm:
        return NEEDS_NORM
    return layout_refusal(pattern.layout)


def block_threads(hidden: int, elem: int, group: int) -> int:
    """The threads per block the launcher of patterns 8/9 ends with on SM >= 90 (clusters of
    up to ``MAX_CLUSTER`` blocks a token, blocks of at least ``MIN_BLOCK_THREADS``, then widened
    until a block holds whole groups), before it checks ``<= MAX_BLOCK_THREADS``; 0 when the
    block cannot hold whole groups. The launcher may widen blocks further for the SM count:
    that only makes a block larger, up to the registers' limit, and never unaligns it."""
    vec = BYTES_PER_ACCESS // elem
    threads = hidden // vec
    cluster = MAX_CLUSTER
    while threads % cluster and cluster > 1:
        cluster //= 2
    block = threads // cluster
    while block < MIN_BLOCK_THREADS and cluster >= 2:
        block, cluster = block * 2, cluster // 2
    while cluster > 1 and (block * vec) % group:
        block, cluster = block * 2, cluster // 2
    return block if (block * vec) % group == 0 else 0


def launch_refusal(hidden: int, elem: int, group: int) -> str:
    """Why the kernel would refuse to launch a call of this group size ("" when it launches):
    then the norm runs fused and the quantisation in torch."""
    threads = block_threads(hidden, elem, group)
    if 0 < threads <= MAX_BLOCK_THREADS:
        return ""
    return (f"group_size {group} with hidden {hidden}: FlashInfer's launcher would need "
            f"{threads or 'no'} threads a block holding whole groups (at most "
            f"{MAX_BLOCK_THREADS}): norm fused, quantisation in torch")


def call_refusal(backend: str, layout: str | None, hidden: int, elem: int, group: int) -> str:
    """Why this fp8_group call with RMSNorm does not quantise in FlashInfer's kernel ("" when
    it does): the backend, the format, or the launcher's block limit."""
    if backend != "trtllm":
        return NOT_IN_FLASHINFER
    return layout_refusal(layout) or launch_refusal(hidden, elem, group)


def explain_notes(spec: Spec, fused: bool) -> tuple[str, ...]:
    """What ``explain`` says of fp8_group for ``spec`` on trtllm (``fused``) or mnnvl."""
    if spec.quant != QUANT:
        return ()
    if not fused:
        return (NOT_IN_FLASHINFER,)
    launched = [g for g in GROUP_SIZES
                if not spec.hidden % g and not launch_refusal(spec.hidden, spec.elem_size, g)]
    apart = [g for g in GROUP_SIZES if not spec.hidden % g and g not in launched]
    notes = [f"fp8_group {FUSED_LAYOUT}: FlashInfer's pattern 9, one kernel, for group sizes "
             + (", ".join(map(str, launched)) or "none of " + ", ".join(map(str, GROUP_SIZES)))]
    if apart:
        notes.append(f"fp8_group {FUSED_LAYOUT}, group sizes {', '.join(map(str, apart))}: "
                     "norm fused, quantisation in torch (the launcher's block limit)")
    notes.append("fp8_group fp32, fp32_column_major: norm fused, quantisation in torch")
    return tuple(notes)
