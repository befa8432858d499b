"""The torch side of the spec's dtype names (``spec`` itself stays free of torch)."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
}


def device_of(kind: str) -> torch.device:
    """The device a group's tensors live on: the current CUDA device, or the CPU."""
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
