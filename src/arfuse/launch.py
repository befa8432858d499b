"""Start the ranks of a job on this machine (the CLI's, a benchmark's), or join the ones
``torchrun`` started.

The launcher sets the standard ``torch.distributed`` environment (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) so a job body
can ``init_process_group`` from the environment whether it runs under this launcher or torchrun.
As torchrun's agent does, the launcher itself hosts the job's store: it binds port 0 (the
system picks a free port) and keeps it bound for the job's life, so two jobs started at once
can never be handed one port, and the ranks connect to it as clients
(``TORCHELASTIC_USE_AGENT_STORE``, read by torch's ``env://`` rendezvous).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

JobBody = Callable[[int, int, Any], int]

RANKS_PER_CPU = 4
"""A job started here runs at most this many ranks per usable CPU (and never fewer than the shm
backend's largest group, so that one can always be tried): each rank is a process, and a typo
in ``--world-size`` must not start thousands of them."""

OUTPUT_CLOSED = 141
"""A rank's exit code when the reader of the job's output went away (``arfuse run | head``):
128 + SIGPIPE, as a shell reports a process that SIGPIPE ended. The job then ends quietly, with
exit 0 (output cut short by its reader is not a failure of the job)."""


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What a launcher such as torchrun sets for each rank it starts (torch's ``env://``)."""


def under_torchrun() -> bool:
    """Whether a launcher started this process as one rank of a job: ``RANK`` or
    ``WORLD_SIZE`` set. Then every one of ``LAUNCHER_VARS`` must be (a ``ValueError``
    names the missing ones): without them this process could neither join its peers nor,
    silently, start ranks of its own instead."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return False
    missing = [v for v in LAUNCHER_VARS if not os.environ.get(v)]
    if missing:
        raise ValueError(
            f"{' and '.join(v for v in ('RANK', 'WORLD_SIZE') if os.environ.get(v))} set (a "
            f"launcher such as torchrun started this rank), but {', '.join(missing)} not: set "
            f"all of {', '.join(LAUNCHER_VARS)}, or none of them to let arfuse start its "
            "own ranks")
    return True


@dataclass(frozen=True)
class JobRanks:
    """The ranks of one CLI job."""

    world: int
    local: int
    """Of them, the ranks on this host."""
    started_here: bool
    """This process starts them (else a launcher such as torchrun did)."""


def _launcher_int(name: str, default: int | None = None) -> int:
    text = os.environ.get(name)
    if text is None and default is not None:
        return default
    try:
        value = int(text or "")
    except ValueError:
        raise ValueError(f"{name}={text!r} (set by the launcher) is not an integer") from None
    if value < 1:
        raise ValueError(f"{name}={text!r} (set by the launcher) must be >= 1")
    return value


def job_ranks(world_size: int | None, default: int = 2) -> JobRanks:
    """The job's ranks: ``--world-size`` (``default`` when not given) started here, or under
    torchrun the ones it started (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``)."""
    if not under_torchrun():
        world = world_size or default
        return JobRanks(world, world, True)
    world = _launcher_int("WORLD_SIZE")
    local = _launcher_int("LOCAL_WORLD_SIZE", world)
    if world_size is not None and world_size != world:
        raise ValueError(f"--world-size {world_size}, but the launcher started {world} ranks "
                         "(WORLD_SIZE); leave --world-size out under torchrun")
    return JobRanks(world, local, False)


def default_device(ranks: JobRanks) -> str:
    """``cuda`` when this host has a CUDA device for each of its ranks, else ``cpu``; under
    torchrun from the launcher's ranks on this host (``LOCAL_WORLD_SIZE``), so every rank of a
    host picks the same."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= ranks.local:
        return "cuda"
    return "cpu"


def usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def max_cpu_ranks() -> int:
    from .backends.shm.layout import MAX_WORLD

    return max(MAX_WORLD, RANKS_PER_CPU * usable_cpus())


def check_ranks(ranks: JobRanks, device: str) -> None:
    """Whether this machine can hold the job's ranks, as one line (``ValueError``): on CUDA one
    device per rank of this host; on the CPU, for ranks started here, ``max_cpu_ranks``."""
    if device == "cuda":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < ranks.local:
            raise ValueError(f"--device cuda: this machine has {count} usable CUDA device(s) "
                             f"for {ranks.local} ranks (one device per rank)")
        return
    limit = max_cpu_ranks()
    if ranks.started_here and ranks.world > limit:
        from .backends.shm.layout import MAX_WORLD

        raise ValueError(
            f"--world-size {ranks.world} is more ranks than this machine runs: at most {limit} "
            f"on the CPU ({RANKS_PER_CPU} per usable CPU, {usable_cpus()} here, and never fewer "
            f"than {MAX_WORLD}, the shm backend's largest group); each rank is a process")


def memory_bytes() -> int | None:
    """This machine's memory (physical pages), or ``None`` where it cannot be read."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(needs: Mapping[str, int], ranks: JobRanks) -> None:
    """Refuse a job whose ranks on this host certainly do not fit in its memory. ``needs``:
    lower bounds of what each rank allocates at once, each keyed by the flags that size it;
    the error names the largest."""
    total = memory_bytes()
    per_rank = sum(needs.values())
    need = per_rank * ranks.local
    if total is not None and need > total:
        gib = 2**30
        what, most = max(needs.items(), key=lambda item: item[1])
        raise ValueError(f"{what} needs at least {most:,} bytes ({most / gib:,.1f} GiB) per "
                         f"rank; the job at least {per_rank / gib:,.1f} GiB per rank, "
                         f"{need / gib:,.1f} GiB for the {ranks.local} ranks here, and this "
                         f"machine has {total / gib:,.1f} GiB of memory")


def init_from_env(device: str, timeout_s: float | None = None) -> None:
    """``init_process_group`` for this job (gloo on CPU, NCCL on CUDA), once every rank has
    met the others (`rendezvous`). ``timeout_s`` bounds that wait and is the group's timeout:
    by default the settings' (``ARFUSE_TIMEOUT_S``), as for every wait of arfuse on peers."""
    import torch
    import torch.distributed as dist

    from . import settings

    if dist.is_initialized():
        return
    if timeout_s is None:
        timeout_s = settings.load().timeout_s
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    store, rank, world = rendezvous(backend, timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _listening(addr: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts connections at ``addr:port`` within ``timeout_s``. Asked
    before a store client is made: one that times out connecting logs a C++ stack trace."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)


def rendezvous(backend: str, timeout_s: float) -> tuple[Any, int, int]:
    """This rank's store of the job at ``MASTER_ADDR:MASTER_PORT`` (hosted by rank 0, or by
    the launcher where ``TORCHELASTIC_USE_AGENT_STORE`` says so, as torch's ``env://``
    rendezvous does), once every rank of ``WORLD_SIZE`` has arrived there: ``(store, rank,
    world)``. Ranks that do not arrive within ``timeout_s`` are a ``RendezvousTimeout``
    naming them."""
    from torch._C._distributed_c10d import TCPStore
    from torch.distributed import DistError

    from .errors import ArfuseError, NegotiationTimeout, RendezvousTimeout
    from .rendezvous import Channel

    under_torchrun()  # every variable the rendezvous reads, or one line saying what is missing
    rank, world = int(os.environ["RANK"]), _launcher_int("WORLD_SIZE")
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    where = f"{addr}:{port}"
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not hosts and not _listening(addr, port, timeout_s):
        raise RendezvousTimeout(where, world, None, timeout_s, backend)
    try:
        store = TCPStore(addr, port, world, is_master=hosts, wait_for_workers=False,
                         multi_tenant=hosts, timeout=timeout)
    except DistError as exc:
        if hosts:  # binding failed: nothing to wait for
            raise ArfuseError(f"rank 0 cannot host the job's store at {where}: "
                              f"{_first_line(exc)}") from None
        raise RendezvousTimeout(where, world, None, timeout_s, backend) from None
    # a restarted torchrun job meets again in the agent's store: its own keys
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    channel = Channel(store, f"arfuse/rendezvous/{attempt}", rank, world)
    try:
        channel.all_gather("arrive", None, timeout_s, backend, abortable=False)
    except NegotiationTimeout as exc:
        raise RendezvousTimeout(where, world, exc.silent, timeout_s, backend) from None
    return store, rank, world


def pin_to_core(rank: int, world: int, cores_per_rank: int = 1) -> bool:
    """Pin the calling thread to ``cores_per_rank`` cores per rank (its intra-op threads), when
    there are enough cores: spinning ranks must not share one. Call it after the process group
    exists: threads started later inherit the pin, and gloo's I/O threads confined to the
    rank's core made gloo's all_reduce 3-5x slower at small sizes on a 2-core VM (a baseline
    that slow flatters every other row)."""
    if not hasattr(os, "sched_getaffinity"):
        return False
    cores = sorted(os.sched_getaffinity(0))
    if cores_per_rank < 1:
        raise ValueError(f"cores_per_rank={cores_per_rank} is not valid; use 1 or more")
    if len(cores) < world * cores_per_rank:
        return False
    os.sched_setaffinity(0, set(cores[rank * cores_per_rank:(rank + 1) * cores_per_rank]))
    return True


def die_with_parent() -> None:
    """A job or rank must not outlive whoever started it (Linux: PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP (``kill``, ``timeout``, a closed terminal, a CI cancel) end the job
    the way Ctrl-C does, through the ``finally`` that stops its ranks."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # only it may set them
        yield
        return
    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _close_output() -> None:
    """Point stdout at /dev/null: nothing more reaches a reader that went away, and no flush
    at exit raises again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _stop(procs: list[Any]) -> None:
    """SIGTERM to every one of them first, then wait; SIGKILL for any still there."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def _rank_main(body: JobBody, rank: int, world: int, port: int, options: Any,
               env: dict[str, str], output_closed: Any) -> None:
    die_with_parent()
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "TORCHELASTIC_USE_AGENT_STORE": "True",  # the launcher hosts the store
                       "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    code = 1
    try:
        code = body(rank, world, options)
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # the reader of the output went away (| head)
        _stopped_for_closed_output(rank, output_closed)
    except Exception as exc:
        print(f"arfuse: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 1
    with contextlib.suppress(Exception):  # what a normal exit would run (arfuse's own
        atexit._run_exitfuncs()           # cleanup among them), without its waits
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        if code == 0:
            _stopped_for_closed_output(rank, output_closed)
    except (OSError, ValueError):  # stdout closed or unusable: nothing left to deliver
        pass
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    os._exit(code)


def _stopped_for_closed_output(rank: int, output_closed: Any) -> None:
    """Tell the launcher, which stops every rank at once, and wait for it. Nothing of this
    rank's teardown runs first: were it to leave the group mid-collective, a peer could fail
    on that (exit 1) before the launcher knew why the job ends. A rank stopped here leaves
    nothing behind that a kill would not (docs/reliability.md)."""
    _close_output()
    output_closed.value = rank
    time.sleep(30.0)
    os._exit(OUTPUT_CLOSED)


def job_store(timeout_s: float = 120.0) -> Any:
    """The job's store, hosted here on a port the system picks (bound from that moment on,
    until the store is let go): ``.port`` says which."""
    from torch._C._distributed_c10d import TCPStore  # what torch.distributed re-exports

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def store_listener() -> socket.socket:
    """For ranks whose rank 0 hosts the store, as in a plain ``init_process_group``: a socket
    listening on a port the system picks, made by whoever starts the ranks before any of
    them, and handed to rank 0 (``rank_store``). The port is held from the moment it is chosen,
    so no other job can be given it."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
    except BaseException:
        listener.close()
        raise
    return listener


def rank_store(rank: int, world: int, port: int, listener: socket.socket | None,
               timeout_s: float) -> Any:
    """This rank's store of the group: rank 0 serves it on ``listener`` (which it takes over),
    the others connect to ``port``."""
    from torch._C._distributed_c10d import TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        if listener is None:
            raise ValueError("rank 0 hosts the store: it needs the listening socket")
        return TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                        master_listen_fd=listener.detach(), timeout=timeout)
    if listener is not None:
        listener.close()  # only rank 0 may hold it: its exit must close the port
    return TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)


