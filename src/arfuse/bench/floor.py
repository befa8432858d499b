"""Each row's memory floor: the bytes it must move (``traffic``), and the rates to move them at,
measured in the same run on this rank's core (``measure_rates``)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..log import logger


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank must read or write for a row's work, by where the lines are: ``local``
    (its own memory, recently used), ``shared`` (its input into shared memory: lines the peer's
    core read last, which a store must take back), ``peer`` (lines another rank's core has just
    written: each crosses between cores) and ``fresh`` (new output tensors: lines a store must
    first fetch from beyond this core's caches)."""

    local: int
    shared: int
    peer: int
    fresh: int

    @property
    def total(self) -> int:
        return self.local + self.shared + self.peer + self.fresh


def traffic(row: str, size: int, world: int, mode: str = "twoshot") -> Traffic | None:
    """What a row moves on ``size`` bytes per rank (None: no floor stated). The fused op: its
    input into the shared slot (none when the layer wrote it there: ``shm-slot``), every
    peer's input, the residual in, ``residual_out`` and ``out`` (new tensors in ``shm``;
    ``shm-slot`` gets a new ``out``); with a replicated residual, two-shot (``mode``) reads
    the residual of its own rows only (in place the residual's lines come in all the same, to
    be overwritten). DeepSpeed's all-reduce alone: its input into shared memory, every peer's
    input, the sum back into the tensor."""
    peers = (world - 1) * size
    if row in ("shm-inplace", "shm-inplace-replicated"):
        return Traffic(local=3 * size, shared=size, peer=peers, fresh=0)
    if row == "shm":
        return Traffic(local=size, shared=size, peer=peers, fresh=2 * size)
    if row == "shm-replicated":
        residual = -(-size // world) if mode == "twoshot" else size
        return Traffic(local=residual, shared=size, peer=peers, fresh=2 * size)
    if row == "shm-slot":
        return Traffic(local=2 * size, shared=0, peer=peers, fresh=size)
    if row == "deepspeed":
        return Traffic(local=size, shared=size, peer=peers, fresh=0)
    return None


def moe_traffic(size: int, expert_bytes: int, add_bytes: int, world: int) -> Traffic:
    """What the fused MoE call (the ``shm`` row of a MoE bench) moves on ``size`` bytes of
    ``x`` per rank: its expert rows (``expert_bytes``) and the shared expert or token input
    (``add_bytes``) read, its ``x`` into the shared slot, every peer's ``x``, the residual in,
    ``residual_out`` and ``out`` new. The index and scales are left out: top_k numbers a row."""
    return Traffic(local=expert_bytes + add_bytes + size, shared=size,
                   peer=(world - 1) * size, fresh=2 * size)


@dataclass(frozen=True)
class PeerRates:
    """Bytes per second between this rank's core and the next rank's, measured now (see
    peer_rates): reading lines the peer has just written, and writing lines the peer read."""

    read: float
    shared_write: float


@dataclass(frozen=True)
class Rates:
    """Bytes per second for one working-set size, measured in the same run on this rank's
    core: ``copy`` (read + write of a local copy: the floor's one rate), ``peer`` (None: not
    measured) and ``fresh_write`` (writing a new tensor, as the op's new outputs are)."""

    copy: float
    peer: PeerRates | None
    fresh_write: float

    def floor_s(self, moved: Traffic) -> float:
        """Seconds to move every byte at the copy rate: the floor."""
        return moved.total / self.copy

    def measured_floor_s(self, moved: Traffic) -> float | None:
        """Seconds to move each kind of byte at its own measured rate (None: a rate missing)."""
        if self.peer is None:
            return None
        return (moved.local / self.copy + moved.shared / self.peer.shared_write
                + moved.peer / self.peer.read + moved.fresh / self.fresh_write)


def copy_bandwidth(size: int, repeats: int = 64) -> float:
    """Read + write bytes per second of one core copying ``size`` bytes (the working set of a
    row of that size), measured now, on this rank's core: the rate every floor divides by."""
    size = max(size, 4096)
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    for _ in range(4):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        dst.copy_(src)
        times.append(time.perf_counter_ns() - start)
    return 2 * size / (statistics.median(times) * 1e-9)


def _one_side_rate(size: int, copy_s: float, copy_rate: float) -> float:
    """The rate of one side (its read or its write) of a copy of ``size`` bytes that took
    ``copy_s``, the other side counted at the local copy rate (each byte read or written costs
    ``1 / copy_rate`` there)."""
    other_s = size / copy_rate
    return size / max(copy_s - other_s, other_s * 1e-3)


PEER_SPIN_TIMEOUT_S = 30.0
FLAG_BYTES = 4096  # the flag's own page, ahead of the buffer in each rank's file


def _exchange_copy() -> Any:
    """copy(dst, src, read_ahead): the shm kernel's own way of moving lines between cores
    (``exchange_copy``: software prefetch ahead of the reads or of the stores), so that the
    shared rates are those the kernel can reach; ``Tensor.copy_`` without a compiled kernel."""
    from ..backends.shm import build as shm_build

    module = shm_build.load()
    if module is not None:
        return module.diagnostics.exchange_copy
    return lambda dst, src, read_ahead: dst.copy_(src)


class _Flags:
    """Each rank's progress, an int64 at the head of its shared file; a rank spins on its
    neighbours' (as the op's ranks do), so no core idles in a barrier between a write and the
    read timed."""

    def __init__(self, mine: torch.Tensor, following: torch.Tensor,
                 preceding: torch.Tensor) -> None:
        self.mine, self.following, self.preceding = mine, following, preceding
        self.mine.zero_()

    def post(self, value: int) -> None:
        self.mine[0] = value

    @staticmethod
    def wait(flag: torch.Tensor, value: int) -> None:
        deadline = time.monotonic() + PEER_SPIN_TIMEOUT_S
        while int(flag[0]) < value:
            if time.monotonic() > deadline:
                raise TimeoutError(f"bench: a peer did not reach step {value} of the "
                                   f"peer-rate measurement in {PEER_SPIN_TIMEOUT_S:.0f} s")
            os.sched_yield()  # returns at once on a core of its own


def _reserve(path: Path, size: int) -> bool:
    """This rank's file of the flag page and ``size`` bytes, reserved, not sparse: a full
    directory is an error here (logged), not a SIGBUS at a store."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, FLAG_BYTES + size)
        finally:
            os.close(fd)
    except OSError as exc:
        logger.warning("bench: no peer rates for %d bytes: %s (%s)", size, exc.strerror, path)
        return False
    return True


def _map(path: Path, size: int) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def _exchange(mine: torch.Tensor, theirs: torch.Tensor, flags: _Flags, size: int,
              copy_rate: float, repeats: int) -> PeerRates:
    """Rewrite this rank's buffer, then copy the next rank's, in lockstep with both
    neighbours (``flags``); each side of the copies less its local part."""
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    buffer, peer_buffer = mine[FLAG_BYTES:], theirs[FLAG_BYTES:]
    copy = _exchange_copy()
    writes, reads = [], []
    for i in range(1, repeats + 3):
        start = time.perf_counter_ns()
        copy(buffer, src, False)  # lines the previous rank read last time
        writes.append(time.perf_counter_ns() - start)
        flags.post(2 * i - 1)
        flags.wait(flags.following, 2 * i - 1)
        start = time.perf_counter_ns()
        copy(dst, peer_buffer, True)
        reads.append(time.perf_counter_ns() - start)
        flags.post(2 * i)
        flags.wait(flags.preceding, 2 * i)  # the previous rank is done with our buffer
    return PeerRates(
        read=_one_side_rate(size, statistics.median(reads[2:]) * 1e-9, copy_rate),
        shared_write=_one_side_rate(size, statistics.median(writes[3:]) * 1e-9, copy_rate))


def peer_rates(size: int, copy_rate: float, tag: int, repeats: int = 16) -> PeerRates | None:
    """This rank's rates with the next rank's core, through buffers in ``ARFUSE_SHM_DIR``, each
    moved as the kernel moves it (``_exchange_copy``): ``read``, a copy of the buffer the next
    rank has just written (as a rank reads a peer's slot), less its local write;
    ``shared_write``, rewriting its own buffer after the previous rank has read it (as a rank
    refills its slot), less the local read. None, on every rank,
    when a rank cannot reserve its buffer there (a full or missing directory: logged).
    Collective: every rank calls it with the same arguments."""
    import torch.distributed as dist

    from ..backends.shm.segment import segment_dir

    rank, world = dist.get_rank(), dist.get_world_size()
    directory = segment_dir()
    size = max(size, 4096)
    if world < 2:
        return PeerRates(read=copy_rate, shared_write=copy_rate)

    def path(r: int) -> Path:
        return directory / f"arfuse-bench-{tag}-{r}-{size}"

    reserved = _reserve(path(rank), size)
    on_disk = reserved
    agreed = torch.tensor([int(reserved)], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    try:
        if not agreed.item():
            return None
        mine = _map(path(rank), FLAG_BYTES + size)
        theirs = _map(path((rank + 1) % world), FLAG_BYTES + size)
        reader = _map(path((rank - 1) % world), FLAG_BYTES)
        # this rank waits for the next (its data) and for the previous (done reading ours)
        flags = _Flags(mine[:8].view(torch.int64), theirs[:8].view(torch.int64),
                       reader[:8].view(torch.int64))
        dist.barrier()  # every flag zeroed before any is waited on; every file mapped
        path(rank).unlink()  # the mappings stay: nothing is left if a rank dies from here on
        on_disk = False
        return _exchange(mine, theirs, flags, size, copy_rate, repeats)
    finally:
        if on_disk:  # returned or failed before the files were mapped
            path(rank).unlink(missing_ok=True)


def fresh_write_rate(size: int, copy_rate: float, repeats: int = 16) -> float:
    """Bytes per second of writing lines this core last wrote a call's traffic ago (four
    times as many bytes of other data since), as a new output tensor's are: the allocator
    hands back the memory the previous call's outputs freed (without page faults: see
    ``page_faults_per_call``). A copy from a source in cache, less that read."""
    size = max(size, 4096)
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.zeros(size, dtype=torch.uint8)  # its pages exist, as reused memory's do
    other = torch.empty(4 * size, dtype=torch.uint8)
    times = []
    for i in range(repeats + 2):
        other.fill_(i & 0xFF)
        src.add_(0)  # the source back in cache
        start = time.perf_counter_ns()
        dst.copy_(src)
        took = time.perf_counter_ns() - start
        if i >= 2:
            times.append(took)
    return _one_side_rate(size, statistics.median(times) * 1e-9, copy_rate)


def measure_rates(size: int, tag: int) -> Rates:
    """Every rate of the floors for a working set of ``size`` bytes. Collective."""
    copy = copy_bandwidth(size)
    return Rates(copy=copy, peer=peer_rates(size, copy, tag),
                 fresh_write=fresh_write_rate(size, copy))
