"""The backends this installation has, by name (imported lazily: flashinfer loads CUDA)."""

from __future__ import annotations

from functools import cache

from .base import Backend


@cache
def all_backends() -> dict[str, Backend]:
    from .shm import ShmBackend
    from .torch_dist import TorchBackend

    backends: list[Backend] = [ShmBackend(), TorchBackend()]
    return {b.name: b for b in backends}
