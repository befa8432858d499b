"""The hier backend across two real hosts on this machine (namespaces of
tests/test_two_hosts.py, 2 ranks each), the link shaped like a real one with ``tc tbf``:
``python benchmarks/hosts.py [--rates 25gbit,1gbit] [--tokens 1,8,64,512,2048]
[--dtype bf16,fp32] [--repeats 30]`` (root). Prints per rate the veth's own round trip and,
per dtype and tokens, median ms of hier, torch (gloo all-gather + eager add + RMSNorm) and gloo
all_reduce alone, the ratio torch/hier and the bytes crossing the link per call."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", default="25gbit,1gbit")
    parser.add_argument("--tokens", default="1,8,64,512,2048")
    parser.add_argument("--dtype", default="bf16,fp32")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    why = hosts._why_not()
    if why:
        sys.exit(f"cannot make two hosts here: {why}")
    for rate in args.rates.split(","):
        with hosts.two_hosts() as pids, tempfile.TemporaryDirectory() as tmp:
            for pid, dev in zip(pids, hosts.DEVICES, strict=True):
                hosts._in(pid, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                          "burst", "256kb", "latency", "50ms")
            rtt = _round_trip(pids)
            out = Path(tmp) / "rows.json"
            hosts._torchrun(pids, 2, [str(ROOT / "benchmarks" / "hosts_body.py"), str(out),
                                      args.tokens, args.dtype, str(args.repeats)])
            rows = json.loads(out.read_text())
        print(f"link {rate}, veth round trip: {rtt}")
        print(f"{'dtype':5} {'tokens':>6} {'hier ms':>9} {'torch ms':>9} {'gloo ar ms':>10} "
              f"{'torch/hier':>10} {'link B torch':>12} {'link B hier':>11}")
        for r in rows:
            print(f"{r['dtype']:5} {r['tokens']:6d} {r['hier'] * 1e3:9.3f} "
                  f"{r['torch'] * 1e3:9.3f} {r['gloo_all_reduce'] * 1e3:10.3f} "
                  f"{r['torch'] / r['hier']:10.2f} {r['link_bytes_torch']:12d} "
                  f"{r['link_bytes_hier']:11d}")


if __name__ == "__main__":
    main()
