"""Rank bodies for the frameworks' own tensor parallelism under the compile pass: Hugging
Face's ``tp_plan="auto"`` and DeepSpeed AutoTP (``deepspeed.init_inference``), each on a tiny
random model saved by the test, eager and compiled (up to Inductor's post-grad graph with the
pass, as users get it from ``arfuse.compile_backend()``: no group named). Module level, so
they can be pickled."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import tp_models as tm

STEPS = 3


def _whole(path: str) -> list[int]:
    """Greedy tokens of the saved model in this one process (no tensor parallelism)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tm.greedy(model, tm.prompt(), STEPS)[0]


def _compiled(model: Any, reference: list[int], group: Any = None) -> dict[str, Any]:
    """``model`` compiled with the pass (``group``: its filter): the tokens it picks, what it
    fused and left, and the calls the ops counted (``arfuse.compile.stats()``)."""
    import arfuse.compile

    fusion = arfuse.compile.make_pass(group)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=tm.post_grad_backend(fusion), fullgraph=True)
    tokens, logits = tm.teacher_forced(compiled, tm.prompt(), reference)
    calls = arfuse.compile.stats()
    arfuse.compile.close()
    return {"tokens": tokens, "fused": dict(fusion.fused), "left": dict(fusion.left),
            "stats": calls, "bits": hash(tuple(logits[-1].view(torch.int32).tolist()))}


def hf_plan(rank: int, world: int, paths: dict[str, str]) -> dict[str, Any]:
    """``from_pretrained(path, tp_plan="auto")`` of each model (name -> path): eager and
    compiled tokens."""
    from transformers import AutoModelForCausalLM

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    found: dict[str, Any] = {}
    for name, path in paths.items():
        reference = _whole(path)
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
        found[name] = {"reference": reference,
                       "eager": tm.greedy(model.eval(), tm.prompt(), STEPS)[0],
                       "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                       **_compiled(model, reference)}
    return found


def deepspeed_autotp(rank: int, world: int, path: str) -> dict[str, Any]:
    """``deepspeed.init_inference(model, tensor_parallel={"tp_size": world})`` on this
    process group: eager and compiled tokens on DeepSpeed's own all-reduce op (the shm one:
    ``LOCAL_SIZE`` is the world), then on its fallback, ``torch.distributed.all_reduce`` on
    the engine's model-parallel group (the default group's ranks under another name),
    compiled with no group named and with the default group named."""
    import deepspeed
    from deepspeed import comm as ds_comm
    from transformers import AutoModelForCausalLM

    reference = _whole(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world},
                                      dtype=torch.float32)
    module = engine.module
    found: dict[str, Any] = {"reference": reference,
                             "eager": tm.greedy(module, tm.prompt(), STEPS)[0],
                             "mp_group": str(engine.mp_group.group_name),
                             "default_group": str(dist.group.WORLD.group_name)}
    found["op"] = _compiled(module, reference)
    # the pass reads LOCAL_SIZE when it runs: another host size says DeepSpeed's op sums
    # another set of ranks than the world (its op, set up for this one, still runs here)
    os.environ["LOCAL_SIZE"] = str(world + 1)
    found["op_other_host_size"] = _compiled(module, reference)
    os.environ["LOCAL_SIZE"] = str(world)
    backend = ds_comm.comm.cdb
    backend.shm_vector_kernel_level = 0  # DeepSpeed's fallback: its op is not called
    found["fallback_eager"] = tm.greedy(module, tm.prompt(), STEPS)[0]
    found["fallback"] = _compiled(module, reference)
    found["fallback_default_group"] = _compiled(module, reference, dist.group.WORLD)
    return found
