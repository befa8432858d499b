"""Bytes FlashInfer allocates per rank for ``mnnvl`` and ``trtllm``, per version (pure).

Each formula follows that version's allocation code (file and function named at each
function below); ``tests/contract/flashinfer_contract.py`` runs the real code of the installed
version with its allocation calls recorded and compares. Counted: the shared buffers (what
``cuMemCreate`` maps), rounded the way the allocator rounds them. Not counted: the few-byte
control allocations (trtllm's 20-byte flag, pointer tables, mnnvl's 36-byte ``buffer_flags``).

The granularities are the driver's (``cuMemGetAllocationGranularity`` /
``cuMulticastGetGranularity``, both RECOMMENDED); no GPU is asked here, so they are assumed.
A created workspace reports the sizes it really allocated where FlashInfer exposes them
(``FlashInferWorkspace.nbytes``).
"""

from __future__ import annotations

from ...sizing import MIB, ceil_div, round_up

PRIMARY_VERSION = "0.7.2.post1"   # the version vLLM 0.33 pins; an unknown version sizes as it
MIN_VERSION = (0, 6, 13)

ALLOC_GRANULARITY = 2 * MIB       # assumed: the recommended granularity of device memory
MC_GRANULARITY = 2 * MIB          # assumed: the recommended multicast granularity
FLASHINFER_SIGNAL_PAD = 2048      # flashinfer/comm/mnnvl.py SIGNAL_PAD_SIZE
TORCH_SIGNAL_PAD = 32 * 72 * 4    # torch >= 2.9 default_signal_pad_size (symm_mem), 9216
UINT32_MAX = 2**32 - 1            # mnnvl refuses a larger buffer (ValueError in its constructor)

# trtllm_ar.py
BARRIER_FLAG_COUNT = 256
MAX_COMM_SIZE = 2147483647 & ~((1 << 21) - 1)
# trtllm_mnnvl_ar.py
MNNVL_ONE_SHOT_THRESHOLD = 64 * 1024 * 8 * 2
NUM_LAMPORT_BUFFERS = 3

# Where the allocation code changed (read in each release's source, 0.6.13 ... 0.7.2.post1)
SYMM_DEVICE_MEMORY_FROM = (0, 6, 15)   # FlashInfer's own cuMem buffers instead of torch symm_mem
MNNVL_ALIGN_32_FROM = (0, 6, 18)       # mnnvl rounds each buffer up to 2 stages * 16 bytes
TRTLLM_FP32_BUFFER_FROM = (0, 7, 2)    # trtllm sizes its two-shot buffer by fp32's 4 bytes


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


def sizing_version(version: str | None) -> tuple[int, ...]:
    """The version whose formulas apply: an unknown one sizes as the primary version."""
    return version_tuple(version) or version_tuple(PRIMARY_VERSION)


def torch_symm_bytes(size: int) -> int:
    """torch's CUDASymmetricMemoryAllocator::alloc: the buffer, 16-aligned, plus its signal
    pad, rounded to the granularity (FlashInfer < 0.6.15, and trtllm under Confidential
    Computing, allocate through ``torch.distributed._symmetric_memory``)."""
    return round_up(round_up(size, 16) + TORCH_SIGNAL_PAD, ALLOC_GRANULARITY)


def flashinfer_symm_bytes(size: int, multicast: bool) -> int:
    """flashinfer/comm/mnnvl.py SymmDeviceMemory._get_allocation_prop: ``round_up(buf_size +
    SIGNAL_PAD_SIZE, granularity)``, then to the multicast granularity when multicast is on."""
    allocation = round_up(size + FLASHINFER_SIGNAL_PAD, ALLOC_GRANULARITY)
    return round_up(allocation, MC_GRANULARITY) if multicast else allocation


# --- trtllm -------------------------------------------------------------------------------------

def trtllm_buffer_sizes(version: tuple[int, ...], world: int, tokens: int, hidden: int,
                        elem: int) -> tuple[int, int, int]:
    """trtllm_ar.py trtllm_create_ipc_workspace_for_all_reduce_fusion: the sizes it asks for,
    ``[buffer_size, flag_size, lamport_buffer_size]`` (before its ``round_up(size, 16)``)."""
    lamport_elem = 4 if elem == 4 else 2            # use_fp32_lamport = dtype == float32
    buffer_elem = lamport_elem if version >= TRTLLM_FP32_BUFFER_FROM else 2
    lamport_comm = min(world * tokens * hidden * lamport_elem, MAX_COMM_SIZE)
    return (world * tokens * hidden * buffer_elem, world * BARRIER_FLAG_COUNT * 4,
            3 * lamport_comm)


