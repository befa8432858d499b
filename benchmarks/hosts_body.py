"""One rank of benchmarks/hosts.py (under torchrun on each namespace host): the user's two
lines (the baseline), the hier backend, the torch backend and gloo all_reduce alone, side by
side, median seconds per call; or
(``decode``) one decode step of tests/tp_models.py's Llama split over every rank, compiled with
arfuse's pass, on hier and on the torch backend."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import arfuse
from arfuse import collective
from arfuse.collective import PieceChoice

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _times(fn: Any, repeats: int) -> list[float]:
    for _ in range(3):
        fn()
    dist.barrier()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def _user_lines(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What users write without arfuse: torch's all-reduce on the group, the residual added in
    place, torch's RMSNorm."""
    dist.all_reduce(x)
    residual.add_(x)
    return torch.nn.functional.rms_norm(residual, (x.shape[-1],), weight, 1e-6)


def main(out: str, tokens: list[int], dtypes: list[str], repeats: int, rounds: int) -> None:
    """Per dtype and token count, the user's two lines (the baseline), hier, the torch backend
    and gloo's all_reduce alone, each in place on inputs restored before every call (the
    restore is timed in every row alike), timed in ``rounds`` blocks of ``repeats`` calls,
    taking turns (the machine's drift falls on all); per row the median of every call of the
    slowest rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, hidden = dist.get_rank(), 4096
    rows: list[dict[str, Any]] = []
    for name in dtypes:
        dtype = DTYPES[name]
        ops = {b: arfuse.FusedAllReduce(max_token_num=max(tokens), hidden_dim=hidden,
                                        dtype=dtype, backend=b, timeout_s=120)
               for b in ("hier", "torch")}
        assert ops["hier"].backend == "hier", ops["hier"].plan.explain()
        weight = torch.ones(hidden, dtype=dtype)
        for t in tokens:
            source = torch.randn(t, hidden).to(dtype)
            source_residual = torch.randn(t, hidden).to(dtype)
            x, residual = source.clone(), source_residual.clone()

            def restore(x: torch.Tensor = x, residual: torch.Tensor = residual,
                        s: torch.Tensor = source, r: torch.Tensor = source_residual) -> None:
                x.copy_(s)
                residual.copy_(r)

            calls: dict[str, Any] = {"user": lambda x=x, r=residual, w=weight: (
                restore(), _user_lines(x, r, w))}
            for b, op in ops.items():
                calls[b] = lambda op=op, x=x, r=residual, w=weight: (
                    restore(), op(x, residual=r, weight=w, out=x, residual_out=r))
            calls["gloo_all_reduce"] = lambda x=x: (restore(), dist.all_reduce(x))
            times: dict[str, list[float]] = {b: [] for b in calls}
            names = list(calls)
            # an op's first calls of a size learn how its rows cross (PieceChoice), half of
            # them the slower way; a decode makes them once: every row makes as many first
            learnt = {b: set(op.workspace.pieces.chosen())  # type: ignore[attr-defined]
                      for b, op in ops.items()}
            for b in names:
                for _ in range(2 * PieceChoice.RUN):
                    calls[b]()
            # what a hier call sends (it sends only between hosts)
            before = collective.TRAFFIC.bytes_sent
            calls["hier"]()
            hier_sent = collective.TRAFFIC.bytes_sent - before
            for turn in range(rounds):
                # each round starts one row later: no row always follows the same one (a row
                # right after the user's all_reduce met its aftermath in every round)
                for b in names[turn % len(names):] + names[:turn % len(names)]:
                    times[b] += _times(calls[b], repeats)
            medians = {b: statistics.median(v) for b, v in times.items()}
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, {**medians, "hier_sent": hier_sent})
            row: dict[str, Any] = {"dtype": name, "tokens": t}
            row.update({b: max(m[b] for m in every) for b in calls})
            row.update({f"{b}_over_user": row[b] / row["user"] for b in ("hier", "torch")})
            elem, world = x.element_size(), dist.get_world_size()
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "2"))
            # bytes over the link per call, each direction (docs/design.md 4, hier, torch)
            row["link_bytes_torch"] = 2 * (world - 1) * t * hidden * elem // world
            # hier's, measured: what the first host's ranks sent in a call
            row["link_bytes_hier"] = sum(m["hier_sent"] for m in every[:local])
            # how each op's rows crossed once learnt (collective.PieceChoice: the size class
            # this row's calls learnt; none learnt, whole)
            row["ways"] = {}
            for b, op in ops.items():
                chosen = op.workspace.pieces.chosen()  # type: ignore[attr-defined]
                new = [way for size_class, way in chosen.items() if size_class not in learnt[b]]
                row["ways"][b] = "pieces" if PieceChoice.PIECES in new else "whole"
            rows.append(row)
        for op in ops.values():
            op.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


def _decode_sizes(hidden: int, world: int) -> dict[str, int]:
    """tp_models' sizes (``SIZES``) grown to ``hidden``: heads of 64 (at least one per rank,
    as many key/value heads, whole heads on each rank) and an MLP 1.5 times as wide."""
    heads = max(world, hidden // 64)
    if hidden % heads or heads % world or hidden * 3 // 2 % world:
        raise ValueError(f"hidden={hidden} does not split into whole heads over {world} ranks")
    return {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
            "intermediate_size": hidden * 3 // 2}


def _decode_case(hidden: int, dtype: torch.dtype, options: dict[str, int]) -> dict[str, Any]:
    """One hidden size: per backend, the model split over the ranks with its own static KV
    cache (the prompt's ``context`` tokens filled in eagerly, room for every step after),
    its one-token step compiled (Inductor with arfuse's pass, static shapes: a static cache
    attends over its whole length, masked, so every step costs the same); then the steps of
    both timed taking turns."""
    from compile_decode import _interleaved_medians
    from transformers import StaticCache

    from arfuse.compile import runtime

    import tp_models as tm

    rank, world = dist.get_rank(), dist.get_world_size()
    context, sizes = options["context"], _decode_sizes(hidden, world)
    length = context + 1 + options["warmup"] + options["steps"]
    sizes["max_position_embeddings"] = length
    ids = torch.arange(context).remainder(tm.VOCAB).unsqueeze(0)
    token = torch.tensor([[int(ids[0, -1])]])
    steps: dict[str, Any] = {}
    row: dict[str, Any] = {"hidden": hidden, "dtype": str(dtype).split(".")[-1]}
    for backend in ("hier", "torch"):
        model = tm.tiny_model("llama", options["layers"], dtype, sizes=sizes)
        tm.shard(model, rank, world)
        cache = StaticCache(config=model.config, max_cache_len=length)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
        # the torch backend in a compiled graph: the pass leaves the chain as the model wrote
        # it (gloo all-reduce, add, RMSNorm); set while the step compiles, which makes the pass
        if backend == "torch":
            os.environ["ARFUSE_BACKEND"] = "torch"
        compiled = torch.compile(model, fullgraph=True, backend=tm.rank_0_first(
            arfuse.compile_backend(), f"decode-{hidden}-{row['dtype']}-{backend}"))

        def step(compiled: Any = compiled, cache: Any = cache) -> torch.Tensor:
            with torch.no_grad():
                return compiled(input_ids=token, past_key_values=cache).logits[0, -1]

        try:
            started, calls = time.perf_counter(), tm.fused_calls()
            row[f"token_{backend}"] = int(step().argmax())
            row[f"first_step_s_{backend}"] = time.perf_counter() - started
        finally:
            os.environ.pop("ARFUSE_BACKEND", None)
        # every chain through arfuse's op on hier, none on torch
        fused = 2 * options["layers"] if backend == "hier" else 0
        assert tm.fused_calls() - calls == fused, (backend, tm.fused_calls() - calls)
        ran = {c.comm.backend if c.comm else "unfused" for c in runtime._chains.values()}
        assert ran == {"hier"}, ran
        steps[backend] = step
    with torch.no_grad():
        for fn in steps.values():
            for _ in range(options["warmup"]):
                fn()
        medians = _interleaved_medians(steps, options["steps"], options["rounds"])
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, medians)
    for backend, us in medians.items():
        row[f"decode_us_{backend}"] = us
        row[f"decode_us_{backend}_ranks"] = [r[backend] for r in ranks]
    row["torch_over_hier"] = row["decode_us_torch"] / row["decode_us_hier"]
    runtime.close_all()
    return row


def decode(out: str, hidden: list[int], dtypes: list[str], options: dict[str, int]) -> None:
    """The decode steps (see ``_decode_case``) of every hidden size and dtype; rank 0 writes
    them with the machine and the options to ``out`` (JSON)."""
    from arfuse.bench.machine import machine_record

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    # the op is created at the first step, while other ranks may still compile theirs
    os.environ["ARFUSE_TIMEOUT_S"] = "600"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rows = [_decode_case(h, DTYPES[d], options) for d in dtypes for h in hidden]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"machine": machine_record(False, dist.get_world_size()),
                       "options": options, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "decode":
        decode(sys.argv[2], [int(h) for h in sys.argv[3].split(",")], sys.argv[4].split(","),
               json.loads(sys.argv[5]))
    else:
        main(sys.argv[1], [int(t) for t in sys.argv[2].split(",")], sys.argv[3].split(","),
             int(sys.argv[4]), int(sys.argv[5]))
