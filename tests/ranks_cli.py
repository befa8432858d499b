"""Rank bodies for the command line's tests: ranks that arfuse.launch starts (one that sleeps,
one with an exit handler, one that checks the store's port), and bench's peer rates. Module
level, so they can be pickled."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch


def rank_that_sleeps(rank: int, world: int, directory: str) -> int:
    """A launched rank that says it started (its pid in ``directory``), then sleeps."""
    Path(directory, f"rank{rank}").write_text(str(os.getpid()))
    time.sleep(60)
    return 0


def rank_with_an_exit_handler(rank: int, world: int, directory: str) -> int:
    """A launched rank whose atexit handler leaves a mark (as build.py's cleanup would)."""
    import atexit

    atexit.register(Path(directory, f"rank{rank}").write_text, "ran")
    return 0


def rank_whose_output_closes_while_a_peer_watches(rank: int, world: int,
                                                  directory: str) -> int:
    """Rank 0 finds the output closed, with an exit handler that marks its teardown (slowly,
    as leaving a group can be); rank 1 fails (exit 1) as soon as it sees that mark, as a peer
    left mid-collective would."""
    import atexit

    mark = Path(directory, "rank0-teardown")
    if rank == 0:
        def teardown() -> None:
            mark.write_text("left")
            time.sleep(1.0)

        atexit.register(teardown)
        raise BrokenPipeError("the reader of the output went away")
    for _ in range(1200):
        if mark.exists():
            return 1
        time.sleep(0.05)
    return 0


def rank_finds_the_store_port_taken_before_rank0_starts(rank: int, world: int,
                                                        directory: str) -> int:
    """Rank 1 tries to bind the job's MASTER_PORT while rank 0 has not started yet: the port
    must already be held (a port found free, then bound by rank 0 later, can be taken by
    anyone in between). Then the ranks meet through it, from the environment."""
    import socket

    import torch.distributed as dist

    from arfuse.launch import init_from_env

    port = int(os.environ["MASTER_PORT"])
    checked = Path(directory, "checked")
    if rank == 1:
        with socket.socket() as other:
            try:
                other.bind(("127.0.0.1", port))
                verdict = "free"
            except OSError:
                verdict = "held"
        Path(directory, "verdict").write_text(verdict)
        checked.touch()
    else:
        for _ in range(1200):
            if checked.exists():
                break
            time.sleep(0.05)
    init_from_env("cpu", timeout_s=60)
    total = torch.ones(1)
    dist.all_reduce(total)
    return 0 if int(total.item()) == world else 1


def peer_rates(rank: int, world: int, blocked: int | None, directory: str) -> dict[str, Any]:
    """arfuse bench's peer rates in ``directory``; rank ``blocked`` gets a directory it cannot
    write (a full or missing ARFUSE_SHM_DIR)."""
    from pathlib import Path

    from arfuse.bench import floor

    os.environ["ARFUSE_SHM_DIR"] = str(Path(directory) / ("missing" if rank == blocked else ""))
    rates = floor.peer_rates(1 << 16, copy_rate=1e12, tag=4242)
    torch.distributed.barrier()
    return {"rate": None if rates is None else (rates.read, rates.shared_write),
            "left": sorted(p.name for p in Path(directory).iterdir())}
