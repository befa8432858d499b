"""The compiled kernel computes exactly the documented formula, bit for bit (kernel header):
the sum of squares in 8 lanes (lane = h % 8, each added up in order, combined as
((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))), then out = T((r * inv) * (weight_bias + w)).

This pins the order of the fp32 operations, so a faster loop that reorders them fails here
even when it stays within the tolerance the reference tests allow (in float32 outputs; in 16-bit
outputs a reordering mostly vanishes in the final rounding). One rank, no peers: the kernel on
a private buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arfuse.backends.shm import build as shm_build
from arfuse.backends.shm import layout as shm_layout

DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def kernel_on_private_memory(tokens: int, hidden: int, dtype: torch.dtype) -> tuple[object,
                                                                                     torch.Tensor]:
    module = shm_build.load()
    if module is None:
        pytest.skip(f"no compiled kernel here: {shm_build.why_not()}")
    layout = shm_layout.ShmLayout(1, tokens, hidden,
                                  torch.tensor([], dtype=dtype).element_size())
    memory = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    comm = module.ShmComm(memory.data_ptr(), 1, 0, tokens, hidden, DTYPE_CODE[dtype],
                          shm_layout.HEADER_BYTES, layout.slot_bytes, layout.input_bytes,
                          layout.chunk_rows, 10.0, 1 << 40)
    return comm, memory


def documented_out(residual_out: torch.Tensor, weight: torch.Tensor, eps: float,
                   weight_bias: float) -> torch.Tensor:
    """The formula in float32 numpy, one IEEE operation at a time, in the documented order."""
    r = residual_out.float().numpy()
    gain = np.float32(weight_bias) + weight.float().numpy()
    tokens, hidden = r.shape
    out = np.empty_like(r)
    for t in range(tokens):
        lanes = np.zeros(8, dtype=np.float32)
        for h in range(hidden):
            lanes[h % 8] = lanes[h % 8] + r[t, h] * r[t, h]
        ss = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + (
            (lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(hidden) + np.float32(eps))
        out[t] = (r[t] * inv) * gain
    return torch.from_numpy(out).to(residual_out.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [37, 88, 208, 1040])
def test_out_is_the_documented_formula_bit_for_bit(dtype: torch.dtype, hidden: int) -> None:
    tokens, eps, weight_bias = 64, 1e-6, 0.5
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(tokens, hidden, generator=gen) * 4).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    comm, _memory = kernel_on_private_memory(tokens, hidden, dtype)
    out, residual_out, _, _ = comm.run(x, residual, weight, eps, weight_bias, 0, 0.0, True,
                                       None, None)
    summed = x.float().to(dtype)  # one rank: the sum is x
    assert torch.equal(residual_out, (summed.float() + residual.float()).to(dtype))
    expected = documented_out(residual_out, weight, eps, weight_bias)
    assert torch.equal(out.view(torch.int16) if dtype != torch.float32 else out.view(torch.int32),
                       expected.view(torch.int16) if dtype != torch.float32
                       else expected.view(torch.int32))
