"""The hier backend across two real hosts on this machine (namespaces of
tests/test_two_hosts.py, ``--ranks-per-host`` each, 2 by default), the link shaped like a real
one with ``tc tbf``:
``python benchmarks/hosts.py [--rates 25gbit,1gbit] [--tokens 1,8,64,512,2048]
[--dtype bf16,fp32] [--repeats 10] [--rounds 3]`` (root). Prints per rate the veth's own round
trip and, per dtype and tokens, the slowest rank's median ms (of ``--rounds`` blocks of
``--repeats`` calls, taking turns, in place) of the user's two lines (``dist.all_reduce`` +
``residual.add_`` + ``F.rms_norm``: the baseline), hier, arfuse's torch backend and gloo
all_reduce alone, hier and torch over the user's lines, and the bytes crossing the link per
call; ``--out F`` writes it all as JSON, the machine recorded.

``--decode``: one decode step of tests/tp_models.py's Llama split over the 4 ranks (grown to
each of ``--hidden``, ``--layers`` layers, a static KV cache of ``--context`` tokens plus the
steps), compiled by Inductor with arfuse's pass, on hier (``auto``) and on the torch backend
(``ARFUSE_BACKEND=torch``: the graph's own gloo all-reduce, add and RMSNorm), the steps timed
taking turns: median us of each, the ratio torch/hier (in ``--out`` too). ``--quick``: tiny
settings, one rate (does it run)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import test_two_hosts as hosts  # noqa: E402

_ECHO = """
import socket, statistics, sys, time
s = socket.socket(); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.connect((sys.argv[1], 29533)); times = []
for _ in range(200):
    t = time.perf_counter(); s.sendall(b"x"); s.recv(1); times.append(time.perf_counter() - t)
print(f"{statistics.median(times) * 1e6:.0f} us (TCP, 1 byte, median of 200)")
"""
_SERVE = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 29533)); s.listen(1); c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(1)):
    c.sendall(b)
"""


def _round_trip(pids: list[int]) -> str:
    """The veth's own round trip: a 1-byte TCP echo from host A to host B."""
    server = subprocess.Popen(["nsenter", "-t", str(pids[1]), "-n", "--", sys.executable,
                               "-c", _SERVE])
    try:
        for _ in range(50):
            got = subprocess.run(["nsenter", "-t", str(pids[0]), "-n", "--", sys.executable,
                                  "-c", _ECHO, hosts.ADDRESSES[1]], capture_output=True,
                                 text=True, timeout=60)
            if got.returncode == 0:
                return got.stdout.strip()
        return "unmeasured: " + got.stderr.strip()[-200:]
    finally:
        server.kill()
        server.wait(10)


