"""The torch side of the dtype table (``dtypes`` itself stays free of torch)."""

from __future__ import annotations

import torch

from .dtypes import DTYPES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, d.torch_name)
                                        for name, d in DTYPES.items()}
TORCH_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def device_of(kind: str) -> torch.device:
    """The device a group's tensors live on: the current CUDA device, or the CPU."""
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def nans_differ(rounded: torch.Tensor) -> bool:
    """Whether torch's rounding may have given a NaN of ``rounded`` other bytes than the shm
    kernel's (``csrc/conversions.h``): on the CPU torch makes every NaN the bf16 0xffff, where
    the kernel keeps a NaN's sign and the top of its payload (made quiet). On a GPU, whose
    arithmetic makes its own NaNs, never (and no check, so no synchronisation)."""
    return (rounded.dtype == torch.bfloat16 and rounded.device.type == "cpu"
            and bool(rounded.isnan().any()))


def round_to(values: torch.Tensor, dtype: torch.dtype, nans: bool = True) -> torch.Tensor:
    """fp32 ``values`` rounded to ``dtype`` (nearest even) as the shm kernel rounds them:
    torch's conversion, with its NaNs put right (``nans_differ``) unless ``nans`` is False
    (for a caller that checks once for several roundings)."""
    rounded = values.to(dtype)
    if not nans or not nans_differ(rounded):
        return rounded
    kept = ((values.view(torch.int32) >> 16) | 0x40).to(torch.int16)
    return torch.where(rounded.isnan(), kept, rounded.view(torch.int16)).view(torch.bfloat16)
