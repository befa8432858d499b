"""What the fused op costs one rank with nobody to exchange with: a floor under any group's time.

Runs the compiled shm kernel for a group of one on private memory (the same loops as a real
group, minus waiting for and reading the peers), in place as vLLM calls it, two ways: input in
private memory (copied into the slot first) and input already in the slot (``input_buffer``,
no copy). Inputs are rewritten before every call, untimed, as in ``arfuse bench``. The two ways
take turns in blocks of calls. Compare with ``arfuse bench``'s gloo row: at N x faster than gloo,
a group must finish within gloo's time / N, and it cannot beat one rank alone.

    python benchmarks/one_rank_floor.py --dtype fp32 --tokens 1,8,64,512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from arfuse.backends.shm import build as shm_build
from arfuse.backends.shm import layout as shm_layout

DTYPES = {"bf16": (torch.bfloat16, 0), "fp16": (torch.float16, 1), "fp32": (torch.float32, 2)}
BLOCK = 20


def measure(tokens: int, hidden: int, dtype_name: str, calls: int) -> dict[str, float]:
    module = shm_build.load()
    if module is None:
        raise SystemExit(f"no compiled kernel here: {shm_build.why_not()}")
    dtype, code = DTYPES[dtype_name]
    layout = shm_layout.ShmLayout(1, tokens, hidden, torch.tensor([], dtype=dtype).element_size())
    memory = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    comm = module.ShmComm(memory.data_ptr(), 1, 0, tokens, hidden, code,
                          shm_layout.HEADER_BYTES, layout.slot_bytes, layout.input_bytes,
                          10.0, 1 << 40)
    comm.set_copy_mode(1)  # cached: no peer reads the copy
    x0 = torch.randn(tokens, hidden).to(dtype)
    r0 = torch.randn(tokens, hidden).to(dtype)
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    x, residual, out = x0.clone(), r0.clone(), torch.empty_like(x0)
    nbytes = tokens * hidden * x0.element_size()

    def slot() -> torch.Tensor:
        offset = comm.next_input_offset()
        return memory[offset:offset + nbytes].view(dtype).view(tokens, hidden)

    def in_place() -> float:
        x.copy_(x0)
        residual.copy_(r0)
        t0 = time.perf_counter_ns()
        comm.run(x, residual, weight, 1e-6, 0.0, 0, 0.0, x, residual)
        return (time.perf_counter_ns() - t0) / 1e3

    def from_slot() -> float:
        s = slot()
        s.copy_(x0)
        residual.copy_(r0)
        t0 = time.perf_counter_ns()
        comm.run(s, residual, weight, 1e-6, 0.0, 0, 0.0, out, residual)
        return (time.perf_counter_ns() - t0) / 1e3

    ways = {"in_place_us": in_place, "input_in_slot_us": from_slot}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(max(1, calls // BLOCK)):
        for name, way in ways.items():
            way()
            times[name].extend(way() for _ in range(BLOCK))
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64,512")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    rows = []
    print(f"one rank alone, {args.dtype}, hidden {args.hidden}, median us of {args.calls} calls")
    print(f"{'tokens':>7} {'KiB':>7} {'in place':>9} {'input in slot':>14}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        med = measure(tokens, args.hidden, args.dtype, args.calls)
        rows.append({"tokens": tokens, **med})
        kib = tokens * args.hidden * DTYPES[args.dtype][0].itemsize / 1024
        print(f"{tokens:>7} {kib:>7.0f} {med['in_place_us']:>9.1f} "
              f"{med['input_in_slot_us']:>14.1f}")
    out = Path(args.out or f"benchmarks/results/one_rank_floor-{args.dtype}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"dtype": args.dtype, "hidden": args.hidden, "cores": os.cpu_count(),
                               "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
