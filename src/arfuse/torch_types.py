"""The torch side of the dtype table (``dtypes`` itself stays free of torch)."""

from __future__ import annotations

import torch

from .dtypes import DTYPES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, d.torch_name)
                                        for name, d in DTYPES.items()}


def device_of(kind: str) -> torch.device:
    """The device a group's tensors live on: the current CUDA device, or the CPU."""
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
