"""The backends this installation has, by name (imported lazily: flashinfer loads CUDA)."""

from __future__ import annotations

from functools import cache

from .base import Backend


@cache
def all_backends() -> dict[str, Backend]:
    from .flashinfer import FlashInferBackend
    from .shm import ShmBackend
    from .torch_dist import TorchBackend

    backends: list[Backend] = [FlashInferBackend("mnnvl"), FlashInferBackend("trtllm"),
                               ShmBackend(), TorchBackend()]
    return {b.name: b for b in backends}


def missing() -> dict[str, str]:
    """Fused backends the policy knows that this installation cannot create, with why."""
    from ..policy import FUSED_BACKENDS

    have = all_backends()
    return {name: "not part of this arfuse installation" for name in FUSED_BACKENDS
            if name not in have}
