"""Every fused pattern of the shm kernel gives the same bytes at 1, 2, 3 and 7 intra-op threads
(oversubscribed on purpose): norm, FP8 (static and dynamic), NVFP4, the MoE finalize and
reduce, one-shot and two-shot, x as a tensor of its own, in place (out=x,
residual_out=residual) and from the shared slot (input_buffer). The shapes take each way a
call can go (csrc/parallel.h): serial (few bytes), rows split (64 tokens), columns split (one
or three tokens of a wide row, a tail of 16 past the last whole unit included)."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest

from harness import run_ranks, values

THREADS = (1, 2, 3, 7)
FP8_SCALE = 0.0625
NVFP4_SCALE = 448.0 * 6.0 / 8.0


class Shape(NamedTuple):
    dtype: str
    tokens: int
    hidden: int


# serial at 1 token, rows at 64, columns at 1 token (a wide row: 64 KiB and more on one rank,
# so that a two-shot finish of another owner's row also crosses the threshold) and at 3
# tokens (columns at 7 threads, rows at 2 and 3)
SHAPES = (Shape("bf16", 1, 256), Shape("bf16", 64, 256), Shape("fp32", 64, 256),
          Shape("bf16", 1, 32784), Shape("fp32", 1, 16400), Shape("fp32", 3, 8208))
# whole groups of 128 for fp8_group, split by columns (fp8_group's patterns only)
GROUP_SHAPES = (Shape("bf16", 1, 32768), Shape("fp32", 3, 8192))
PATTERNS = ("plain", "plain_fp8", "plain_fp8_dynamic", "norm", "norm_no_residual", "fp8",
            "fp8_dynamic", "nvfp4", "moe_finalize", "moe_reduce", "plain_fp8_group",
            "fp8_group")
FP8_GROUP = {"plain_fp8_group": {"layout": "fp32_column_major", "group_size": 32},
             "fp8_group": {"layout": "ue8m0_packed", "group_size": 128}}
SOURCES = ("own", "in_place", "slot")


def cases() -> list[tuple[Shape, str, str]]:
    out: list[tuple[Shape, str, str]] = []
    for shape in SHAPES + GROUP_SHAPES:
        for pattern in PATTERNS:
            if pattern == "nvfp4" and shape.dtype != "bf16":
                continue
            if (pattern in FP8_GROUP) != (shape in GROUP_SHAPES) and (
                    pattern not in FP8_GROUP or shape.hidden % 128):
                continue  # fp8_group on whole groups; the wide group shapes for it alone
            sources = ("own",) if pattern.startswith("moe") else SOURCES
            out.extend((shape, pattern, source) for source in sources)
    return out


def call(comm: Any, rank: int, shape: Shape, pattern: str, source: str) -> tuple[Any, ...]:
    """One call of the pattern with inputs that depend on the shape, the pattern and the rank
    only (the same for every thread count and source); its outputs' tensors."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[shape.dtype]
    t, h = shape.tokens, shape.hidden
    shared = torch.Generator().manual_seed(7 * t + h)
    own = torch.Generator().manual_seed(1000 + 7 * t + h + rank)
    x = (torch.randn(t, h, generator=own) * (rank + 1)).to(dtype)
    residual = torch.randn(t, h, generator=shared).to(dtype)
    weight = (torch.rand(h, generator=shared) + 0.5).to(dtype)
    norm: dict[str, Any] = {"weight": weight, "eps": 1e-5}
    if pattern != "norm_no_residual":
        norm["residual"] = residual
    if pattern == "moe_finalize":
        index = torch.randint(-1, 12, (t, 4), generator=shared, dtype=torch.int32)
        expanded = torch.randn(12, h, generator=own).to(dtype)
        scales = torch.rand(t, 4, generator=shared)
        extra = torch.randn(t, h, generator=own).to(dtype)
        result = comm.moe_finalize(expanded, index, scales, shared_expert_output=extra,
                                   routed_scaling_factor=2.5, **norm)
    elif pattern == "moe_reduce":
        active = torch.randn(4, t, h, generator=own).to(dtype)
        scales = torch.rand(4, t, generator=shared)
        result = comm.moe_reduce(active, scales, x, **norm)
    else:
        kwargs: dict[str, Any] = {} if pattern.startswith("plain") else dict(norm)
        if pattern in FP8_GROUP:
            kwargs.update(quant="fp8_group", **FP8_GROUP[pattern])
        elif pattern.endswith("fp8"):
            kwargs.update(quant="fp8", scale=FP8_SCALE)
        elif pattern.endswith("fp8_dynamic"):
            kwargs.update(quant="fp8_dynamic")
        elif pattern == "nvfp4":
            kwargs.update(quant="nvfp4", scale=NVFP4_SCALE)
        if source == "slot":
            slot = comm.input_buffer(t)
            slot.copy_(x)
            x = slot
        elif source == "in_place":
            kwargs["out"] = x
            if "residual" in kwargs:
                kwargs["residual_out"] = kwargs["residual"]
        result = comm(x, **kwargs)
    return (result.out, result.residual_out, result.quant_out, result.scale_out)


