"""Arithmetic that several backends' footprints share: rounding and the capacity search."""

from __future__ import annotations

from collections.abc import Callable

MIB = 1 << 20


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(value: int, to: int) -> int:
    return ceil_div(value, to) * to


def largest_fitting(limit: int, fits: Callable[[int], bool]) -> int:
    """The largest token count in 0..limit that ``fits`` (0 if none).

    ``fits`` must be monotone (what a call needs grows with its tokens), so a bisection finds
    the answer in log2(limit) questions; ``limit`` itself is asked first, the common case.
    """
    if limit <= 0:
        return 0
    if fits(limit):
        return limit
    lo, hi, best = 1, limit - 1, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best
