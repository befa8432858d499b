"""Rank bodies for the torch.compile pass: HF models split by hand, compiled with the pass
(through Inductor's own code generation, or up to its post-grad graph and then eagerly), and
small chains written the ways models write them. Module level, so they can be pickled."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tp_models as tm

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2")


def _group_name() -> str:
    return str(dist.distributed_c10d._get_default_group().group_name)


def _fusion_pass(max_token_num: int | None = None) -> Any:
    """The pass for the default group; in one process it fuses too (the plan is unfused)."""
    from arfuse.compile import graph_pass

    graph_pass.MIN_RANKS = 1
    return graph_pass.FusionPass(_group_name(), max_token_num)


def _unfused_and_fused(fn: Any, args: tuple[Any, ...], fusion: Any) -> tuple[Any, Any]:
    """``fn(*args)`` compiled without the pass (what it gives) and ``fn`` compiled with
    ``fusion``, each from a reset dynamo."""
    torch._dynamo.reset()
    want = torch.compile(fn, backend=tm.post_grad_backend(None), fullgraph=True)(*args)
    torch._dynamo.reset()
    return want, torch.compile(fn, backend=tm.post_grad_backend(fusion), fullgraph=True)


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16) \
        .flatten().tolist()


def _reference(arch: str, layers: int, steps: int,
               sizes: dict[str, int] | None = None) -> list[int]:
    """Greedy tokens of the whole model in this one process (no tensor parallelism)."""
    return tm.greedy(tm.tiny_model(arch, layers, sizes=sizes), tm.prompt(), steps)[0]


def _counted_fused() -> int:
    """The calls the compiled graphs' ops counted fused (their ``stats()``)."""
    from arfuse.compile import runtime

    return sum(c.comm.stats()["fused"] for c in runtime._chains.values() if c.comm)


def architectures(rank: int, world: int, layers: int, steps: int,
                  archs: tuple[str, ...] = ARCHS,
                  sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """Each architecture (of ``archs``; ``sizes``: ``tm.tiny_model``'s) split over the ranks,
    compiled (static shapes, one graph) up to the post-grad graph with the pass: what it
    replaced, the fused calls made (and those the ops counted fused), the backends they ran
    on, the greedy tokens it predicts against the whole model's (``tm.teacher_forced``: one
    graph for every step), and the last logits' bits, the same in both calls."""
    from arfuse.compile import runtime

    found: dict[str, Any] = {}
    for arch in archs:
        reference = _reference(arch, layers, steps, sizes)
        model = tm.tiny_model(arch, layers, sizes=sizes)
        reduces = tm.shard(model, rank, world)
        fusion = _fusion_pass()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=tm.post_grad_backend(fusion), fullgraph=True)
        before, counted = tm.fused_calls(), _counted_fused()
        tokens, logits = tm.teacher_forced(compiled, tm.prompt(), reference)
        again = tm.teacher_forced(compiled, tm.prompt(), reference)[1]
        backends = sorted({c.comm.backend if c.comm else "unfused"
                           for c in runtime._chains.values()})
        found[arch] = {"reduces": reduces, "fused": dict(fusion.fused),
                       "left": dict(fusion.left), "calls": tm.fused_calls() - before,
                       "counted_fused": _counted_fused() - counted,
                       "tokens": tokens, "reference": reference, "bits": _bits(logits[-1]),
                       "again": _bits(again[-1]) == _bits(logits[-1]), "backends": backends}
    return found


def forms(rank: int, world: int) -> dict[str, Any]:
    """bf16 Llama and Gemma (the two weight forms), F.rms_norm, nn.RMSNorm, the functional
    all-reduce and chains the pass must leave alone, one process (the unfused runtime)."""
    found: dict[str, Any] = {}
    for arch in ("llama", "gemma"):
        model = tm.tiny_model(arch, 1, torch.bfloat16)
        tm.shard(model, rank, world)
        fusion = _fusion_pass()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=tm.post_grad_backend(fusion), fullgraph=True)
        with torch.no_grad():
            want = model(input_ids=tm.prompt(), use_cache=False).logits
            got = compiled(input_ids=tm.prompt(), use_cache=False).logits
        found[arch] = {"fused": dict(fusion.fused), "left": dict(fusion.left),
                       "equal": bool(torch.equal(want, got))}
    for name, (fn, args) in _chains().items():
        fusion = _fusion_pass()
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=tm.post_grad_backend(fusion), fullgraph=True)
        with torch.no_grad():
            want = fn(*[a.clone() for a in args])
            got = compiled(*[a.clone() for a in args])
        found[name] = {"fused": dict(fusion.fused), "left": dict(fusion.left),
                       "equal": all(torch.equal(a, b) for a, b in zip(want, got, strict=True))}
    return found