def patterns_with_threads(rank: int, world: int, threads: int, mode: str,
                          todo: list[tuple[Shape, str, str]]) -> dict[str, str]:
    import torch

    import arfuse
    from arfuse.digest import digest

    torch.set_num_threads(threads)
    comms: dict[tuple[Shape, bool], Any] = {}
    got: dict[str, str] = {}
    for shape, pattern, source in todo:
        key = (shape, pattern.endswith("fp8_dynamic"))
        if key not in comms:
            comms[key] = arfuse.FusedAllReduce(
                max_token_num=max(64, shape.tokens), hidden_dim=shape.hidden,
                dtype=shape.dtype, backend="shm", timeout_s=30,
                quant="fp8_dynamic" if key[1] else None)
            comms[key].workspace.set_mode(mode)
        comm = comms[key]
        got[f"{shape}/{pattern}/{source}"] = digest(*call(comm, rank, shape, pattern, source))
        assert comm.stats()["unfused"] == 0
    for comm in comms.values():
        comm.close()
    assert torch.get_num_threads() == threads
    return got


@pytest.mark.parametrize("mode", ["oneshot", "twoshot"])
def test_every_pattern_same_bytes_at_any_thread_count(mode: str) -> None:
    todo = cases()
    by_threads: dict[int, dict[str, str]] = {}
    for k in THREADS:
        ranks = values(run_ranks(patterns_with_threads, 2, k, mode, todo, timeout=240.0))
        assert ranks[0] == ranks[1], f"ranks differ at {k} threads"
        by_threads[k] = ranks[0]
    for k in THREADS[1:]:
        differ = [c for c, d in by_threads[k].items() if d != by_threads[1][c]]
        assert not differ, f"{k} threads give other bytes than 1 in {differ}"
    # and x as a tensor of its own, in place and in the slot give the same bytes
    for key, d in by_threads[1].items():
        shape, pattern, _ = key.rsplit("/", 2)
        assert d == by_threads[1][f"{shape}/{pattern}/own"], key


def pool_started_flushing(rank: int, world: int) -> bool:
    """The intra-op pool started by a torch op under flush-to-zero / denormals-are-zero (a
    model's ops after torch.set_flush_denormal(True)), then a one-token call whose columns go
    to that pool: its bytes must be the serial path's (the kernel's environment on every
    thread). Whether they are."""
    import torch
    from test_kernel_exact import kernel_on_private_memory

    hidden = 16400
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, hidden, generator=gen) * 2.0**-130  # denormal sums and residual_out
    residual = torch.randn(1, hidden, generator=gen) * 2.0**-131
    weight = torch.rand(hidden, generator=gen) + 0.5
    assert bool((x != 0).all())
    torch.set_num_threads(4)
    torch.set_flush_denormal(True)
    torch.rand(1 << 22).sum()  # a parallel op: the pool's threads start flushing
    kernel, _memory = kernel_on_private_memory(1, hidden, torch.float32)
    comm: Any = kernel

    def call() -> list[torch.Tensor]:
        outs = comm.run(x.clone(), residual.clone(), weight, 1e-6, 0.0, 0, 0.0, None, None)
        return [t.clone() for t in outs if t is not None]

    parallel = call()
    torch.set_num_threads(1)
    serial = call()
    torch.set_flush_denormal(False)
    return all(torch.equal(a.view(torch.int32), b.view(torch.int32))
               for a, b in zip(parallel, serial, strict=True))


def test_pool_threads_compute_in_the_kernels_float_environment() -> None:
    assert values(run_ranks(pool_started_flushing, 1, init=False)) == [True]
