"""``torch.distributed`` collectives of a call, within the group's deadline (R8).

A rank whose wait runs out posts that in the group's store, so the ranks that did call can
name the ones that did not (``CallTimeout.silent``). Used by the unfused backend's calls, hier's
link step and the op's residual check; negotiation has its own channel (``rendezvous``).

A wait wakes when the work completes (its future's callback sets an event), not on a timer,
and never blocks inside the process group's own wait with a timeout: a work abandoned at its
deadline stays queued, its group kept for the process (``keep_for_the_process``), so that the
process can still exit. ``TRAFFIC`` counts this process's collectives and the bytes it sends.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import re
import statistics
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import log
from .errors import CallTimeout

# torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single; same semantics
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# how long ranks that timed out wait to see which others timed out too
SILENT_GRACE_S = 0.5
# how long a rank that timed out waits for the store's answers beyond that
STORE_ANSWER_S = 2.0


# the longest one wait sleeps before it looks at the deadline again (a signal is seen sooner)
_WAIT_SLICE_S = 1.0
# how long a wait yields the CPU between looks at the work before it sleeps on its completion
SPIN_S = 0.002


class SpinRecord:
    """Whether a wait should yield the CPU between looks for ``SPIN_S`` before it sleeps, kept
    per group and phase: the spin pays while the peers answer within it (an event's wake-up
    costs more than a fast exchange), and costs where they mostly do not (more ranks than
    cores, a slow link, long messages): there it takes the CPU from the processes that must
    answer. Of the last ``WINDOW`` waits, at least half must have been answered within
    ``SPIN_S`` (timed whether or not they spun) for the next one to spin; until ``WINDOW``
    waits are known, every wait spins."""

    WINDOW = 16

    def __init__(self) -> None:
        self._answered: collections.deque[bool] = collections.deque(maxlen=self.WINDOW)

    def worth_it(self) -> bool:
        known = len(self._answered)
        return known < self.WINDOW or 2 * sum(self._answered) >= known

    def add(self, seconds: float) -> None:
        """A wait that took ``seconds`` from its start to the work's completion."""
        self._answered.append(seconds <= SPIN_S)


_spin_records: dict[tuple[int, str], SpinRecord] = {}


@dataclass
class Traffic:
    """This process's collectives and the bytes it sent in them, as a ring or pairwise
    exchange sends them: an all-gather of m bytes sends m to each of the W-1 others; an
    all-to-all of m bytes sends the (W-1)/W of it meant for the others."""

    collectives: int = 0
    bytes_sent: int = 0

    def count(self, nbytes: int) -> None:
        self.collectives += 1
        self.bytes_sent += nbytes


TRAFFIC = Traffic()

RIDE_MAX_BYTES = 1 << 20
"""The most bytes per destination that ride in a signature's message: copying them into it
costs less than a second exchange; larger rows go uncopied after it."""
KEEP_BYTES = 256 << 20
"""The largest buffer ``Buffers`` keeps between calls (larger ones are made per call)."""


PIECE_BYTES = 256 << 10
"""The size of a piece where a two-rank exchange goes in pieces (``PieceChoice``): over a
shaped link, pieces of this size crossed at the link's rate where larger ones did not
(``benchmarks/RESULTS.md``)."""


