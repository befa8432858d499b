"""Start the ranks of a CLI job on this machine, or join the ones ``torchrun`` started.

The launcher sets the standard ``torch.distributed`` environment (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_SIZE``) so a job body can
``init_process_group`` from the environment whether it runs under this launcher or torchrun.
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
from collections.abc import Callable, Iterator
from typing import Any

JobBody = Callable[[int, int, Any], int]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_from_env(device: str, timeout_s: float = 120.0) -> None:
    """``init_process_group`` for this job: gloo on CPU, NCCL on CUDA."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def pin_to_core(rank: int, world: int) -> bool:
    """Pin the calling thread to one core per rank, when there are enough cores: spinning ranks
    must not share one. Call it after the process group exists: threads started later inherit
    the pin, and gloo's I/O threads confined to the rank's core made gloo's all_reduce 3-5x
    slower at small sizes on a 2-core VM (a baseline that slow flatters every other row)."""
    if not hasattr(os, "sched_getaffinity"):
        return False
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < world:
        return False
    os.sched_setaffinity(0, {cores[rank]})
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


def _rank_main(body: JobBody, rank: int, world: int, port: int, options: Any,
               env: dict[str, str]) -> None:
    die_with_parent()
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_SIZE": str(world)})
    code = 1
    try:
        code = body(rank, world, options)
    except KeyboardInterrupt:
        code = 130
    except Exception as exc:
        print(f"arfuse: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        with contextlib.suppress(Exception):  # what a normal exit would run (arfuse's own
            atexit._run_exitfuncs()           # cleanup among them), without its waits
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def launch(body: JobBody, world: int, options: Any, env: dict[str, str] | None = None,
           timeout_s: float | None = None) -> int:
    """Run ``body(rank, world, options)`` in ``world`` processes; the worst exit code wins.

    Under torchrun this process is one of the ranks: run the body in place instead.
    """
    if under_torchrun():
        return body(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), options)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(body, r, world, port, options, env or {}))
             for r in range(world)]
    with terminate_as_interrupt():
        return _run(procs, timeout_s)


def _run(procs: list[Any], timeout_s: float | None) -> int:
    for p in procs:
        p.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(2.0)  # a failed rank: give the others a moment to report, then stop
                break
            if deadline is not None and time.monotonic() > deadline:
                print(f"arfuse: job did not finish within {timeout_s:g}s", file=sys.stderr)
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    codes = [p.exitcode if p.exitcode is not None else 1 for p in procs]
    bad = [c for c in codes if c != 0]
    return 0 if not bad else (bad[0] if bad[0] > 0 else 1)
