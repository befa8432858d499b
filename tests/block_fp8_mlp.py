"""A random-weight DeepSeek-style block-FP8 MLP stack, split for tensor parallelism by hand: FP8
(e4m3) weights with one scale per 128x128 block, a GEMM that dequantises in torch, and the
activations quantised per token and group of 128 columns before each GEMM (DeepSeek-V3's
``act_quant``, with vLLM's eps clamp).

Each layer is ``residual + MLP(RMSNorm(residual))``; gate/up are split by output rows (whole
blocks per rank), down by input columns, followed by the all-reduce. The embedding is
vocabulary-parallel (each rank holds half the rows, the all-reduce assembles them), so every
norm follows an all-reduce: the norm and the quantisation of the next GEMM's input are one
arfuse call (``fused``), or the call without quantisation and then ``act_quant`` in eager
torch (``unfused``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from arfuse.bench.baselines import act_quant

BLOCK = 128
GROUP = 128
EPS = 1e-6
VOCAB, HIDDEN, INTERMEDIATE = 96, 256, 512


def weight_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 ``[N, K]`` weight -> e4m3 codes and one fp32 scale per 128x128 block
    (``amax / 448``, DeepSeek-V3's checkpoint format)."""
    n, k = w.shape
    blocks = w.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-10) / 448.0
    codes = (blocks / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes.view(n, k), scale.view(n // BLOCK, k // BLOCK)


def fp8_gemm(codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
             weight_scales: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` activation codes with their group scales times the block-FP8 weight
    ``[N, K]``^T, each dequantised in fp32 by torch; bf16 ``[T, N]``."""
    a = codes.float() * scales.repeat_interleave(GROUP, dim=1)
    w = weight.float() * weight_scales.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return (a @ w.t()).to(torch.bfloat16)


@dataclass
class Layer:
    norm: torch.Tensor                    # [H] bf16
    gate: tuple[torch.Tensor, torch.Tensor]  # this rank's rows of gate_proj: codes, scales
    up: tuple[torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor]  # this rank's columns of down_proj


@dataclass
class Model:
    embed: torch.Tensor  # [VOCAB, H] bf16, rows outside this rank's half zero
    layers: list[Layer]
    final_norm: torch.Tensor
    head: torch.Tensor   # [VOCAB, H] bf16, replicated


def make_model(rank: int, world: int, layers: int, seed: int = 0) -> Model:
    """Seeded random weights (the same on every rank), this rank's part of each."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    embed = rand(VOCAB, HIDDEN).bfloat16()
    mine = torch.zeros_like(embed)
    rows = VOCAB // world
    mine[rank * rows:(rank + 1) * rows] = embed[rank * rows:(rank + 1) * rows]
    built = []
    part = INTERMEDIATE // world
    for _ in range(layers):
        gate, up = rand(INTERMEDIATE, HIDDEN, scale=0.06), rand(INTERMEDIATE, HIDDEN, scale=0.06)
        down = rand(HIDDEN, INTERMEDIATE, scale=0.04)
        built.append(Layer(
            norm=(1 + rand(HIDDEN, scale=0.1)).bfloat16(),
            gate=weight_quant(gate[rank * part:(rank + 1) * part].contiguous()),
            up=weight_quant(up[rank * part:(rank + 1) * part].contiguous()),
            down=weight_quant(down[:, rank * part:(rank + 1) * part].contiguous())))
    return Model(mine, built, (1 + rand(HIDDEN, scale=0.1)).bfloat16(),
                 rand(VOCAB, HIDDEN, scale=0.05).bfloat16())


def forward(model: Model, comm: Any, ids: torch.Tensor, fused: bool) -> torch.Tensor:
    """Logits ``[T, VOCAB]`` (fp32) of token ids ``[T]``: each norm with the all-reduce before
    it in one arfuse call, the quantisation of the next GEMM's input fused or in eager torch."""
    x = F.embedding(ids, model.embed)  # this rank's part: the all-reduce assembles it
    residual = torch.zeros_like(x)
    for layer in model.layers:
        if fused:
            result = comm(x, residual=residual, weight=layer.norm, eps=EPS, quant="fp8_group",
                          group_size=GROUP)
            codes, scales = result.quant_out, result.scale_out
        else:
            result = comm(x, residual=residual, weight=layer.norm, eps=EPS)
            codes, scales = act_quant(result.out)
        residual = result.residual_out
        gate = fp8_gemm(codes, scales, *layer.gate)
        up = fp8_gemm(codes, scales, *layer.up)
        x = fp8_gemm(*act_quant(F.silu(gate) * up), *layer.down)  # this rank's partial sum
    last = comm(x, residual=residual, weight=model.final_norm, eps=EPS).out
    return last.float() @ model.head.float().t()


@torch.no_grad()
def greedy(model: Model, comm: Any, prompt: list[int], steps: int,
           fused: bool) -> tuple[list[int], torch.Tensor]:
    """``steps`` greedy tokens (each step runs the whole sequence) and the last step's
    logits."""
    ids = list(prompt)
    logits = torch.empty(0)
    for _ in range(steps):
        logits = forward(model, comm, torch.tensor(ids), fused)
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):], logits