class PieceChoice:
    """Whether a two-rank exchange of more than ``PIECE_BYTES`` goes whole or in pieces of it
    all in flight at once, learnt from the calls on one link, per size class (a power of
    two): over a link shaped to 1 Gb/s one message of many MiB crossed at about half the
    link's rate and pieces near it, while on loopback or a fast link pieces cost
    (``benchmarks/RESULTS.md``). A class's first calls go ``RUN`` whole, then ``RUN`` in
    pieces, the first of each run left out (a link's state after one way, TCP's congestion
    window, slows the next call the other way: taken in turn, the ways measured each other's
    aftermath); then every call takes the way with the lower mean (a way that is slow only in
    some calls, as one whole message over a shaped link is, costs by its mean: a median of a
    few lucky calls could keep it). Both ranks must exchange alike: each proposes
    (``propose``), the proposal rides in the message that precedes the exchange, and both
    follow the group's first rank's."""

    SAMPLES = 5
    RUN = SAMPLES + 1
    WHOLE, PIECES = 0, 1

    def __init__(self, link: str, enabled: bool = True) -> None:
        self.link = link  # how the log names the link
        self.enabled = enabled
        self._times: dict[int, tuple[list[float], list[float]]] = {}
        self._calls: dict[int, int] = {}
        self._chosen: dict[int, int] = {}

    @staticmethod
    def _size_class(nbytes: int) -> int:
        return nbytes.bit_length()

    def propose(self, nbytes: int) -> int:
        """This rank's way for an exchange of ``nbytes`` (to each peer)."""
        if not self.enabled or nbytes <= PIECE_BYTES:
            return self.WHOLE
        size_class = self._size_class(nbytes)
        chosen = self._chosen.get(size_class)
        if chosen is not None:
            return chosen
        return self.WHOLE if self._calls.get(size_class, 0) < self.RUN else self.PIECES

    def record(self, nbytes: int, way: int, seconds: float) -> None:
        """The time an exchange of ``nbytes`` took ``way``, as this rank saw it (the way the
        group's first rank proposed, which may not be this rank's own)."""
        if not self.enabled or nbytes <= PIECE_BYTES:
            return
        size_class = self._size_class(nbytes)
        if size_class in self._chosen:
            return
        calls = self._calls.get(size_class, 0)
        self._calls[size_class] = calls + 1
        times = self._times.setdefault(size_class, ([], []))
        if calls % self.RUN:  # the first of a run follows the other way's aftermath
            times[way].append(seconds)
        if calls + 1 < 2 * self.RUN or min(len(t) for t in times) == 0:
            return
        means = [statistics.fmean(t) for t in times]
        way = self.PIECES if means[self.PIECES] < means[self.WHOLE] else self.WHOLE
        self._chosen[size_class] = way
        low = 1 << (size_class - 1)
        log.logger.info(
            "arfuse: exchanges of %s-%s MiB over %s go %s (mean %.2f ms whole, %.2f ms in "
            "pieces of %d KiB)", f"{low / 2**20:g}", f"{2 * low / 2**20:g}", self.link,
            "whole" if way == self.WHOLE else "in pieces", means[self.WHOLE] * 1e3,
            means[self.PIECES] * 1e3, PIECE_BYTES >> 10)

    @contextlib.contextmanager
    def timed(self, nbytes: int, way: int) -> Iterator[None]:
        """Records the block's time as an exchange of ``nbytes`` that went ``way`` (when it
        ends without an error)."""
        started = time.perf_counter()
        yield
        self.record(nbytes, way, time.perf_counter() - started)

    @classmethod
    def piece_bytes(cls, way: int) -> int:
        """``exchange_pair``'s ``piece_bytes`` for ``way``."""
        return PIECE_BYTES if way == cls.PIECES else 0

    def chosen(self) -> dict[int, int]:
        """Size class -> the way kept (the classes learnt so far)."""
        return dict(self._chosen)


