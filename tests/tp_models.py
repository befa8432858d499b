"""Tiny HF decoder models with random weights, split for tensor parallelism by hand, and a
torch.compile backend that runs the fusion pass on Inductor's post-grad graph without
generating code (seconds instead of a C++ build per kernel), then runs that graph eagerly.

The split is Megatron's: q/k/v and gate/up by output rows (whole heads per rank), o_proj and
down_proj by input columns, each followed by ``torch.distributed.all_reduce`` of its output.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB = 96
SIZES = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": VOCAB}
FOUR_RANKS = {"num_key_value_heads": 4}
"""``sizes`` for a split over 4 ranks: whole key/value heads on each (one each)."""


def config(arch: str, layers: int, sizes: Mapping[str, int] | None = None) -> Any:
    """``arch``'s config of ``SIZES``, with ``sizes`` in place of any of them."""
    import transformers

    names = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
             "mistral": "MistralConfig", "gemma": "GemmaConfig", "gemma2": "Gemma2Config"}
    extra: dict[str, Any] = {"head_dim": 16} if arch in ("qwen3", "gemma", "gemma2") else {}
    cfg = getattr(transformers, names[arch])(num_hidden_layers=layers,
                                             **{**SIZES, **(sizes or {})}, **extra)
    cfg._attn_implementation = "eager" if arch == "gemma2" else "sdpa"
    return cfg


def tiny_model(arch: str, layers: int = 1, dtype: torch.dtype = torch.float32,
               seed: int = 0, sizes: Mapping[str, int] | None = None) -> nn.Module:
    """The causal LM of ``arch`` with seeded random weights (the same on every rank);
    ``sizes``: see ``config``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(arch, layers, sizes), dtype=dtype)
    with torch.no_grad():  # norms start at exactly 1 (0 for Gemma): make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


class RowParallel(nn.Module):
    """This rank's input columns of a linear layer, then the group's sum of the outputs."""

    def __init__(self, linear: nn.Linear, rank: int, world: int, group: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().chunk(world, 1)[rank].contiguous(),
                                   requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y


def _columns(linear: nn.Linear, rank: int, world: int) -> None:
    linear.weight = nn.Parameter(linear.weight.detach().chunk(world, 0)[rank].contiguous(),
                                 requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach().chunk(world, 0)[rank].contiguous(),
                                   requires_grad=False)


def shard(model: nn.Module, rank: int, world: int, group: Any = None) -> int:
    """Split ``model`` in place for ``rank`` of ``world``; the number of all-reduces a
    forward makes. Whole heads per rank: the config's head counts must divide by ``world``
    (``tiny_model``'s ``sizes`` adapts them)."""
    cfg = model.config
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(cfg, name) % world:
            raise ValueError(f"{name}={getattr(cfg, name)} does not divide by world={world}")
    layers = model.model.layers  # type: ignore[union-attr]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _columns(linear, rank, world)
        attn.o_proj = RowParallel(attn.o_proj, rank, world, group)
        mlp.down_proj = RowParallel(mlp.down_proj, rank, world, group)
    return 2 * len(layers)


def prompt(length: int = 6, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, length), generator=generator)


@torch.no_grad()
def greedy(model: Callable[..., Any], ids: torch.Tensor,
           steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """``steps`` greedy tokens (no cache: each step runs the whole sequence) and the logits
    of each step's last position."""
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    for _ in range(steps):
        last = model(input_ids=ids, use_cache=False).logits[0, -1]
        logits.append(last.clone())
        tokens.append(int(last.argmax()))
        ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, logits


@torch.no_grad()
def teacher_forced(model: Callable[..., Any], ids: torch.Tensor,
                   tokens: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """The token ``model`` picks after ``ids`` and each prefix of ``tokens``, and its logits,
    from one forward of the whole sequence: a causal model's position ``p`` sees the tokens
    up to ``p`` only, so the picks equal ``tokens`` exactly when greedy decoding with
    ``model`` gives ``tokens``, and one static-shape graph serves every step."""
    sequence = torch.cat([ids, torch.tensor([tokens[:-1]], dtype=ids.dtype)], dim=1)
    logits = model(input_ids=sequence, use_cache=False).logits[0, ids.shape[1] - 1:]
    return [int(t) for t in logits.argmax(-1)], [row.clone() for row in logits]


def post_grad_backend(fusion_pass: Any) -> Callable[..., Any]:
    """A torch.compile backend: Inductor up to its post-grad passes, where it runs
    ``fusion_pass`` (as Inductor's ``post_grad_custom_pre_pass`` would see the graph: after
    dead-code elimination), then the graph eagerly instead of generating code."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx

    def inner(gm: torch.fx.GraphModule, example_inputs: Any, **_: Any) -> Any:
        gm.graph.eliminate_dead_code()
        if fusion_pass is not None:
            fusion_pass(gm.graph)
        gm.recompile()
        return make_boxed_func(gm.forward)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs, inner_compile=inner)

    return backend


def rank_0_first(backend: Any, name: str = "compiled") -> Callable[..., Any]:
    """``backend``, run by rank 0 first: every rank compiles the same graphs, so the others
    wait for it and take its compiled code from Inductor's FX graph cache instead of
    generating their own (on a 2-core machine, half the compile time). ``name``: this
    backend's own keys in the store, where one process compiles with several."""
    store = dist.distributed_c10d._get_default_store()
    graphs = [0]

    def compile_after_rank_0(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs[0] += 1  # the same count on every rank, a failed attempt (a restart) included
        key = f"arfuse-test-{name}-{graphs[0]}"
        if dist.get_rank() != 0:
            store.wait([key], datetime.timedelta(seconds=300))
        try:
            return backend(gm, example_inputs)
        finally:
            if dist.get_rank() == 0:
                store.set(key, "1")

    return compile_after_rank_0


def fused_calls() -> int:
    """Calls the compiled graphs' fused ops have made in this process (fused or not)."""
    from arfuse.compile import runtime

    return sum(chains.calls for chains in runtime._chains.values())
