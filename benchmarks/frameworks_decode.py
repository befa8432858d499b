"""The frameworks' own tensor parallelism on 2 ranks, side by side: a random-weight Llama
(fp32, hidden 1024, 4 layers by default) loaded by Hugging Face with ``tp_plan="auto"`` and by
DeepSpeed AutoTP (``deepspeed.init_inference(model, tensor_parallel={"tp_size": 2})``), each
run three ways: the framework's eager path, ``torch.compile`` with Inductor's default backend,
and ``torch.compile(..., backend=arfuse.compile_backend())``. Timed: a one-token forward (the
decode step's matmuls, all-reduces, adds and norms; no KV cache, so every call has the same
shapes), the variants taking turns (``--rounds``), medians per rank; the ratios arfuse /
eager and arfuse / Inductor, the greedy tokens each variant gives (the same for all), what
the pass logged, and the machine (ISA included). JSON out.

    for i in 0 1 2; do python benchmarks/frameworks_decode.py \
        --out benchmarks/results/<machine>/frameworks-decode/run$i.json; done   # ~5 min each
    python benchmarks/frameworks_decode.py --quick      # tiny sizes: does it run

DeepSpeed's ranks get ``LOCAL_SIZE`` = 2 (its shm all-reduce needs it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from compile_decode import _interleaved_medians

from arfuse.launch import init_from_env, launch, pin_to_core


class _Lines(logging.Handler):
    """The pass's count lines, for the record."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("arfuse compile: graph"):
            self.lines.append(message)


def _save(options: Any, folder: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=options.hidden, intermediate_size=options.hidden * 11 // 4,
                         num_hidden_layers=options.layers, num_attention_heads=options.hidden
                         // 128, num_key_value_heads=options.hidden // 128,
                         vocab_size=options.vocab, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def _variants(model: Any) -> dict[str, Any]:
    import arfuse

    torch._dynamo.reset()  # static shapes: a DTensor embedding does not trace dynamic ones
    return {"eager": model, "inductor": torch.compile(model, dynamic=False),
            "arfuse": torch.compile(model, backend=arfuse.compile_backend(), dynamic=False)}


def _run(variants: dict[str, Any], options: Any, lines: _Lines) -> dict[str, Any]:
    """The eager variant's greedy tokens, the tokens each compiled one picks after each of
    their prefixes (one forward of the whole sequence: one graph; equal to the greedy tokens
    exactly when its greedy decoding gives them), then the timed one-token forwards."""
    prompt = torch.randint(0, options.vocab, (1, 8), generator=torch.Generator().manual_seed(1))
    step = prompt[:, -1:]
    row: dict[str, Any] = {}
    with torch.no_grad():
        ids = prompt
        for _ in range(options.tokens):
            nxt = variants["eager"](input_ids=ids, use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        for name, model in variants.items():
            before = len(lines.lines)
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits[0]
            row[f"tokens_{name}"] = logits[prompt.shape[1] - 1:].argmax(-1).tolist()
            for _ in range(options.warmup):
                model(input_ids=step, use_cache=False)
            row[f"log_{name}"] = lines.lines[before:]
        medians = _interleaved_medians(
            {name: (lambda m=m: m(input_ids=step, use_cache=False))
             for name, m in variants.items()}, options.steps, options.rounds)
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, medians)
    for name in variants:
        row[f"step_us_{name}"] = statistics.median(r[name] for r in ranks)
        row[f"step_us_{name}_ranks"] = [r[name] for r in ranks]
    row["arfuse_vs_eager"] = row["step_us_arfuse"] / row["step_us_eager"]
    row["arfuse_vs_inductor"] = row["step_us_arfuse"] / row["step_us_inductor"]
    return row


def hugging_face(rank: int, world: int, path: str, options: Any,
                 lines: _Lines) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    return {"framework": "hf tp_plan=auto", **_run(_variants(model.eval()), options, lines)}


def deepspeed_autotp(rank: int, world: int, path: str, options: Any,
                     lines: _Lines) -> dict[str, Any]:
    import deepspeed
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world},
                                      dtype=torch.float32)
    return {"framework": "deepspeed autotp",
            **_run(_variants(engine.module), options, lines)}


def body(rank: int, world: int, options: Any) -> int:
    from arfuse import log
    from arfuse.bench.machine import machine_record

    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 64
    init_from_env("cpu")
    pinned = pin_to_core(rank, world)
    lines = _Lines()
    log.logger.addHandler(lines)
    log.logger.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory() as folder:
        path = folder if rank == 0 else ""
        if rank == 0:
            _save(options, folder)
        shared = [path]
        dist.broadcast_object_list(shared)
        rows = [run(rank, world, shared[0], options, lines)
                for name, run in (("hf", hugging_face), ("deepspeed", deepspeed_autotp))
                if name in options.frameworks]
        dist.barrier()  # rank 0's folder goes when every rank has loaded from it
    if "deepspeed" in options.frameworks:  # DeepSpeed never unlinks its buffer (69 MB a rank)
        Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_"
             f"{os.environ['MASTER_PORT']}_{rank}").unlink(missing_ok=True)
    if rank == 0:
        for row in rows:
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                              for k, v in row.items() if not k.endswith("_ranks")}),
                  flush=True)
        if options.out:
            out = Path(options.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({
                "machine": {**machine_record(pinned, world),
                            "note": "shared machine: other jobs ran beside these ranks"},
                "model": {"hidden": options.hidden, "layers": options.layers,
                          "vocab": options.vocab, "dtype": "fp32"},
                "steps": options.steps, "rounds": options.rounds, "rows": rows}, indent=2))
            print(f"wrote {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--frameworks", nargs="+", choices=("hf", "deepspeed"),
                        default=["hf", "deepspeed"])
    parser.add_argument("--tokens", type=int, default=4, help="greedy tokens per variant")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10,
                        help="blocks the variants' steps are timed in, taking turns")
    parser.add_argument("--out", default="")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: does it run")
    options = parser.parse_args()
    if options.quick:
        options.hidden, options.layers, options.vocab = 256, 1, 256
        options.tokens, options.steps, options.warmup, options.rounds = 2, 10, 2, 2
    return launch(body, 2, options, env={"OMP_NUM_THREADS": "1", "ARFUSE_LOG": "info",
                                         "LOCAL_SIZE": "2"})


if __name__ == "__main__":
    raise SystemExit(main())
