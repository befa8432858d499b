"""A call's wait and what it does after a timeout, on stand-ins for a work and a store: a store
that never answers (on a host the link to which went down) cannot hold the rank past its
deadline by more than the store's grace; whether a wait spins before it sleeps."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from arfuse import collective
from arfuse.errors import CallTimeout


class _UnreachableStore:
    """Every call blocks, as a socket call to a host behind a dead link does."""

    def __init__(self) -> None:
        self.never = threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.never.wait()
        return False


@dataclass
class _Channel:
    store: Any
    prefix: str = "test"
    posted: list[str] = field(default_factory=list)

    def post(self, key: str, value: str) -> None:
        self.posted.append(key)
        self.store.check([key])  # a write to the store blocks alike


@dataclass
class _Ctx:
    channel: _Channel
    timeout_s: float = 0.3
    rank: int = 1
    world_size: int = 2
    group: Any = None
    device: str = "cpu"


class _PendingWork:
    """A collective whose peer never comes."""

    def __init__(self) -> None:
        self.future: torch.futures.Future[Any] = torch.futures.Future()

    def is_completed(self) -> bool:
        return False

    def get_future(self) -> torch.futures.Future[Any]:
        return self.future

    def wait(self) -> None:  # pragma: no cover - never reached: the work never completes
        raise AssertionError("waited on a work that never completed")


def test_an_unreachable_store_leaves_the_silent_ranks_unknown_in_bounded_time() -> None:
    ctx = _Ctx(_Channel(_UnreachableStore()))
    started = time.monotonic()
    assert collective.silent_ranks(ctx, "call", 7) is None
    took = time.monotonic() - started
    assert took < collective.SILENT_GRACE_S + collective.STORE_ANSWER_S + 1.0, took
    ctx.channel.store.never.set()  # let the thread left behind finish


def test_a_timeout_with_an_unreachable_store_still_raises() -> None:
    """The whole wait: the deadline, then the lookup that gives up: ``CallTimeout`` naming no
    rank (who is silent is unknown), within the deadline plus the store's grace."""
    ctx = _Ctx(_Channel(_UnreachableStore()))
    started = time.monotonic()
    with pytest.raises(CallTimeout) as raised:
        collective.wait_within_deadline(_PendingWork(), ctx, "call", "torch", 3)
    took = time.monotonic() - started
    assert raised.value.silent is None
    assert "timed out after 0.3s" in str(raised.value) and "phase 'call'" in str(raised.value)
    assert took < ctx.timeout_s + collective.SILENT_GRACE_S + collective.STORE_ANSWER_S + 1.0
    ctx.channel.store.never.set()


def test_a_work_that_completes_late_is_waited_for_past_the_spin() -> None:
    """A work completing after the spin's 2 ms wakes the waiter through its future."""
    future: torch.futures.Future[Any] = torch.futures.Future()
    done = threading.Event()

    class _LateWork:
        def is_completed(self) -> bool:
            return done.is_set()

        def get_future(self) -> torch.futures.Future[Any]:
            return future

        def wait(self) -> None:
            assert done.is_set()

    def finish() -> None:
        time.sleep(0.05)
        done.set()
        future.set_result(None)

    threading.Thread(target=finish).start()
    collective.wait_within_deadline(_LateWork(), _Ctx(_Channel(None), timeout_s=10), "call",
                                    "torch", 1)
    assert done.is_set()


@given(st.lists(st.sampled_from([0.0, collective.SPIN_S / 2, collective.SPIN_S,
                                 2 * collective.SPIN_S, 0.05]), max_size=60))
def test_a_wait_spins_while_at_least_half_the_last_waits_were_answered_within_it(
        seconds: list[float]) -> None:
    record = collective.SpinRecord()
    for i, took in enumerate(seconds):
        last = [s <= collective.SPIN_S for s in seconds[max(0, i - record.WINDOW):i]]
        expected = len(last) < record.WINDOW or 2 * sum(last) >= len(last)
        assert record.worth_it() == expected, (i, seconds[:i])
        record.add(took)


class _CountedWork:
    """Completes on ``finish()``; counts the looks at it."""

    def __init__(self) -> None:
        self.looks = 0
        self.done = threading.Event()
        self.future: torch.futures.Future[Any] = torch.futures.Future()

    def is_completed(self) -> bool:
        self.looks += 1
        return self.done.is_set()

    def get_future(self) -> torch.futures.Future[Any]:
        return self.future

    def wait(self) -> None:
        assert self.done.is_set()

    def finish_after(self, seconds: float) -> None:
        def finish() -> None:
            time.sleep(seconds)
            self.done.set()
            self.future.set_result(None)
        threading.Thread(target=finish).start()


@pytest.mark.parametrize("answered", [True, False])
def test_a_wait_skips_the_spin_once_the_peers_mostly_answer_after_it(answered: bool) -> None:
    """After a window of waits answered within the spin the next one spins (it looks at the
    work again and again); after a window answered later it goes straight to sleep on the
    work's completion (two looks: on entry and before it sleeps) and is still woken."""
    record = collective.SpinRecord()
    for _ in range(record.WINDOW):
        record.add(0.0 if answered else 10 * collective.SPIN_S)
    work = _CountedWork()
    work.finish_after(0.05)
    collective._wait(work, time.monotonic() + 10, record)
    assert work.done.is_set()
    assert (work.looks > 2) if answered else (work.looks == 2), work.looks
