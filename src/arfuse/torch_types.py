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


def round_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``values`` rounded to ``dtype`` (nearest even) as the shm kernel rounds them
    (``csrc/conversions.h``): torch's conversion, except that on the CPU torch makes every NaN
    the bf16 0xffff, where the kernel keeps a NaN's sign and the top of its payload (made
    quiet); those are put right. Rows without a NaN cost one check. On a GPU, whose arithmetic
    makes its own NaNs, torch's conversion alone (no check, so no synchronisation)."""
    rounded = values.to(dtype)
    if dtype != torch.bfloat16 or values.device.type != "cpu":
        return rounded
    nan = rounded.isnan()
    if not bool(nan.any()):
        return rounded
    kept = ((values.view(torch.int32) >> 16) | 0x40).to(torch.int16)
    return torch.where(nan, kept, rounded.view(torch.int16)).view(torch.bfloat16)
