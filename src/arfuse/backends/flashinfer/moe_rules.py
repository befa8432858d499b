"""When ``trtllm`` runs a MoE call in FlashInfer's kernel (patterns 6 and 7), and when the expert
step runs on its own first, then the fused all-reduce (docs/design.md 3.12). Pure: the
descriptor, the workspace's run and ``explain`` read the same rules, and
``tests/contract/flashinfer_contract.py`` checks each against the real 0.6.13 and 0.7.2.post1.

Read in those releases (``flashinfer/comm/allreduce.py``, ``trtllm_ar.py``,
``csrc/trtllm_moe_allreduce_fusion.cu``, ``include/.../trtllm_moe_allreduce_fusion.cuh``):

* both have 6 and 7 in the unified ``allreduce_fusion`` (so arfuse never calls the dedicated
  ``trtllm_moe_*`` functions itself: no supported version lacks the unified ones);
* the kernels take bf16/fp16 only, add a residual and normalise always, quantise to NVFP4 only,
  and run one-shot only (past ``kOneShotMaxToken`` tokens they warn and run one-shot anyway);
* the unified API passes pattern 7 ``routed_scaling_factor=None``, pattern 6 a float
  ``scale_factor`` (a tensor becomes 1.0), and checks neither against the workspace's capacity;
* pattern 7 reads ``expert_scale_factor`` in the activation dtype and takes ``top_k`` from the
  index's last dimension (a flat index reads out of bounds); pattern 6 reads fp32 scales;
* the one-shot check of 0.6.13's finalize wrapper counts the expanded rows, not the tokens.

The arithmetic is the kernel's: products, sums and the sum over ranks rounded to the activation
dtype (not fp32), so the bytes differ from the torch reference by that rounding.
"""

from __future__ import annotations

from ...pattern import Pattern
from ...spec import Spec
from .sizes import MAX_COMM_SIZE

K_MOE_REDUCTION, K_MOE_FINALIZE = 6, 7   # AllReduceFusionPattern
ONESHOT_MAX_TOKENS = 128                 # details::kOneShotMaxToken
BYTES_PER_ACCESS = 16                    # details::kBytesPerAccess
MAX_BLOCK_THREADS = 1024                 # the launchers' FLASHINFER_CHECK(block_size <= 1024)
MAX_CLUSTER = 8                          # the launchers' first cluster size (0.7.2: the device's,
                                         # if smaller; 8 on SM 90/100, assumed)
MOE_DTYPES = ("bf16", "fp16")            # DISPATCH_FLOATING_TYPES_FOR_ALLREDUCE
FINALIZE_COUNTS_TOKENS_FROM = (0, 7, 2)  # before: the wrapper's one-shot bytes count the rows

TRTLLM_ONLY = "mnnvl has no MoE pattern (FlashInfer's 6/7 run on trtllm workspaces only)"
NOT_BF16 = "FlashInfer's MoE kernels run bf16 and fp16 only"
NEEDS_NORM = "without RMSNorm (FlashInfer's 6/7 always add the residual and normalise)"
QUANT_APART = ("the quantisation is a step of its own after the kernel (6/7 quantise only to "
               "NVFP4, and the unified API drops a tensor scale_factor)")
ROUTED = ("routed_scaling_factor != 1 (the unified API passes pattern 7 "
          "routed_scaling_factor=None)")
SCALES = ("expert_scales not in the activation dtype (pattern 7 reads them in it; rounding "
          "fp32 scales would change them)")
TOKENS = (f"tokens outside 1..{ONESHOT_MAX_TOKENS} (one-shot only: beyond kOneShotMaxToken "
          "FlashInfer warns of degraded speed; 0 tokens launch nothing)")
NO_ROWS = "no expanded rows (the kernel refuses an empty allreduce_in)"
ONESHOT = ("one-shot bytes beyond the Lamport buffer or MAX_COMM_SIZE (the unified API skips "
           "the workspace's capacity check for 6/7)")
