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
