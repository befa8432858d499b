"""A process whose collective timed out can exit: the abandoned collective does not hold it
until the process group's own timeout."""

from __future__ import annotations

import subprocess
import sys
import textwrap

RANK = textwrap.dedent("""
    import datetime, sys, time
    import torch, torch.distributed as dist
    import arfuse
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)  # the test's process hosts it
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=16, dtype=torch.float32,
                                 backend="torch", timeout_s=1.0)
    print("made", flush=True)
    if rank == 1:
        time.sleep(600)  # alive, never calls
    try:
        comm(torch.ones(2, 16))
    except arfuse.CallTimeout:
        print("timed out", flush=True)
    if sys.argv[3] == "destroy":
        dist.destroy_process_group()
""")


def _exit_after_a_timed_out_call(end: str) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    port = str(store.port)
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), port, end],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        # far under the group's 600 s: only an exit the collective does not hold ends here
        out, err = ranks[0].communicate(timeout=120)
        assert ranks[0].returncode == 0, err
        assert out.split() == ["made", "timed", "out"], (out, err)
        assert ranks[1].poll() is None  # its peer is still alive: nothing completed the call
    finally:
        for proc in ranks:
            proc.kill()
            proc.communicate()


def test_a_process_exits_after_a_timed_out_call() -> None:
    _exit_after_a_timed_out_call("return")


def test_a_process_exits_after_a_timed_out_call_and_destroy_process_group() -> None:
    _exit_after_a_timed_out_call("destroy")


DESTROY_ALL = textwrap.dedent("""
    import datetime, gc, sys, weakref
    import torch, torch.distributed as dist
    import arfuse
    rank, port, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)  # the test's process hosts it
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=16, dtype=torch.float32,
                                 backend=backend, timeout_s=30.0)
    assert comm.backend == backend, comm.backend
    comm(torch.ones(2, 16))
    comm(torch.ones(8, 16))  # over capacity on shm: its unfused workspace too
    group = weakref.ref(dist.group.WORLD)
    arfuse.destroy_all()  # comm stays alive, never closed
    dist.destroy_process_group()
    gc.collect()
    print("group freed" if group() is None else "group alive", flush=True)
    try:
        comm(torch.ones(2, 16))
    except arfuse.ArfuseError as exc:
        print("refused:", exc, flush=True)
""")


def test_destroy_all_with_live_ops_lets_the_group_go_and_the_process_exit_cleanly() -> None:
    """``destroy_all()`` closes the ops still alive, so ``destroy_process_group()`` frees the
    group and gloo is not torn down during interpreter shutdown (where it aborted the process
    now and then): each run checks the group is freed, and many runs that each exits 0."""
    import torch.distributed as dist

    for round_ in range(4):
        for backend in ("shm", "torch"):
            store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
            ranks = [subprocess.Popen([sys.executable, "-c", DESTROY_ALL, str(r),
                                       str(store.port), backend],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for r in range(2)]
            try:
                for rank, proc in enumerate(ranks):
                    out, err = proc.communicate(timeout=180)
                    where = f"round {round_}, {backend}, rank {rank}: {out}{err[-2000:]}"
                    assert proc.returncode == 0, where
                    lines = out.splitlines()
                    assert lines[0] == "group freed", where
                    assert lines[1].startswith("refused:") and "destroy_all" in lines[1], where
            finally:
                for proc in ranks:
                    proc.kill()
                    proc.communicate()
