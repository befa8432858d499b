"""A call's wait and what it does after a timeout, on stand-ins for a work and a store: a store
that never answers (on a host the link to which went down) cannot hold the rank past its
deadline by more than the store's grace."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

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