class Buffers:
    """A workspace's message and receive buffers by name, kept between calls: fresh memory
    costs a call its page faults (more than the exchange itself, at a few MiB)."""

    def __init__(self) -> None:
        self._kept: dict[str, torch.Tensor] = {}

    def get(self, name: str, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``nbytes`` of uint8 scratch, valid until the next ``get`` of ``name``."""
        kept = self._kept.get(name)
        if kept is not None and kept.numel() >= nbytes and kept.device == torch.device(device):
            return kept[:nbytes]
        made = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if nbytes <= KEEP_BYTES:
            self._kept[name] = made
        return made

    def clear(self) -> None:
        self._kept.clear()


class Heads:
    """Fixed-size heads of int64 words at given offsets of a uint8 message buffer (the
    signature a call's message starts each destination's part with). On a CPU they are
    written and read in the buffer's memory directly: a torch op per head costs more than the
    message's bytes at few tokens, and every rank pays it before the exchange. A caller that
    reuses a buffer may keep its ``memory`` and pass it to each ``write`` and ``read``."""

    def __init__(self, words: int) -> None:
        self._format = struct.Struct(f"<{words}q")
        self.nbytes = self._format.size

    @staticmethod
    def memory(buffer: torch.Tensor) -> Any:
        """``buffer``'s bytes as Python can pack into them (CPU), or ``None`` (another device)."""
        assert buffer.dtype == torch.uint8 and buffer.is_contiguous()
        if buffer.device.type != "cpu":
            return None
        return (ctypes.c_char * buffer.numel()).from_address(buffer.data_ptr())

    def write(self, buffer: torch.Tensor, starts: list[int], words: tuple[int, ...],
              memory: Any = None) -> None:
        """``words`` at each of ``starts`` (``memory``: ``buffer``'s, when kept)."""
        if memory is None:
            memory = self.memory(buffer)
        if memory is not None:
            for start in starts:
                self._format.pack_into(memory, start, *words)
            return
        head = torch.tensor(words, dtype=torch.int64).view(torch.uint8).to(buffer.device)
        for start in starts:
            buffer[start:start + self.nbytes].copy_(head)

    def read(self, buffer: torch.Tensor, starts: list[int],
             memory: Any = None) -> list[tuple[int, ...]]:
        """The words at each of ``starts`` (one host synchronisation on a GPU)."""
        if memory is None:
            memory = self.memory(buffer)
        if memory is not None:
            return [self._format.unpack_from(memory, start) for start in starts]
        heads = torch.stack([buffer[start:start + self.nbytes] for start in starts])
        return [tuple(row) for row in heads.view(torch.int64).tolist()]


# Per process group (by id: the entry is reset whenever a backend is made on it, at the same
# point of the group's collective order on every rank): the bytes after the signature of its
# next signature message, the last agreed call's, and the way (``PieceChoice``) the group's
# first rank proposed in that call for rows of that size. Every op of the group shares it, so
# ops called in different orders on different ranks still meet in one exchange of one size
# and fail there with MismatchedCall; an exchange of two sizes would abort gloo.
_agreed: dict[int, tuple[int, int]] = {}


def agreed_size(group: Any) -> int:
    """The size of ``group``'s next signature message after its signature (bytes)."""
    return _agreed.get(id(group), (0, 0))[0]


def agreed_way(group: Any) -> int:
    """How ``group``'s next signature message crosses (two ranks): the way proposed for its
    rows' size in the last agreed call, since no proposal can precede the message itself."""
    return _agreed.get(id(group), (0, 0))[1]


def agree_size(group: Any, size: int, way: int = 0) -> None:
    """After a call whose ranks agreed (every rank of ``group`` does the same; ``way``: the
    group's first rank's proposal in it)."""
    _agreed[id(group)] = (size, way)


def _wait(work: Any, deadline: float, spin: SpinRecord | None = None) -> None:
    """Block until ``work`` completes or ``deadline`` passes (``TimeoutError``): yielding the
    CPU between looks for the first ``SPIN_S`` where ``spin`` says that pays (a peer that is
    on time answers within it, and an event's wake-up costs more than the exchange), then
    asleep on the event. Work already done (a piece after the first) is no wait to learn from."""
    if work.is_completed():
        work.wait()
        return
    started = time.monotonic()
    if spin is None or spin.worth_it():
        spin_until = started + SPIN_S
        while not work.is_completed() and time.monotonic() < spin_until:
            os.sched_yield()
    if not work.is_completed():
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        while not done.wait(min(_WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError
    if spin is not None:
        spin.add(time.monotonic() - started)
    work.wait()  # completed: its own result, or its own error


def wait_within_deadline(work: Any, ctx: Any, phase: str, backend: str, call: int,
                         deadline: float | None = None) -> None:
    """Wait for async ``work`` at most the group's timeout (until ``deadline``, a
    ``time.monotonic()``, when given); on a timeout (ours or the process group's) raise
    ``CallTimeout`` naming the ranks that never joined call number ``call``."""
    if deadline is None:
        deadline = time.monotonic() + ctx.timeout_s
    spin = _spin_records.get((id(ctx.group), phase))
    if spin is None:
        spin = _spin_records[(id(ctx.group), phase)] = SpinRecord()
    try:
        _wait(work, deadline, spin)
    except Exception as exc:
        if ctx.group is not None:
            keep_for_the_process(ctx.group)
        silent = silent_ranks(ctx, phase, call)
        reported = f"{type(exc).__name__}: {str(exc)[:200]}"
        if not isinstance(exc, TimeoutError) and PEER_GONE.search(str(exc)):
            if silent is None and ctx.world_size == 2:  # the store went too; one peer it is
                silent = [1 - ctx.rank]
            raise CallTimeout(phase, backend, silent, ctx.timeout_s,
                              message=peer_gone(phase, backend, silent, call, reported)) from None
        detail = f" (call {call})" + (
            "" if isinstance(exc, TimeoutError) else f"; the process group reported {reported}")
        raise CallTimeout(phase, backend, silent, ctx.timeout_s, detail=detail) from None


# what gloo (and NCCL's socket layer) say when a peer's end of the connection went away
PEER_GONE = re.compile(r"connection (?:closed|reset)|(?:closed|reset) by peer|broken pipe|"
                       r"ECONNRESET|EPIPE", re.IGNORECASE)


def peer_gone(phase: str, backend: str, silent: list[int] | None, call: int,
              reported: str) -> str:
    """The text of a call whose process group lost the connection to a peer: the peer died or
    left (it says so at once; no deadline ran out), named where the store knows it."""
    who = ("a peer (which rank is unknown)" if not silent else
           f"rank(s) {', '.join(map(str, silent))}")
    return (f"arfuse {backend}: the connection to {who} was closed or reset during a call "
            f"(phase {phase!r}, backend {backend}, call {call}): the peer died or left the "
            f"group; the process group reported {reported}")


_kept: list[int] = []


def keep_for_the_process(group: Any) -> None:
    """Never free ``group``: its abandoned collective stays queued in the backend (gloo), and
    the backend's destructor waits for it, which held the process's exit until the process
    group's own timeout (torch's default: 30 minutes). A group out of step is of no further
    use (``WorkspaceBroken.GROUP_ADVICE``), so it lives until the process ends, unfreed; one
    reference the interpreter cannot drop at shutdown (a list would be cleared then)."""
    if id(group) in _kept:
        return
    _kept.append(id(group))
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def silent_ranks(ctx: Any, phase: str, call: int) -> list[int] | None:
    """Ranks that timed out at this call say so in the store; the others are silent. ``None``
    (unknown) when the store does not answer within ``SILENT_GRACE_S + STORE_ANSWER_S``
    (``ask_store``)."""
    store = ctx.channel.store
    if store is None:
        return None
    key = f"timeout/{phase}/{call}"
    prefix = f"{ctx.channel.prefix}/{key}"

    def ask() -> list[int]:
        ctx.channel.post(f"{key}/{ctx.rank}", "1")
        time.sleep(SILENT_GRACE_S)
        return [r for r in range(ctx.world_size) if not store.check([f"{prefix}/{r}"])]

    found: list[int] | None = ask_store(ask, SILENT_GRACE_S + STORE_ANSWER_S)
    return found


def ask_store(ask: Callable[[], Any], seconds: float = STORE_ANSWER_S) -> Any:
    """``ask()`` (calls on a store) on a thread of its own, waited for at most ``seconds``:
    ``None`` then, or on an error. A store on a host this one cannot reach (a link that went
    down) would hold a socket call until TCP gives up, minutes later; the thread is left
    behind."""
    found: list[Any] = []

    def run() -> None:
        with contextlib.suppress(Exception):
            found.append(ask())

    asking = threading.Thread(target=run, name="arfuse-store", daemon=True)
    asking.start()
    asking.join(seconds)
    return found[0] if found else None


def gather(x: torch.Tensor, ctx: Any, phase: str, backend: str, call: int,
           out: torch.Tensor | None = None, piece_bytes: int = 0) -> torch.Tensor:
    """``[world, *x.shape]`` of every rank's ``x`` over the group, within the deadline (into
    ``out``, contiguous and of that size, when given); ``piece_bytes`` as ``gather_rows``."""
    world = ctx.world_size
    if out is None:
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    rows = out.view(world, *x.shape)
    every = gather_rows(x, ctx, phase, backend, call, rows, piece_bytes)
    for r, got in enumerate(every):
        if got is x:
            rows[r].copy_(x)
    return rows


def gather_rows(x: torch.Tensor, ctx: Any, phase: str, backend: str, call: int,
                rows: torch.Tensor, piece_bytes: int = 0) -> list[torch.Tensor]:
    """Every rank's ``x``, rank by rank: this rank's is ``x`` itself (not copied), the others'
    land in ``rows`` (``[world, *x.shape]``). Two ranks on gloo exchange with ``all_to_all``
    (gloo's pairwise exchange takes a fraction of its all-gather's time, ``docs/design.md``
    4), in pieces as ``exchange_pair``."""
    world, me = ctx.world_size, ctx.rank
    if world == 2 and is_gloo(ctx.group):
        exchange_pair(x.reshape(-1).view(torch.uint8), rows[1 - me].view(-1).view(torch.uint8),
                      ctx, phase, backend, call, piece_bytes)
        return [x, rows[1]] if me == 0 else [rows[0], x]
    TRAFFIC.count((world - 1) * x.numel() * x.element_size())
    wait_within_deadline(_all_gather(rows.view(-1), x.reshape(-1), group=ctx.group,
                                     async_op=True), ctx, phase, backend, call)
    return list(rows)


def exchange_pair(mine: torch.Tensor, theirs: torch.Tensor, ctx: Any, phase: str,
                  backend: str, call: int, piece_bytes: int = 0) -> None:
    """Two ranks: ``mine`` to the peer, the peer's into ``theirs`` (1-D, the same size on both
    ranks), with ``all_to_all``; ``piece_bytes`` > 0: in equal pieces of at most that many
    bytes, all in flight at once (``PieceChoice`` says when that pays)."""
    total = mine.numel()
    count = max(1, -(-total // piece_bytes)) if piece_bytes > 0 else 1
    step = max(1, -(-total // count))
    works = []
    for start in range(0, max(total, 1), step):
        size = min(step, total - start)
        splits = [0, size] if ctx.rank == 0 else [size, 0]
        TRAFFIC.count(size * mine.element_size())
        works.append(issue_all_to_all(ctx.group, theirs[start:start + size],
                                      mine[start:start + size], splits, splits))
    deadline = time.monotonic() + ctx.timeout_s
    for work in works:
        wait_within_deadline(work, ctx, phase, backend, call, deadline)


def all_to_all(send: torch.Tensor, receive: torch.Tensor, send_splits: list[int],
               receive_splits: list[int], ctx: Any, phase: str, backend: str,
               call: int) -> torch.Tensor:
    """``receive`` gets ``receive_splits[j]`` elements from rank j, in rank order; ``send``
    gives rank j the next ``send_splits[j]`` (both 1-D, contiguous), within the deadline."""
    TRAFFIC.count((sum(send_splits) - send_splits[ctx.rank]) * send.element_size())
    wait_within_deadline(issue_all_to_all(ctx.group, receive, send, receive_splits,
                                          send_splits), ctx, phase, backend, call)
    return receive


# the process group's own all-to-all (only ``alltoall_base`` in older torch), and
# its options (asynchronous: the wait is ours, within the deadline)
_ALL_TO_ALL = ("all_to_all_single" if hasattr(dist.ProcessGroup, "all_to_all_single")
               else "alltoall_base")
_ALL_TO_ALL_OPTIONS = dist.AllToAllOptions()
if hasattr(_ALL_TO_ALL_OPTIONS, "asyncOp"):
    _ALL_TO_ALL_OPTIONS.asyncOp = True


def issue_all_to_all(group: Any, receive: torch.Tensor, send: torch.Tensor,
                     receive_splits: list[int], send_splits: list[int]) -> Any:
    """``dist.all_to_all_single(receive, send, receive_splits, send_splits, group=group,
    async_op=True)``, called on the process group itself: the wrapper's checks (a member of
    the group, one plain tensor of one dtype each side, not complex) hold for every caller
    here (rows already checked, buffers this module's own), and at few tokens they cost a
    call more than its bytes. Returns the work."""
    process_group = group if group is not None else dist.group.WORLD
    return getattr(process_group, _ALL_TO_ALL)(receive, send, receive_splits, send_splits,
                                               _ALL_TO_ALL_OPTIONS)


_gloo: dict[int, bool] = {}


def is_gloo(group: Any) -> bool:
    """Whether ``group`` runs on gloo (known per group)."""
    known = _gloo.get(id(group))
    if known is None:
        try:
            known = str(dist.get_backend(group)) == "gloo"
        except (RuntimeError, ValueError):
            known = False
        _gloo[id(group)] = known
    return known