def launch(body: JobBody, world: int, options: Any, env: dict[str, str] | None = None,
           timeout_s: float | None = None) -> int:
    """Run ``body(rank, world, options)`` in ``world`` processes; the worst exit code wins
    (a rank that found the output closed ends the job with 0).

    Under torchrun this process is one of the ranks: run the body in place instead, then
    close its ops and the process group (`_leave_group`).
    """
    if under_torchrun():
        try:
            return body(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), options)
        finally:
            _leave_group()
    ctx = mp.get_context("spawn")
    store = job_store()  # held until the job ends: its port cannot go to anyone else
    output_closed = ctx.Value("i", -1)  # the rank that found the output closed
    procs = [ctx.Process(target=_rank_main, args=(body, r, world, store.port, options,
                                                  env or {}, output_closed))
             for r in range(world)]
    with terminate_as_interrupt():
        try:
            return _run(procs, timeout_s, output_closed)
        finally:
            del store


def _leave_group() -> None:
    """Close arfuse's ops and destroy the process group, the way a torchrun rank's script
    should end: left to the interpreter's exit, the group's C++ threads were torn down in no
    set order and a rank could abort there (std::terminate) after its work was done."""
    import torch.distributed as dist

    from .registry import destroy_all

    destroy_all()
    if dist.is_initialized():
        dist.destroy_process_group()