CALL_RULES = (ROUTED, SCALES, TOKENS, NO_ROWS, ONESHOT)
"""Why a call of a MoE pattern trtllm fuses still runs its expert step apart (``call_refusal``
returns one of these; ``explain`` lists them)."""


def block_threads(hidden: int, elem: int) -> int:
    """The threads per block FlashInfer's MoE launchers pick (one cluster a token):
    ``hidden*elem/16`` threads in warps, a cluster of the largest of 8, 4, 2, 1 blocks that
    divides the warps."""
    warps = -(-(hidden * elem // BYTES_PER_ACCESS) // 32)
    cluster = MAX_CLUSTER
    while warps % cluster:
        cluster //= 2
    return warps // cluster * 32


def spec_refusal(spec: Spec) -> str:
    """Why no MoE pattern runs in the kernel for ``spec`` ("" when some do)."""
    if spec.dtype not in MOE_DTYPES:
        return NOT_BF16
    threads = block_threads(spec.hidden, spec.elem_size)
    if threads > MAX_BLOCK_THREADS:
        return (f"hidden {spec.hidden} needs {threads} threads a block in FlashInfer's MoE "
                f"kernels (their launch refuses more than {MAX_BLOCK_THREADS})")
    return ""


def pattern_refusal(spec: Spec, pattern: Pattern) -> str:
    """Why MoE ``pattern`` does not run whole in the kernel ("" when it does)."""
    return spec_refusal(spec) or ("" if pattern.norm else NEEDS_NORM) or (
        QUANT_APART if pattern.quant else "")


def oneshot_bytes(version: tuple[int, ...], world: int, tokens: int, rows: int, hidden: int,
                  elem: int, finalize: bool) -> tuple[int, int]:
    """(what the one-shot kernel writes into each rank's Lamport buffer, what FlashInfer's
    wrapper compares with ``MAX_COMM_SIZE`` before it raises ``ValueError``)."""
    written = world * tokens * hidden * elem
    if not finalize:
        return written, world * tokens * hidden * 2
    if version < FINALIZE_COUNTS_TOKENS_FROM:
        return written, world * rows * hidden * 2
    return written, written


def call_refusal(version: tuple[int, ...], world: int, spec: Spec, finalize: bool,
                 tokens: int, rows: int, routed: float, scales_in_dtype: bool) -> str:
    """Why this call of a MoE pattern trtllm fuses runs its expert step apart ("" when the
    kernel takes it): ``rows`` are expanded's (finalize) and ``scales_in_dtype`` whether its
    ``expert_scales`` are in the activation dtype; a reduction's scales are widened to fp32
    (exact) for the kernel."""
    if not 1 <= tokens <= ONESHOT_MAX_TOKENS:
        return TOKENS
    if finalize and routed != 1.0:
        return ROUTED
    if finalize and not scales_in_dtype:
        return SCALES
    if finalize and rows == 0:
        return NO_ROWS
    written, checked = oneshot_bytes(version, world, tokens, rows, spec.hidden,
                                     spec.elem_size, finalize)
    if tokens > spec.max_tokens or max(written, checked) > MAX_COMM_SIZE:
        return ONESHOT
    return ""


def explain_notes(spec: Spec) -> tuple[str, ...]:
    """What ``explain`` says of trtllm's MoE patterns for ``spec``: one line each."""
    why = spec_refusal(spec)
    if why:
        return (f"MoE: {why}; the expert step runs apart, then the fused all-reduce",)
    return (f"MoE: FlashInfer's patterns 6/7, one-shot, in its arithmetic (each step rounded to "
            f"{spec.dtype}); {QUANT_APART}",
            "MoE: the expert step runs apart, then the fused all-reduce, for",
            f"  a pattern {NEEDS_NORM}", *(f"  a call with {rule}" for rule in CALL_RULES))
