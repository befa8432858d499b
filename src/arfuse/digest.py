"""Digests of tensors' bytes, for comparing results and inputs across ranks without moving
them: BLAKE2b-128 of the bytes as stored (row-major), so any change of any byte, however
arranged, changes the digest except with a chance of about 2**-128.
"""

from __future__ import annotations

import hashlib
from typing import Any

_SIZE = 16


def _update(h: Any, tensor: Any) -> None:
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # one element keeps a stride of its own
        flat = flat.clone(memory_format=torch.contiguous_format)
    data = flat.view(torch.uint8).cpu().numpy()
    h.update(data.data)


def digest_bytes(tensor: Any) -> bytes:
    """The 16-byte digest of one tensor's bytes."""
    h = hashlib.blake2b(digest_size=_SIZE)
    _update(h, tensor)
    return h.digest()


def digest(*tensors: Any) -> str:
    """A hex digest of several tensors (``None`` counts as a tensor of its own): what ranks
    compare to show their results are bit-identical."""
    h = hashlib.blake2b(digest_size=_SIZE)
    for tensor in tensors:
        if tensor is None:
            h.update(b"\0none\0")
        else:
            h.update(str(tuple(tensor.shape)).encode() + str(tensor.dtype).encode())
            _update(h, tensor)
    return h.hexdigest()
