"""A Llama-shaped tensor-parallel model on 2 ranks, compiled three ways: plain Inductor
(gloo all-reduce, add and RMSNorm as the model writes them), Inductor with arfuse's pass
(``arfuse.compile_backend``), and the hand-written version that calls arfuse's shm operator
itself; decode-step and prefill medians, the ratios, and the compile time with and without
the pass. A fourth decode, the model with no chain at all (no all-reduce, add nor norm: the
step's other work), bounds what any fusion can give: ``decode_bound_vs_plain``, plain over it.
A fifth, "sync", is that model with the ranks meeting at each chain (the shm op on 64 floats of
the partial sum, which take the sum's place): the step's other work plus the cheapest
all-reduce there is, whose ratio ``decode_sync_bound_vs_plain`` bounds what any all-reduce
can give (ranks whose steps vary wait for each other at every meeting). JSON out, the machine
(ISA included) recorded.

    python benchmarks/compile_decode.py --out benchmarks/results/<machine>/compile-decode.json
    python benchmarks/compile_decode.py --short --out ...  # 1024 and 4096, ~12 min on 2 cores
    python benchmarks/compile_decode.py --quick          # tiny sizes: does it run

Targets: decode with the pass >= 1.5x plain Inductor (out of reach where the sync bound is
under it) and within 5% of the hand-written model; prefill (32-512 tokens) no slower than plain;
the pass adds < 10% compile time (``compile_added_by_pass``: the whole decode compile's
change; ``pass_share_of_plain_compile``: the pass's own seconds; compile seconds are Dynamo's
record of the first call, caches off). Prefill runs one dynamic-shape graph per variant;
decode a static one (KV cache of ``--context`` tokens, not updated: the step's shapes stay
fixed). The variants' steps are timed taking turns (``--rounds``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from arfuse.launch import init_from_env, launch, pin_to_core

EPS = 1e-6
VARIANTS = ("plain", "pass", "hand", "none", "sync")
NO_CHAIN = -1  # Model's handle for the "none" and "sync" variants: the chains left out
SYNC_FLOATS = 64  # what the "sync" variant's ranks exchange at each chain


def rms_norm(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """As HF Llama writes it."""
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * x.to(h.dtype)


class Model(nn.Module):
    """``layers`` decoder layers (no embedding, no head): this rank's heads and MLP part."""

    def __init__(self, hidden: int, layers: int, world: int, dtype: torch.dtype,
                 context: int, handle: int | None) -> None:
        super().__init__()
        self.heads, self.head_dim = max(1, hidden // 128 // world), min(128, hidden)
        local, inter = self.heads * self.head_dim, 3 * hidden // world

        def weight(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape).div(shape[-1] ** 0.5).to(dtype),
                                requires_grad=False)

        self.qkv = nn.ParameterList(weight(3 * local, hidden) for _ in range(layers))
        self.o = nn.ParameterList(weight(hidden, local) for _ in range(layers))
        self.gate_up = nn.ParameterList(weight(2 * inter, hidden) for _ in range(layers))
        self.down = nn.ParameterList(weight(hidden, inter) for _ in range(layers))
        self.norms = nn.ParameterList(weight(hidden) for _ in range(2 * layers + 1))
        self.cache = [torch.randn(2, self.heads, context, self.head_dim).to(dtype)
                      for _ in range(layers)]
        self.handle = handle  # the shm operator's handle: the hand-written fused version
        self.sync: int | None = None  # with NO_CHAIN: the handle the ranks meet through

    def _attention(self, i: int, x: torch.Tensor, decode: bool) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = F.linear(x, self.qkv[i]).view(tokens, 3, self.heads, self.head_dim) \
            .permute(1, 2, 0, 3)
        if decode:
            k, v = self.cache[i][0], self.cache[i][1]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=not decode)
        return F.linear(out.transpose(0, 1).reshape(tokens, -1), self.o[i])

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up[i]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down[i])

    def _boundary(self, partial: torch.Tensor, h: torch.Tensor,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """all-reduce + residual add + RMSNorm: (normed, new residual)."""
        if self.handle == NO_CHAIN:
            if self.sync is None:
                return partial, h
            # the sum of the partial's first 64 floats in their place: the meeting comes after
            # the matmul and the graph needs its result (Inductor drops an op whose result
            # only reaches the step times zero)
            (met,) = torch.ops.arfuse.shm_fused_allreduce_functional(
                self.sync, partial[:, :SYNC_FLOATS].float().contiguous(), None, None, EPS, 0.0,
                0, 0.0)
            return torch.cat([met.to(partial.dtype), partial[:, SYNC_FLOATS:]], dim=-1), h
        if self.handle is not None:
            out, residual = torch.ops.arfuse.shm_fused_allreduce_functional(
                self.handle, partial, h, weight, EPS, 0.0, 0, 0.0)
            return out, residual
        dist.all_reduce(partial)
        h = h + partial
        return rms_norm(h, weight), h

    def forward(self, h: torch.Tensor, decode: bool) -> torch.Tensor:
        x = rms_norm(h, self.norms[0])
        for i in range(len(self.qkv)):
            x, h = self._boundary(self._attention(i, x, decode), h, self.norms[2 * i + 1])
            x, h = self._boundary(self._mlp(i, x), h, self.norms[2 * i + 2])
        return x


def _times_us(fn: Any, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return times


def _interleaved_medians(fns: dict[str, Any], steps: int, rounds: int) -> dict[str, float]:
    """Each function's median step, the functions taking turns in ``rounds`` blocks of
    ``steps / rounds`` steps: a machine that drifts moves every variant alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name] += _times_us(fn, max(1, steps // rounds))
    return {name: statistics.median(t) for name, t in times.items()}


def _compiled(variant: str, model: Model, dynamic: bool, capacity: int) -> Any:
    import arfuse

    backend = arfuse.compile_backend(max_token_num=capacity) if variant == "pass" \
        else "inductor"
    return torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=True)


def _timed_compile(fn: Any, *args: Any) -> float:
    """Seconds ``fn``'s first call spent compiling (Dynamo's own ``_compile.compile_inner``
    record: tracing, AOT and Inductor, not the run nor the fused op's creation), with
    Inductor's caches off: a compile, not a hit of what an earlier variant or run left."""
    from torch._dynamo.utils import compilation_time_metrics as metrics
    from torch._inductor import config

    with config.patch(force_disable_caches=True):
        before = sum(metrics.get("_compile.compile_inner", []))
        t0 = time.perf_counter()
        fn(*args)
        wall = time.perf_counter() - t0
    spent = sum(metrics.get("_compile.compile_inner", [])) - before
    return spent if spent > 0 else wall


_PASS_S: list[float] = []  # seconds spent in the fusion pass itself, call by call


def _time_the_pass() -> None:
    """Record each run of arfuse's pass (its share of the pass variant's compile)."""
    from arfuse.compile.graph_pass import FusionPass

    run = FusionPass.__call__

    def timed(self: FusionPass, graph: Any) -> None:
        t0 = time.perf_counter()
        run(self, graph)
        _PASS_S.append(time.perf_counter() - t0)

    FusionPass.__call__ = timed  # type: ignore[method-assign]


def _warm_up(world: int) -> None:
    """One small compile per variant first, so that no timed compile pays the first-use
    costs (the first variant would)."""
    for variant in ("plain", "pass"):
        model = Model(128, 1, world, torch.float32, 8, None)
        with torch.no_grad():
            _timed_compile(_compiled(variant, model, False, 4), torch.randn(1, 128), True)


def one_case(rank: int, world: int, hidden: int, dtype: torch.dtype,
             options: Any) -> dict[str, Any]:
    import arfuse

    capacity = max(options.prefill)
    comm = arfuse.FusedAllReduce(max_token_num=capacity, hidden_dim=hidden, dtype=dtype,
                                 backend="shm", strict=True)
    handle = comm.workspace.handle  # type: ignore[attr-defined]
    meet = arfuse.FusedAllReduce(max_token_num=1, hidden_dim=SYNC_FLOATS, dtype=torch.float32,
                                 backend="shm", strict=True)
    row: dict[str, Any] = {"hidden": hidden, "dtype": str(dtype).split(".")[-1]}
    torch.manual_seed(0)
    weights = Model(hidden, options.layers, world, dtype, options.context, None)
    decode: dict[str, Any] = {}
    prefill: dict[str, Any] = {}
    step = torch.randn(1, hidden).to(dtype)
    with torch.no_grad():
        for variant in VARIANTS:  # the same weights, each variant its own module and graphs
            model = copy.copy(weights)
            model.handle = {"hand": handle, "none": NO_CHAIN, "sync": NO_CHAIN}.get(variant)
            if variant == "sync":
                model.sync = meet.workspace.handle  # type: ignore[attr-defined]
            decode[variant] = _compiled(variant, model, False, capacity)
            passes = len(_PASS_S)
            row[f"compile_s_{variant}"] = _timed_compile(decode[variant], step, True)
            if variant == "pass":
                row["pass_s"] = sum(_PASS_S[passes:])
            for _ in range(options.warmup):
                decode[variant](step, True)
            if variant not in ("none", "sync"):  # their prefill bounds no target
                prefill[variant] = _compiled(variant, model, True, capacity)
        medians = _interleaved_medians(
            {v: (lambda f=f: f(step, True)) for v, f in decode.items()}, options.steps,
            options.rounds)
        ranks: list[Any] = [None] * world
        dist.all_gather_object(ranks, medians)
        row.update({f"decode_us_{v}": us for v, us in medians.items()})
        row.update({f"decode_us_{v}_ranks": [r[v] for r in ranks] for v in medians})
        for tokens in options.prefill:
            x = torch.randn(tokens, hidden).to(dtype)
            for f in prefill.values():
                for _ in range(options.prefill_warmup):
                    f(x, False)
            medians = _interleaved_medians(
                {v: (lambda f=f, x=x: f(x, False)) for v, f in prefill.items()},
                options.prefill_steps, min(options.rounds, options.prefill_steps))
            row.update({f"prefill{tokens}_us_{v}": us for v, us in medians.items()})
    row["decode_bound_vs_plain"] = row["decode_us_plain"] / row["decode_us_none"]
    row["decode_sync_bound_vs_plain"] = row["decode_us_plain"] / row["decode_us_sync"]
    row["decode_speedup_pass_vs_plain"] = row["decode_us_plain"] / row["decode_us_pass"]
    row["decode_pass_vs_hand"] = row["decode_us_pass"] / row["decode_us_hand"]
    for tokens in options.prefill:
        row[f"prefill{tokens}_pass_vs_plain"] = (row[f"prefill{tokens}_us_pass"]
                                                 / row[f"prefill{tokens}_us_plain"])
    # the pass's own seconds, and the whole compile's change (the pass leaves Inductor fewer
    # kernels to generate: the chain becomes one call)
    row["pass_share_of_plain_compile"] = row["pass_s"] / row["compile_s_plain"]
    row["compile_added_by_pass"] = row["compile_s_pass"] / row["compile_s_plain"] - 1
    meet.close()
    comm.close()
    return row


def body(rank: int, world: int, options: Any) -> int:
    from arfuse.bench.machine import machine_record

    torch.set_num_threads(1)
    # every variant's decode and prefill graphs of Model.forward stay compiled side by side
    torch._dynamo.config.cache_size_limit = 64
    init_from_env("cpu")
    pinned = pin_to_core(rank, world)
    _time_the_pass()
    _warm_up(world)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    for dtype in options.dtypes:
        for hidden in options.hidden:
            row = one_case(rank, world, hidden, dtypes[dtype], options)
            rows.append(row)
            if rank == 0:
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in row.items()}), flush=True)
    if rank == 0 and options.out:
        path = Path(options.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"machine": machine_record(pinned, world),
                                    "layers": options.layers, "context": options.context,
                                    "rows": rows}, indent=2))
        print(f"wrote {path}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"),
                        default=["bf16", "fp32"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prefill", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--prefill-steps", type=int, default=20)
    parser.add_argument("--prefill-warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5,
                        help="blocks the variants' steps are timed in, taking turns")
    parser.add_argument("--out", default="")
    parser.add_argument("--short", action="store_true",
                        help="hidden 1024 and 4096, bf16 and fp32, fewer repeats: the "
                             "targets' numbers in about 12 minutes on a 2-core machine")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: does it run")
    options = parser.parse_args()
    if options.short:
        options.hidden, options.steps, options.warmup = [1024, 4096], 50, 10
        options.prefill_steps, options.prefill_warmup = 3, 1
    if options.quick:
        options.hidden, options.dtypes, options.layers = [128], ["fp32"], 1
        options.prefill, options.context, options.steps, options.warmup = [8], 16, 5, 2
        options.prefill_steps, options.prefill_warmup = 2, 1
    return launch(body, 2, options, env={"OMP_NUM_THREADS": "1", "ARFUSE_LOG": "warning"})


if __name__ == "__main__":
    raise SystemExit(main())
