"""A tensor-parallel HF Llama (random weights from a small config) compiled with arfuse's
fusion pass: every all-reduce + residual add + RMSNorm becomes one arfuse call.

    torchrun --standalone --nproc-per-node 2 examples/compile_llama_tp.py [--dtype bf16]

Each rank keeps its heads and its part of the MLP (q/k/v and gate/up split by rows, o_proj
and down_proj by columns, each followed by ``torch.distributed.all_reduce``), compiles the
model with ``backend=arfuse.compile_backend()`` and with plain Inductor, and checks that both
give the whole model's greedy tokens (fp32), with the same bytes on every rank.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import arfuse


class RowParallel(nn.Module):
    """This rank's input columns of a linear layer, then the sum over the ranks."""

    def __init__(self, linear: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().chunk(world, 1)[rank].contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y


def shard(model: nn.Module, rank: int, world: int) -> None:
    for layer in model.model.layers:  # type: ignore[union-attr]
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            linear.weight = nn.Parameter(linear.weight.detach().chunk(world, 0)[rank].contiguous())
        attn.o_proj = RowParallel(attn.o_proj, rank, world)
        mlp.down_proj = RowParallel(mlp.down_proj, rank, world)


def build(dtype: torch.dtype) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


@torch.no_grad()
def greedy(model: nn.Module, ids: torch.Tensor, steps: int) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        token = int(model(input_ids=ids, use_cache=False).logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.getLogger("arfuse").setLevel(logging.INFO)  # what the pass fused, once per graph
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    whole = greedy(build(dtype), ids, args.steps)
    model = build(dtype)
    shard(model, rank, world)
    fused = torch.compile(model, backend=arfuse.compile_backend(), dynamic=True)
    with_pass = greedy(fused, ids, args.steps)
    torch._dynamo.reset()
    without_pass = greedy(torch.compile(model, dynamic=True), ids, args.steps)
    every = [None] * world
    dist.all_gather_object(every, with_pass)
    if rank == 0:
        print(f"whole model:       {whole}")
        print(f"with the pass:     {with_pass}")
        print(f"without the pass:  {without_pass}")
        print("ranks agree:", all(tokens == with_pass for tokens in every))
        if dtype == torch.float32 and not with_pass == without_pass == whole:
            raise SystemExit("the tokens differ")
    arfuse.compile.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