def _chains() -> dict[str, tuple[Any, tuple[torch.Tensor, ...]]]:
    """Small functions: name -> (fn(x, residual, weight) -> tensors, inputs)."""
    import torch.distributed._functional_collectives as fc

    hidden = 32
    norm = torch.nn.RMSNorm(hidden, eps=1e-5, dtype=torch.bfloat16)
    bare = torch.nn.RMSNorm(hidden, eps=1e-5, elementwise_affine=False)

    def rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = F.linear(x, w.unsqueeze(0).expand(hidden, hidden).contiguous())
        dist.all_reduce(y)
        h = y + r
        return F.rms_norm(h, (hidden,), w, 1e-5), h

    def module(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = r + fc.all_reduce(x * 2, "sum", dist.group.WORLD)
        return norm(h), h

    def sum_used_twice(x: torch.Tensor, r: torch.Tensor,
                       w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * 2
        dist.all_reduce(y)
        h = y + r
        return F.rms_norm(h, (hidden,), w, 1e-5), h, y

    def no_weight(x: torch.Tensor, r: torch.Tensor,
                  w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x.float() * 2
        dist.all_reduce(y)
        h = y + r.float()
        return bare(h), h

    def layer_norm(x: torch.Tensor, r: torch.Tensor,
                   w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * 2
        dist.all_reduce(y)
        h = y + r
        return F.layer_norm(h, (hidden,), w), h

    generator = torch.Generator().manual_seed(3)
    args = tuple(torch.randn(shape, generator=generator).to(torch.bfloat16)
                 for shape in ((5, hidden), (5, hidden), (hidden,)))
    return {name: (fn, args) for name, fn in (
        ("rms_norm", rms_norm), ("nn.RMSNorm+functional", module),
        ("sum used twice", sum_used_twice), ("no weight", no_weight),
        ("layer_norm", layer_norm))}


def inductor(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Llama split over the ranks through arfuse.compile_backend (Inductor's code
    generation), with dynamic shapes and a graph break (in the rotary embedding, before the
    layers): the fused calls of ``steps`` greedy steps, the tokens, the logits' bits and the
    log. (One graph and fullgraph=True: ``architectures``.)"""
    from torch._inductor import config

    import arfuse

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("arfuse").addHandler(handler)
    logging.getLogger("arfuse").setLevel(logging.INFO)
    model = tm.tiny_model("llama", 1)
    reduces = tm.shard(model, rank, world)
    rotary = model.model.rotary_emb
    forward = rotary.forward

    def broken(*args: Any, **kwargs: Any) -> Any:
        torch._dynamo.graph_break()
        return forward(*args, **kwargs)

    rotary.forward = broken
    # the pass works before code generation: scalar C++ kernels build in half the time
    config.cpp.vec_isa_ok = False
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=tm.rank_0_first(arfuse.compile_backend()),
                             dynamic=True)
    before = tm.fused_calls()
    tokens, logits = tm.greedy(compiled, tm.prompt(), steps)
    return {"reduces": reduces, "reference": _reference("llama", 1, steps), "tokens": tokens,
            "bits": _bits(logits[-1]), "calls": tm.fused_calls() - before,
            "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
            "log": [r for r in records if r.startswith("arfuse compile")]}


def disagreeing_graphs(rank: int, world: int) -> dict[str, str]:
    """Ranks whose graphs were sized differently (max_token_num 8 and 16): the first call."""
    from harness import outcome

    hidden = 32

    def chain(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return F.rms_norm(y + r, (hidden,), w, 1e-6)

    torch._dynamo.reset()
    compiled = torch.compile(chain, backend=tm.post_grad_backend(
        _fusion_pass(8 if rank == 0 else 16)), fullgraph=True)
    x, r, w = torch.ones(4, hidden), torch.ones(4, hidden), torch.ones(hidden)
    with torch.no_grad():
        got = outcome(lambda: compiled(x, r, w))
    return {"type": got["type"], "error": got["error"][:400]}


def _rank_scaled_chain(rank: int, hidden: int, eps: float = 1e-6) -> Any:
    """``(x, residual, weight) -> (normed, new residual)``, each rank's ``x`` scaled by its
    number (ranks contribute differently), the all-reduce as models write it."""

    def chain(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * (rank + 1)
        dist.all_reduce(y)
        h = y + r
        return F.rms_norm(h, (hidden,), w, eps), h

    return chain


class _HandWrittenNorm(torch.nn.Module):
    """RMSNorm as HF's modelling code writes it: ``eps`` an attribute, added as it is (torch's
    own norms round it to float32 first)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        c = h.to(torch.float32)
        c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * c.to(h.dtype)


def refused_eps(rank: int, world: int) -> dict[str, Any]:
    """A chain whose norm's ``eps`` eager torch takes and the fused call refuses (0, negative,
    below float32's smallest), compiled with the pass, statically and with dynamic shapes:
    what the pass replaced and left, whether the compiled chain gives the eager chain's
    outputs, or the error it raised."""
    hidden = 32
    generator = torch.Generator().manual_seed(11)
    x, r = (torch.randn(3, hidden, generator=generator) for _ in range(2))
    w = torch.randn(hidden, generator=generator)
    found: dict[str, Any] = {}
    for eps in (0.0, -1e-6, 1e-45):
        for dynamic in (False, True):
            module = _HandWrittenNorm(w, eps)

            def chain(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, ...]:
                y = x * (rank + 1)
                dist.all_reduce(y)
                h = y + r
                return module(h), h  # noqa: B023

            fusion = _fusion_pass()
            torch._dynamo.reset()
            compiled = torch.compile(chain, backend=tm.post_grad_backend(fusion),
                                     fullgraph=True, dynamic=dynamic)
            error, equal = "", False
            with torch.no_grad():
                want = chain(x, r)
                try:
                    got = compiled(x, r)
                    equal = all(torch.allclose(a, b, atol=1e-5, equal_nan=True)
                                for a, b in zip(want, got, strict=True))
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"[:300]
            found[f"{eps}/{'dynamic' if dynamic else 'static'}"] = {
                "fused": dict(fusion.fused), "left": dict(fusion.left), "equal": equal,
                "error": error}
    return found


def capacities(rank: int, world: int) -> dict[str, Any]:
    """One chain compiled for 2 tokens with max_token_num=1 (over capacity: runs unfused),
    then for 3 tokens and for 9 (the op grows): each against the eager chain, and the
    capacity in use."""
    from arfuse.compile import runtime

    hidden = 32
    chain = _rank_scaled_chain(rank, hidden)
    found: dict[str, Any] = {}
    for tokens, limit in ((2, 1), (3, None), (9, None)):
        generator = torch.Generator().manual_seed(tokens)
        x, r = (torch.randn(tokens, hidden, generator=generator) for _ in range(2))
        w = torch.randn(hidden, generator=generator)
        torch._dynamo.reset()
        compiled = torch.compile(chain, backend=tm.post_grad_backend(_fusion_pass(limit)),
                                 fullgraph=True)
        with torch.no_grad():
            want, got = chain(x, r, w), compiled(x, r, w)
        found[f"{tokens}/{limit}"] = {
            "equal": [bool(torch.allclose(a, b, atol=1e-5)) for a, b in zip(want, got,
                                                                             strict=True)],
            "capacity": max(c.capacity for c in runtime._chains.values())}
    return found


def kernel_route(rank: int, world: int, calls: int) -> dict[str, Any]:
    """A chain on ``[batch, sequence, hidden]`` inputs called ``calls`` times, closed, then
    called again: whether the operator has its CPU kernel, how many calls Python ran (the
    first of each op: negotiation) and how many in all, and each result against the eager
    chain."""
    from arfuse.compile import runtime

    hidden = 32
    chain = _rank_scaled_chain(rank, hidden)
    torch._dynamo.reset()
    compiled = torch.compile(chain, backend=tm.post_grad_backend(_fusion_pass()),
                             fullgraph=True)
    generator = torch.Generator().manual_seed(7)
    w = torch.randn(hidden, generator=generator)
    found: dict[str, Any] = {"equal": []}
    for opened in range(2):
        for _ in range(calls):
            x, r = (torch.randn(2, 3, hidden, generator=generator) for _ in range(2))
            with torch.no_grad():
                want, got = chain(x, r, w), compiled(x, r, w)
            found["equal"].append(all(torch.allclose(a, b, atol=1e-5) and a.shape == b.shape
                                      for a, b in zip(want, got, strict=True)))
        (chains,) = runtime._chains.values()
        found[f"python_calls_{opened}"] = chains.calls - chains.routed
        found[f"calls_{opened}"] = chains.calls
        found[f"op_stats_{opened}"] = chains.comm.stats()  # the route's calls included
        if opened == 0:
            runtime.close_all()  # the next call negotiates a new op, and routes to it
    found["cpu_kernel"] = torch._C._dispatch_has_kernel_for_dispatch_key(
        "arfuse::compiled_fused_allreduce", "CPU")
    # a call the route declines (a weight of another dtype) reaches Python, whose error comes
    # back through the kernel as it is
    x = torch.randn(3, hidden)
    try:
        runtime.register()(x, x, w.double(), 1e-6, 0.0, _group_name(), 3, 0, None)
        found["declined"] = "no error"
    except ValueError as e:
        found["declined"] = str(e)
    return found


def hf_tp_plan(rank: int, world: int, path: str, steps: int) -> dict[str, Any]:
    """HF's own tensor parallelism (``tp_plan="auto"``: DTensor weights, its all-reduces
    traced as Partial -> Replicate) compiled up to the post-grad graph with the pass."""
    import os

    from transformers import AutoModelForCausalLM

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    reference = _reference("llama", 1, steps)
    fusion = _fusion_pass()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=tm.post_grad_backend(fusion), fullgraph=True)
    tokens, logits = tm.teacher_forced(compiled, tm.prompt(), reference)
    return {"fused": dict(fusion.fused), "left": dict(fusion.left), "tokens": tokens,
            "reference": reference, "bits": _bits(logits[-1]),
            "weights": type(model.model.layers[0].self_attn.o_proj.weight).__name__}


def _fp8_chains(rank: int) -> dict[str, tuple[Any, tuple[torch.Tensor, ...]]]:
    """Chains ending in static FP8 quantisation: name -> (fn(x, residual, weight, scale),
    inputs). vLLM's torch form (``* scale.reciprocal()``) after HF's fp32 norm and after
    ``F.rms_norm`` in bf16, without a residual, and the division form the pass leaves."""
    hidden = 32

    def quant(n: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (n.to(torch.float32) * scale.reciprocal()).clamp(-448.0, 448.0) \
            .to(torch.float8_e4m3fn)

    def hf_norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        c = h.to(torch.float32)
        c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * c.to(h.dtype)

    def hf(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
           s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * (rank + 1)
        dist.all_reduce(y)
        h = r + y
        return quant(hf_norm(h, w), s), h

    def rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                 s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * (rank + 1)
        dist.all_reduce(y)
        h = y + r
        n = F.rms_norm(h, (hidden,), w, 1e-5)
        return quant(n, s), n, h

    def no_residual(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                    s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * (rank + 1)
        dist.all_reduce(y)
        return (quant(hf_norm(y, w), s),)

    def division(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                 s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * (rank + 1)
        dist.all_reduce(y)
        h = y + r
        n = hf_norm(h, w)
        return (n.to(torch.float32) / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), h

    generator = torch.Generator().manual_seed(5)
    args = tuple(torch.randn(shape, generator=generator) * 4
                 for shape in ((7, hidden), (7, hidden), (hidden,)))
    scale = torch.tensor([0.02])  # small: some codes saturate at 448
    bf16 = tuple(a.to(torch.bfloat16) for a in args)
    return {name: (fn, (*inputs, scale)) for name, fn, inputs in (
        ("hf", hf, args), ("rms_norm bf16", rms_norm, bf16),
        ("no residual", no_residual, args), ("division", division, args))}


def fp8(rank: int, world: int) -> dict[str, Any]:
    """Each FP8 chain compiled with the pass against the same graph without it (both up to
    the post-grad graph, then eagerly), the fused one called twice (the second call of an op
    takes the kernel's route): what was replaced, whether every output of both calls is the
    same to the bit (the fp8 codes compared as bytes), and the calls Python ran of the two."""
    from arfuse.compile import runtime

    def counts() -> tuple[int, int]:
        chains = runtime._chains.values()
        return sum(c.calls - c.routed for c in chains), sum(c.calls for c in chains)

    found: dict[str, Any] = {}
    for name, (fn, args) in _fp8_chains(rank).items():
        fusion = _fusion_pass()
        with torch.no_grad():
            want, fused = _unfused_and_fused(fn, args, fusion)
            before = counts()
            got = [fused(*args), fused(*args)]
            after = counts()
        found[name] = {"fused": dict(fusion.fused), "left": dict(fusion.left), "equal": all(
            a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for result in got for a, b in zip(want, result, strict=True)),
            "python_calls": after[0] - before[0], "calls": after[1] - before[1]}
    return found


def _group_quant(n: torch.Tensor, group: int, eps: float | None = 1e-10,
                 reciprocal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's ``act_quant`` in torch with vLLM's eps clamp (``eps=None``: DeepSeek's
    original, no clamp; ``reciprocal``: multiplied by the scale's reciprocal)."""
    grouped = n.float().reshape(*n.shape[:-1], n.shape[-1] // group, group)
    amax = grouped.abs().amax(dim=-1, keepdim=True)
    if eps is not None:
        amax = amax.clamp(min=eps)
    scale = amax / 448.0
    quotient = grouped * scale.reciprocal() if reciprocal else grouped / scale
    codes = quotient.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes.reshape(n.shape), scale.squeeze(-1)


def _vllm_group_quant(n: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's torch reference of ``per_token_group_quant_fp8`` (fp32 rows): flat groups,
    ``max(...)[0]``, the eps clamp, the scales viewed ``[T, G]``."""
    flat = n.reshape(n.numel() // group, group)
    amax = flat.abs().max(dim=-1, keepdim=True)[0].clamp(min=1e-10).to(torch.float32)
    scale = amax / 448.0
    codes = (flat / scale).clamp(min=-448.0, max=448.0).to(torch.float8_e4m3fn)
    return codes.reshape(n.shape), scale.reshape(*n.shape[:-1], n.shape[-1] // group)


def _fp8_group_chains(rank: int) -> dict[str, tuple[Any, tuple[torch.Tensor, ...], Any]]:
    """Chains ending in per-token-group FP8: name -> (fn(x, residual, weight) -> (codes,
    scales, out, ...), inputs, the quantisation alone). The act_quant form after
    ``F.rms_norm`` in bf16 (2-D and 3-D), vLLM's after HF's norm in fp32, without a residual,
    with a NaN row, and the forms that round otherwise (left in the graph)."""
    hidden = 256

    def hf_norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        c = h.to(torch.float32)
        c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * c.to(h.dtype)

    def chain(quant: Any, norm: str = "rms_norm", residual: bool = True) -> Any:
        def fn(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
            y = x * (rank + 1)
            dist.all_reduce(y)
            h = y + r if residual else y
            n = F.rms_norm(h, (h.shape[-1],), w, 1e-5) if norm == "rms_norm" else hf_norm(h, w)
            return (*quant(n), n, h)
        return fn

    def act_quant(group: int, **form: Any) -> Any:
        return lambda n: _group_quant(n, group, **form)

    generator = torch.Generator().manual_seed(6)
    args = tuple(torch.randn(shape, generator=generator) * 4
                 for shape in ((7, hidden), (7, hidden), (hidden,)))
    args[0][3, :64] = 0.0  # a group of zeros on rank 0's row before the sum: not all zero
    bf16 = tuple(a.to(torch.bfloat16) for a in args)
    batched = (bf16[0].view(1, 7, hidden), bf16[1].view(1, 7, hidden), bf16[2])
    nan = tuple(a.clone() for a in bf16)
    nan[0][2, 5] = float("nan")  # row 2 of the sum, so of the norm output, is NaN
    vllm = partial(_vllm_group_quant, group=64)
    return {name: (chain(quant, *form), inputs, quant) for name, quant, form, inputs in (
        ("act_quant bf16", act_quant(128), (), bf16),
        ("act_quant 3-d", act_quant(64), (), batched),
        ("vllm fp32", vllm, ("hf",), args),
        ("no residual", act_quant(32), ("hf", False), args),
        ("nan row", act_quant(128), (), nan),
        ("eps 1e-4", act_quant(128, eps=1e-4), (), bf16),
        ("no eps", act_quant(128, eps=None), (), bf16),
        ("reciprocal", act_quant(128, reciprocal=True), (), bf16))}


def fp8_group(rank: int, world: int) -> dict[str, Any]:
    """Each per-token-group chain compiled with the pass against the same graph without it
    (both up to the post-grad graph, then eagerly), the fused one called twice: what was
    replaced, whether every output of both calls is the same to the bit (NaN as values: a
    NaN's payload in ``out`` is the kernel's, docs/design.md 3.6), and whether the codes and
    scales are, to the bit, the chain's own quantisation of the fused call's ``out`` (in fp32
    the norm itself is the graph's only to the rounding of its sum order)."""
    found: dict[str, Any] = {}
    for name, (fn, args, quant) in _fp8_group_chains(rank).items():
        fusion = _fusion_pass()
        with torch.no_grad():
            want, fused = _unfused_and_fused(fn, args, fusion)
            got = [fused(*args), fused(*args)]
            again = [quant(result[2]) for result in got]
        found[name] = {"fused": dict(fusion.fused), "left": dict(fusion.left),
                       "equal": all(_same(a, b) for result in got
                                    for a, b in zip(want, result, strict=True)),
                       "quantised": all(
                           _same(a, b) for result, mine in zip(got, again, strict=True)
                           for a, b in zip(result[:2], mine, strict=True)),
                       "nan": any(bool(t.float().isnan().any()) for t in want)}
    found["dynamic tokens"] = _fp8_group_dynamic(rank)
    return found


def _fp8_group_dynamic(rank: int) -> dict[str, Any]:
    """The act_quant chain with its token dimension dynamic (``mark_dynamic``, as engines
    do): one graph, fused, for 7 and then 4 tokens."""
    fn, args, quant = _fp8_group_chains(rank)["act_quant bf16"]
    fusion = _fusion_pass(7)
    torch._dynamo.reset()
    equal = quantised = True
    with torch.no_grad():
        want_fn = torch.compile(fn, backend=tm.post_grad_backend(None), fullgraph=True)
        fused = torch.compile(fn, backend=tm.post_grad_backend(fusion), fullgraph=True)
        for tokens in (7, 4):
            inputs = (args[0][:tokens], args[1][:tokens], args[2])
            for t in inputs[:2]:
                torch._dynamo.mark_dynamic(t, 0)
            want, got = want_fn(*inputs), fused(*inputs)
            equal &= all(_same(a, b) for a, b in zip(want, got, strict=True))
            quantised &= all(_same(a, b) for a, b in zip(got[:2], quant(got[2]), strict=True))
    return {"fused": dict(fusion.fused), "left": dict(fusion.left), "equal": equal,
            "quantised": quantised, "nan": False}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = a.float().isnan()
    if not torch.equal(nan, b.float().isnan()):
        return False
    bits = torch.uint8 if a.element_size() == 1 else torch.int16 if a.element_size() == 2 \
        else torch.int32
    return torch.equal(a.contiguous().view(bits)[~nan], b.contiguous().view(bits)[~nan])
