"""What this rank's GPU and FlashInfer say about themselves, before any workspace is made.

Every probe answers ``None`` when it cannot tell: a missing attribute is never a pass. The
GPU's own answers come from ``arfuse.gpu_facts``. They feed the local check
(``Backend.local_check``, gathered from every rank before any creation) and the agreement just
before FlashInfer's constructor (``comm.agree_to_enter``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .sizes import SYMM_DEVICE_MEMORY_FROM, version_tuple


def _flashinfer_multicast(device: int) -> bool | None:
    """``flashinfer.comm.mnnvl.is_multicast_supported`` (FlashInfer >= 0.6.16), the check its
    own allocator makes before it raises; ``None`` where the function does not exist."""
    try:
        from flashinfer.comm import mnnvl
    except Exception:
        return None
    supported: Callable[[int], Any] | None = getattr(mnnvl, "is_multicast_supported", None)
    if supported is None:
        return None
    return bool(supported(device))


def _driver_multicast(device: int) -> bool | None:
    """``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`` (what FlashInfer 0.6.15's allocator reads):
    ``arfuse.gpu_facts.read_multicast`` (cuda-python, torch without it), ``None`` if unread."""
    from ... import gpu_facts

    return gpu_facts.read_multicast(device)[0]


def _torch_multicast(device: int) -> bool | None:
    """torch's symmetric memory ``has_multicast_support``: the allocator FlashInfer < 0.6.15
    uses, so the one that decides whether its multicast pointer is null."""
    from ... import gpu_facts

    return gpu_facts.torch_multicast(device)[0]


Source = tuple[str, Callable[[int], "bool | None"]]


def multicast_support(device: int, flashinfer_version: str | None,
                      sources: tuple[Source, ...] | None = None) -> tuple[bool | None, str]:
    """Whether ``device`` can do NVLink multicast, and which source said so. The first source
    that answers wins, in the order the installed FlashInfer's allocator would ask: its own
    function, then the driver attribute, then torch (torch first before 0.6.15)."""
    if sources is None:
        if version_tuple(flashinfer_version) >= SYMM_DEVICE_MEMORY_FROM:
            sources = (("flashinfer", _flashinfer_multicast), ("driver", _driver_multicast),
                       ("torch", _torch_multicast))
        else:
            sources = (("torch", _torch_multicast), ("driver", _driver_multicast))
    for name, source in sources:
        answer = source(device)
        if answer is not None:
            return answer, name
    return None, "none"


def confidential_compute() -> bool | None:
    """FlashInfer's Confidential Computing switch (>= 0.6.16, NVML or
    ``FLASHINFER_CONFIDENTIAL_COMPUTE``): mnnvl then refuses and trtllm allocates through torch.
    ``None`` before 0.6.16 (no such handling) or if the check fails."""
    try:
        from flashinfer import utils
    except Exception:
        return None
    check: Callable[[], Any] | None = getattr(utils, "is_confidential_compute", None)
    if check is None:
        return None
    try:
        return bool(check())
    except Exception:  # a bad FLASHINFER_CONFIDENTIAL_COMPUTE value raises ValueError
        forced = os.environ.get("FLASHINFER_CONFIDENTIAL_COMPUTE")
        return None if forced is None else forced == "1"


def fabric_handles(device: int) -> bool | None:
    """Whether FlashInfer's allocator (>= 0.6.15) exchanges FABRIC handles on this rank (else
    POSIX file descriptors over sockets); each rank decides alone, so the ranks must agree."""
    try:
        from flashinfer.comm import mnnvl
    except Exception:
        return None
    check: Callable[[int], Any] | None = getattr(mnnvl, "is_mnnvl_fabric_supported", None)
    if check is None:
        return None
    try:
        return bool(check(device))
    except Exception:
        return None