def _run(procs: list[Any], timeout_s: float | None, output_closed: Any) -> int:
    for p in procs:
        p.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    before_stop: list[int | None] = []  # exit codes when the output closed (ranks not yet
    try:                                # stopped): later ones are the stop's, not failures
        while any(p.is_alive() for p in procs):
            if output_closed.value >= 0:
                before_stop = [p.exitcode for p in procs]
                break  # nobody reads what the job says any more: stop every rank
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(2.0)  # a failed rank: give the others a moment to report, then stop
                break
            if deadline is not None and time.monotonic() > deadline:
                print(f"arfuse: job did not finish within {timeout_s:g}s", file=sys.stderr)
                break
            time.sleep(0.05)
    finally:
        closed = output_closed.value
        # the rank that found the output closed goes last: its peers, still in the job, would
        # see it die and report that before their own stop reached them
        _stop([p for r, p in enumerate(procs) if r != closed])
        _stop([p for r, p in enumerate(procs) if r == closed])
    codes = [p.exitcode if p.exitcode is not None else 1 for p in procs]
    if output_closed.value >= 0:
        # ranks stopped because the output closed did not fail; one that failed before did
        failed = [c for c in (before_stop or codes)
                  if c is not None and c not in (0, OUTPUT_CLOSED) and c > 0]
        return failed[0] if failed else 0
    bad = [c for c in codes if c != 0]
    return 0 if not bad else (bad[0] if bad[0] > 0 else 1)