def trtllm_bytes(version: tuple[int, ...], world: int, tokens: int, hidden: int,
                 elem: int) -> int:
    """Per rank: each of the three buffers as its allocator rounds it (no multicast)."""
    total = 0
    for size in trtllm_buffer_sizes(version, world, tokens, hidden, elem):
        aligned = round_up(size, 16)
        total += (flashinfer_symm_bytes(aligned, multicast=False)
                  if version >= SYMM_DEVICE_MEMORY_FROM else torch_symm_bytes(aligned))
    return total


def trtllm_capacity(version: tuple[int, ...], world: int, tokens: int, elem: int) -> int:
    """Tokens per call that fit. Before 0.7.2 the two-shot buffer is sized for 2-byte elements
    although the kernel writes ``2 * tokens * hidden`` input elements (fp32: 4 bytes) into it
    (fixed in 0.7.2, trtllm_ar.py comment): fp32 at world 2 holds only half the tokens."""
    if elem == 4 and version < TRTLLM_FP32_BUFFER_FROM:
        return min(tokens, world * tokens // 4)
    return tokens


# --- mnnvl --------------------------------------------------------------------------------------

def mnnvl_use_oneshot(world: int, tokens: int, row_bytes: int) -> bool:
    """MNNVLAllreduceFusionStrategy.select_strategy."""
    return tokens * world * row_bytes <= MNNVL_ONE_SHOT_THRESHOLD


def mnnvl_need(world: int, tokens: int, row_bytes: int) -> int:
    """get_required_buffer_size_bytes for the mode FlashInfer picks (AUTO) for ``tokens``."""
    if mnnvl_use_oneshot(world, tokens, row_bytes):
        return tokens * world * row_bytes
    return 2 * ceil_div(tokens, world) * world * row_bytes


def mnnvl_requested_buffer(version: tuple[int, ...], world: int, max_tokens: int,
                           row_bytes: int) -> int:
    """MNNVLAllReduceFusionWorkspace.__init__: ``max(one-shot bytes at the threshold's
    tokens, two-shot bytes at max_tokens)`` per buffer, rounded to 32 from 0.6.18."""
    oneshot_tokens = min(MNNVL_ONE_SHOT_THRESHOLD // (world * row_bytes), max_tokens)
    requested = max(oneshot_tokens * world * row_bytes,
                    2 * ceil_div(max_tokens, world) * world * row_bytes)
    return round_up(requested, 32) if version >= MNNVL_ALIGN_32_FROM else requested


def mnnvl_bytes(version: tuple[int, ...], world: int, max_tokens: int, row_bytes: int) -> int:
    """Per rank: the three Lamport buffers in one multicast-bound allocation."""
    requested = NUM_LAMPORT_BUFFERS * mnnvl_requested_buffer(version, world, max_tokens,
                                                             row_bytes)
    if version >= SYMM_DEVICE_MEMORY_FROM:
        return flashinfer_symm_bytes(requested, multicast=True)
    return torch_symm_bytes(requested)


def mnnvl_usable_buffer(version: tuple[int, ...], world: int, max_tokens: int,
                        row_bytes: int) -> int:
    """``buffer_size_bytes``: what one buffer holds after allocation (the allocation's usable
    bytes split in three, aligned down), which ``is_buffer_size_sufficient`` compares with."""
    if version >= SYMM_DEVICE_MEMORY_FROM:
        usable = mnnvl_bytes(version, world, max_tokens, row_bytes) - FLASHINFER_SIGNAL_PAD
    else:  # torch's handle.buffer_size is the size asked for
        usable = NUM_LAMPORT_BUFFERS * mnnvl_requested_buffer(version, world, max_tokens,
                                                              row_bytes)
    align = 32 if version >= MNNVL_ALIGN_32_FROM else 16
    return usable // NUM_LAMPORT_BUFFERS // align * align
