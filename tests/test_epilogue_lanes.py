"""The torch epilogue's sum of squares is the kernel's lane order: 32 lanes, each added up in
order of h one fp32 addition at a time, then combined by halving. ``sum_of_squares`` gets that
order from ``index_add_`` adding its slices one after another in index order, which is torch's
implementation and not its contract: these tests pin it against the plain loop (one elementwise
add per step of 32) over many shapes, values and thread counts, so that a torch that adds in
another order fails here, loudly, instead of changing the epilogue's bytes."""

from __future__ import annotations

import itertools

import pytest
import torch

from arfuse.epilogue import SUM_LANES, sum_of_squares

TOKENS = (1, 2, 3, 5, 17, 64, 100, 300)
HIDDEN = (1, 16, 31, 32, 33, 37, 447, 448, 449, 1040, 1100, 4096, 7168, 8192)


def one_add_per_step(r: torch.Tensor) -> torch.Tensor:
    """The kernel's order written out: lane k = ((s_k + s_k+32) + s_k+64) + ..., then halving."""
    tokens, hidden = r.shape
    steps = -(-hidden // SUM_LANES)
    squares = torch.nn.functional.pad(r * r, (0, steps * SUM_LANES - hidden))
    squares = squares.view(tokens, steps, SUM_LANES)
    lanes = squares[:, 0].clone()
    for step in range(1, steps):
        lanes = lanes + squares[:, step]
    half = SUM_LANES // 2
    while half >= 1:
        lanes = lanes[:, :half] + lanes[:, half:2 * half]
        half //= 2
    return lanes


def rows(kind: str, tokens: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """Values whose sum depends on the order of its additions (magnitudes 1e-20 .. 1e18 in
    one row), or overflowing, infinite and NaN squares."""
    if kind == "normal":
        return torch.randn(tokens, hidden, generator=gen)
    if kind == "magnitudes":
        exponent = torch.randint(-20, 19, (tokens, hidden), generator=gen).float()
        return torch.rand(tokens, hidden, generator=gen) * torch.pow(10.0, exponent)
    r = torch.randn(tokens, hidden, generator=gen) * 1e19
    r[:, ::7] = float("inf")
    r[0, 3 % hidden] = float("nan")
    return r


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["normal", "magnitudes", "extremes"])
def test_sum_of_squares_adds_in_the_kernels_order(kind: str, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(7)
        for tokens, hidden in itertools.product(TOKENS, HIDDEN):
            if tokens * hidden > 300 * 8192:
                continue
            r = rows(kind, tokens, hidden, gen)
            got, want = sum_of_squares(r), one_add_per_step(r)
            assert got.shape == (tokens, 1)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (tokens, hidden)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["normal", "magnitudes"])
def test_the_values_tell_the_orders_apart(kind: str) -> None:
    """The values above do depend on the order: torch's own sum of each lane's squares, which
    adds in blocks of 16, differs from the kernel's order in many of 64 rows."""
    gen = torch.Generator().manual_seed(7)
    r = rows(kind, 64, 4096, gen)
    blocked = (r * r).view(64, -1, SUM_LANES).sum(1)
    half = SUM_LANES // 2
    while half >= 1:
        blocked = blocked[:, :half] + blocked[:, half:2 * half]
        half //= 2
    assert (blocked != one_add_per_step(r)).sum() > 8
