"""One exchange of ``--mib`` MiB between two namespace hosts (tests/test_two_hosts.py's, one
rank each, the veth shaped by ``tc tbf`` at each rate), whole or in pieces, against gloo's
all-reduce of the same bytes: what ``collective.PieceChoice`` chooses between.

    python benchmarks/link_pieces.py [--rates 25gbit,1gbit] [--mib 8] [--out F]   (root)

Per rate, the median ms of: ``all_to_all`` of the whole message; in pieces of 1 MiB and of
256 KiB, all in flight at once; gloo's ``all_reduce`` of as many fp32 values (the link's time
is the bytes over the rate)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import test_two_hosts as hosts  # noqa: E402

BODY = """
import datetime, json, statistics, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank, n = dist.get_rank(), int(sys.argv[2]) << 20
x, out = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
values = torch.ones(n // 4)

def pieces(size):
    step = min(size, n)
    splits = [0, step] if rank == 0 else [step, 0]
    works = [dist.all_to_all_single(out[s:s + step], x[s:s + step], splits, splits,
                                    async_op=True) for s in range(0, n, step)]
    for work in works:
        work.wait()

rows = {"whole": lambda: pieces(n), "1 MiB pieces": lambda: pieces(1 << 20),
        "256 KiB pieces": lambda: pieces(256 << 10),
        "gloo all_reduce": lambda: dist.all_reduce(values)}
times = {name: [] for name in rows}
for _ in range(3):
    for name, fn in rows.items():
        dist.barrier()
        for _ in range(4):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({name: statistics.median(t) * 1e3 for name, t in times.items()}, f)
dist.destroy_process_group()
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", default="25gbit,1gbit")
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    why = hosts._why_not()
    if why:
        sys.exit(f"cannot make two hosts here: {why}")
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body.py"
        body.write_text(BODY)
        for rate in args.rates.split(","):
            with hosts.two_hosts(600.0, shm_mib=64) as pids:
                for pid, dev in zip(pids, hosts.DEVICES, strict=True):
                    hosts._in(pid, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                              rate, "burst", "256kb", "latency", "50ms")
                out = Path(tmp) / f"{rate}.json"
                hosts._torchrun(pids, 1, [str(body), str(out), str(args.mib)], 600.0)
                report[rate] = json.loads(out.read_text())
            print(f"link {rate}, {args.mib} MiB: " + ", ".join(
                f"{name} {ms:.1f} ms" for name, ms in report[rate].items()), flush=True)
    if args.out:
        from arfuse.bench.machine import machine_record

        Path(args.out).write_text(json.dumps({"machine": machine_record(pinned=False, world=2),
                                              "mib": args.mib, **report}, indent=1))


if __name__ == "__main__":
    main()