def _decode(rate: str, rtt: str, found: dict[str, Any]) -> None:
    """Print one rate's decode steps (``found``: what the ranks wrote)."""
    print(f"link {rate}, veth round trip: {rtt}; decode step, {found['options']}")
    print(f"{'dtype':8} {'hidden':>6} {'hier us':>9} {'torch us':>9} {'torch/hier':>10} "
          f"{'same token':>10}")
    for r in found["rows"]:
        print(f"{r['dtype']:8} {r['hidden']:6d} {r['decode_us_hier']:9.1f} "
              f"{r['decode_us_torch']:9.1f} {r['torch_over_hier']:10.2f} "
              f"{r['token_hier'] == r['token_torch']!s:>10}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", default="25gbit,1gbit")
    parser.add_argument("--tokens", default="1,8,64,512,2048")
    parser.add_argument("--dtype", default="bf16,fp32")
    parser.add_argument("--repeats", type=int, default=10, help="calls per block")
    parser.add_argument("--ranks-per-host", type=int, default=2,
                        help="1: no shm step, each rank its own core on a 2-core machine")
    parser.add_argument("--decode", action="store_true",
                        help="one decode step of tp_models' Llama, hier against torch")
    parser.add_argument("--hidden", default="64,1024", help="--decode: the model's widths")
    parser.add_argument("--layers", type=int, default=2, help="--decode")
    parser.add_argument("--context", type=int, default=128, help="--decode: KV cache tokens")
    parser.add_argument("--steps", type=int, default=200, help="--decode: timed steps each")
    parser.add_argument("--warmup", type=int, default=20, help="--decode")
    parser.add_argument("--rounds", type=int, default=3,
                        help="blocks the backends' calls (--decode: steps) are timed in, "
                             "taking turns")
    parser.add_argument("--out", default="", help="JSON of every rate, the machine recorded")
    parser.add_argument("--quick", action="store_true", help="--decode, tiny: does it run")
    args = parser.parse_args()
    if args.quick:
        args.decode, args.rates, args.hidden, args.dtype = True, "1gbit", "64", "fp32"
        args.layers, args.context, args.steps, args.warmup, args.rounds = 1, 8, 4, 1, 2
    why = hosts._why_not()
    if why:
        sys.exit(f"cannot make two hosts here: {why}")
    report: dict[str, Any] = {}
    for rate in args.rates.split(","):
        # compiling the decode steps, or 2048 tokens over a 1 Gb/s link, takes minutes
        limit = 1800.0
        # each host's fp32 segment at 2048 tokens outgrows the tests' 64 MiB /dev/shm
        with hosts.two_hosts(limit, shm_mib=1024) as pids, \
                tempfile.TemporaryDirectory() as tmp:
            for pid, dev in zip(pids, hosts.DEVICES, strict=True):
                hosts._in(pid, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                          "burst", "256kb", "latency", "50ms")
            rtt = _round_trip(pids)
            out = Path(tmp) / "rows.json"
            body = str(ROOT / "benchmarks" / "hosts_body.py")
            if args.decode:
                options = {k: getattr(args, k) for k in ("layers", "context", "steps", "warmup",
                                                         "rounds")}
                hosts._torchrun(pids, args.ranks_per_host, [
                    body, "decode", str(out), args.hidden, args.dtype, json.dumps(options)],
                    limit)
            else:
                hosts._torchrun(pids, args.ranks_per_host, [
                    body, str(out), args.tokens, args.dtype, str(args.repeats),
                    str(args.rounds)], limit)
            rows = json.loads(out.read_text())
        if args.decode:
            _decode(rate, rtt, rows)
            report[rate] = {"veth_round_trip": rtt, **rows}
            continue
        report[rate] = {"veth_round_trip": rtt, "rows": rows}
        print(f"link {rate}, veth round trip: {rtt}")
        print(f"{'dtype':5} {'tokens':>6} {'user ms':>9} {'hier ms':>9} {'torch ms':>9} "
              f"{'gloo ar ms':>10} {'hier/user':>9} {'torch/user':>10} {'link B torch':>12} "
              f"{'link B hier':>11} {'hier, torch rows':>16}")
        for r in rows:
            print(f"{r['dtype']:5} {r['tokens']:6d} {r['user'] * 1e3:9.3f} "
                  f"{r['hier'] * 1e3:9.3f} {r['torch'] * 1e3:9.3f} "
                  f"{r['gloo_all_reduce'] * 1e3:10.3f} {r['hier_over_user']:9.2f} "
                  f"{r['torch_over_user']:10.2f} {r['link_bytes_torch']:12d} "
                  f"{r['link_bytes_hier']:11d} {r['ways']['hier']:>7}, {r['ways']['torch']}")
    if args.out and report:
        from arfuse.bench.machine import machine_record

        report = {"machine": machine_record(pinned=False, world=2 * args.ranks_per_host),
                  "options": {k: getattr(args, k) for k in (
                      ("hidden", "dtype", "layers", "context", "steps", "warmup", "rounds",
                       "ranks_per_host") if args.decode else
                      ("tokens", "dtype", "repeats", "rounds", "ranks_per_host"))}, **report}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
