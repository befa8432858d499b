"""The torch.compile pass (``arfuse.compile``): every all-reduce + add + RMSNorm chain of the
installed transformers' Llama, Qwen2, Qwen3, Mistral and Gemma layers is replaced, 2 ranks
give the whole model's greedy tokens with bit-identical ranks, and what the pass must leave
alone stays as it was. Most jobs stop at Inductor's post-grad graph and run it eagerly
(seconds); one compiles through Inductor's code generation (its C++ build is the slow part)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import arfuse

import ranks_compile
from harness import run_ranks, values

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")

STEPS = 4


def _same_on_every_rank(found: list[dict[str, Any]], *keys: str) -> None:
    for key in keys:
        assert all(f[key] == found[0][key] for f in found), key


def test_every_chain_of_every_architecture_is_fused_and_tokens_match() -> None:
    found = values(run_ranks(ranks_compile.architectures, 2, 1, STEPS, timeout=300))
    for arch in ranks_compile.ARCHS:
        ranks = [f[arch] for f in found]
        mine = ranks[0]
        assert sum(mine["fused"].values()) == mine["reduces"] == 2, (arch, mine)
        assert mine["left"] == {}, (arch, mine)
        assert mine["calls"] == 2 * mine["reduces"], (arch, mine)
        assert mine["again"], (arch, mine)
        assert mine["backends"] == ["shm"], (arch, mine)
        assert mine["tokens"] == mine["reference"], (arch, mine)
        assert len(mine["tokens"]) == STEPS, (arch, mine)
        _same_on_every_rank(ranks, "bits", "tokens", "fused")
    # Gemma 2 norms the sum before the residual add: the fused call without residual
    assert found[0]["gemma2"]["fused"] == {"RMSNorm": 2}
    assert found[0]["llama"]["fused"] == {"residual + RMSNorm": 2}


def test_forms_the_pass_takes_and_leaves() -> None:
    found = values(run_ranks(ranks_compile.forms, 1, timeout=300))[0]
    assert found["llama"]["fused"] == {"residual + RMSNorm": 2}
    assert found["gemma"]["fused"] == {"residual + RMSNorm": 2}
    assert found["rms_norm"]["fused"] == {"residual + RMSNorm": 1}
    assert found["nn.RMSNorm+functional"]["fused"] == {"residual + RMSNorm": 1}
    for name in ("sum used twice", "no weight", "layer_norm"):
        assert found[name]["fused"] == {}, (name, found[name])
        assert sum(found[name]["left"].values()) == 1, (name, found[name])
    # one process: the plan is unfused, and the chain runs as the graph wrote it
    for name, seen in found.items():
        assert seen["equal"], (name, seen)


def test_inductor_dynamic_and_graph_break_give_the_whole_models_tokens() -> None:
    found = values(run_ranks(ranks_compile.inductor, 2, STEPS, timeout=400))
    mine = found[0]
    assert mine["reduces"] == 2
    assert mine["graphs"] >= 2, mine  # the graph break split the model
    assert mine["tokens"] == mine["reference"]
    assert mine["calls"] == STEPS * mine["reduces"]
    assert all(f["bits"] == mine["bits"] for f in found)
    # logged once per graph (an FX graph cache hit logs the count the pass recorded)
    assert all("2 of 2 all-reduces fused" in line or "run on shm" in line
               for line in mine["log"]), mine["log"]


def test_static_fp8_after_the_norm_is_fused_bit_for_bit() -> None:
    found = values(run_ranks(ranks_compile.fp8, 2, timeout=200))
    mine = found[0]
    assert mine["hf"]["fused"] == {"residual + RMSNorm + FP8": 1}, mine
    assert mine["rms_norm bf16"]["fused"] == {"residual + RMSNorm + FP8": 1}, mine
    assert mine["no residual"]["fused"] == {"RMSNorm + FP8": 1}, mine
    # x / scale rounds otherwise than arfuse's x * (1 / scale): the chain without the quant
    assert mine["division"]["fused"] == {"residual + RMSNorm": 1}, mine
    for name, seen in mine.items():
        assert seen["left"] == {} and seen["equal"], (name, seen)
        # two calls; Python runs at most an op's first (negotiation), the kernel the rest
        assert seen["calls"] == 2 and seen["python_calls"] <= 1, (name, seen)
    assert found[1] == mine


def test_ranks_with_differently_sized_graphs_fail_together() -> None:
    found = values(run_ranks(ranks_compile.disagreeing_graphs, 2, timeout=120))
    assert all(f["type"] == "NegotiationError" for f in found), found


def test_capacity_grows_with_the_graphs_and_over_capacity_runs_unfused() -> None:
    found = values(run_ranks(ranks_compile.capacities, 2, timeout=200))[0]
    assert found == {"2/1": {"equal": [True, True], "capacity": 1},
                     "3/None": {"equal": [True, True], "capacity": 3},
                     "9/None": {"equal": [True, True], "capacity": 9}}


def test_an_eps_the_fused_call_refuses_is_left_to_the_graphs_own_norm() -> None:
    found = values(run_ranks(ranks_compile.refused_eps, 2, timeout=300))
    for mine in found:
        for name, seen in mine.items():
            assert seen["error"] == "" and seen["equal"], (name, seen)
        for eps in ("0.0", "-1e-06", "1e-45"):
            # a constant eps: the pass leaves the chain, and says why (with dynamic shapes
            # eps is a graph input: the operator runs the chain unfused when it sees it)
            static = mine[f"{eps}/static"]
            assert static["fused"] == {}, static
            (why,) = static["left"]
            assert why.startswith(f"eps={eps} is not valid"), static
    assert found[0] == found[1]


def test_the_operators_cpu_kernel_runs_every_call_after_the_first_without_python() -> None:
    calls = 5
    found = values(run_ranks(ranks_compile.kernel_route, 2, calls, timeout=200))
    for mine in found:
        assert mine["cpu_kernel"]
        assert mine["equal"] == [True] * (2 * calls), mine
        # each op's first call negotiates in Python; the kernel's route runs the rest
        assert mine["python_calls_0"] == mine["python_calls_1"] == 1, mine
        assert mine["calls_0"] == mine["calls_1"] == calls, mine
        for opened in range(2):  # the op's own count has the route's calls
            stats = mine[f"op_stats_{opened}"]
            assert stats["calls"] == stats["fused"] == calls, mine
        assert "weight" in mine["declined"], mine


def test_entry_points_check_their_arguments() -> None:
    with pytest.raises(ValueError, match="max_token_num=0"):
        arfuse.compile_backend(max_token_num=0)
    with pytest.raises(TypeError, match="max_token_num"):
        arfuse.compile_backend(max_token_num=True)
    backend = arfuse.compile_backend()
    assert callable(backend)


def test_without_a_process_group_the_pass_is_installed_for_the_block_only() -> None:
    """Installed anyway: its graphs' line says there was nothing to fuse."""
    from torch._inductor import config

    import arfuse.compile

    assert not torch.distributed.is_initialized()
    before = config.post_grad_custom_pre_pass
    with arfuse.compile.fusion() as installed:
        assert config.post_grad_custom_pre_pass is installed
        assert installed.then is before
    assert config.post_grad_custom_pre_pass is before


def test_hf_tensor_parallel_plan_is_fused(tmp_path: Any) -> None:
    """``from_pretrained(..., tp_plan="auto")`` runs on CPU over gloo (it needs accelerate):
    its two row-parallel all-reduces per layer and the vocabulary-parallel embedding's."""
    pytest.importorskip("accelerate")
    import tp_models as tm

    tm.tiny_model("llama", 1).save_pretrained(tmp_path)
    found = values(run_ranks(ranks_compile.hf_tp_plan, 2, str(tmp_path), STEPS, timeout=300))
    mine = found[0]
    assert mine["weights"] == "DTensor"
    assert mine["fused"] == {"residual + RMSNorm": 2, "RMSNorm": 1}, mine
    assert mine["left"] == {}
    assert mine["tokens"] == mine["reference"]
    _same_on_every_rank(found, "bits", "tokens")


COMPILE_ONE_CHAIN = """
import logging, os, socket, sys
sys.path.insert(0, {tests!r})
import torch, torch.distributed as dist, torch.nn.functional as F
import tp_models as tm
from arfuse.compile import graph_pass

if {user_config!r}:
    logging.basicConfig(format="mine: %(message)s", level=logging.INFO)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)

def chain(x, r, w):
    y = x * 2
    dist.all_reduce(y)
    h = y + r
    return F.rms_norm(h, (32,), w, 1e-5), h

# one process (the pass leaves a group of one, unless told): the pass, unfused runtime
graph_pass.MIN_RANKS = 1
fusion = graph_pass.FusionPass(str(dist.distributed_c10d._get_default_group().group_name))
compiled = torch.compile(chain, backend=tm.post_grad_backend(fusion), fullgraph=True)
with torch.no_grad():
    compiled(torch.ones(4, 32), torch.ones(4, 32), torch.ones(32))
dist.destroy_process_group()
"""


@pytest.mark.parametrize(("user_config", "env", "line"), [
    (False, {}, "[arfuse INFO] arfuse compile: graph 1: 1 of 1 all-reduces fused"),
    (False, {"ARFUSE_LOG": "warning"}, None),
    (True, {}, "mine: arfuse compile: graph 1: 1 of 1 all-reduces fused"),
])
def test_the_pass_logs_its_count_by_default_on_stderr(
        user_config: bool, env: dict[str, str], line: str | None) -> None:
    """The pass logs before the op its graph makes exists, and only creating an op configured
    the ``arfuse`` logger: the count never showed by default. It shows now as the op's lines
    do (ARFUSE_LOG, default info); an application's own logging config gets it through its
    handler, and no second handler of arfuse's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    script = COMPILE_ONE_CHAIN.format(tests=str(tests), user_config=user_config)
    base = {k: v for k, v in os.environ.items() if k != "ARFUSE_LOG"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, cwd=tests.parent, env={**base, **env})
    assert result.returncode == 0, result.stderr[-3000:]
    counts = [ln for ln in result.stderr.splitlines() if "all-reduces fused" in ln]
    assert counts == ([line + " (1 residual + RMSNorm)"] if line else []), result.stderr[-3000:]


def test_per_token_group_fp8_after_the_norm_is_fused_bit_for_bit() -> None:
    """DeepSeek's act_quant (with vLLM's eps clamp) after the norm: one fused call with
    quant="fp8_group", whose codes and fp32 scales are the chain's own quantisation of the
    fused norm output to the bit (a NaN row too: the operator quantises it as torch does), and
    with bf16 rows every output the unfused graph's; forms that round otherwise stay in the
    graph after the fused chain."""
    found = values(run_ranks(ranks_compile.fp8_group, 2, timeout=300))
    mine = found[0]
    assert mine["act_quant bf16"]["fused"] == {"residual + RMSNorm + FP8 per 128-group": 1}
    assert mine["act_quant 3-d"]["fused"] == {"residual + RMSNorm + FP8 per 64-group": 1}
    assert mine["vllm fp32"]["fused"] == {"residual + RMSNorm + FP8 per 64-group": 1}
    assert mine["no residual"]["fused"] == {"RMSNorm + FP8 per 32-group": 1}
    assert mine["nan row"]["fused"] == {"residual + RMSNorm + FP8 per 128-group": 1}
    assert mine["nan row"]["nan"]
    # a dynamic token count: one graph for every count (both compiles count it)
    assert set(mine["dynamic tokens"]["fused"]) == {"residual + RMSNorm + FP8 per 128-group"}
    for name in ("eps 1e-4", "no eps", "reciprocal"):
        assert mine[name]["fused"] == {"residual + RMSNorm": 1}, (name, mine[name])
    for name, seen in mine.items():
        assert seen["left"] == {} and seen["quantised"], (name, seen)
        # fp32 rows: the fused norm is the graph's only to its sum order (docs/compile.md)
        assert seen["equal"] or name in ("vllm fp32", "no residual"), (name, seen)
    assert found[1] == mine


def _group_quant_graph(quant: Any, dtype: torch.dtype) -> tuple[Any, str]:
    """``find_fp8_group`` on the post-grad graph of ``quant(F.rms_norm(h, w))``."""
    import torch.nn.functional as F

    from arfuse.compile import match

    import tp_models as tm

    found: list[tuple[Any, str]] = []

    def inspect(graph: torch.fx.Graph) -> None:
        h = next(n for n in graph.nodes if n.op == "placeholder" and n.meta["val"].dim() == 2)
        norm = match.find_norm(h)
        assert norm is not None
        found.append(match.find_fp8_group(norm.output))

    def fn(h: torch.Tensor, w: torch.Tensor) -> Any:
        return quant(F.rms_norm(h, (256,), w, 1e-6))

    torch._dynamo.reset()
    torch.compile(fn, backend=tm.post_grad_backend(inspect), fullgraph=True)(
        torch.randn(4, 256, dtype=dtype), torch.ones(256, dtype=dtype))
    return found[0]


def _quant(n: torch.Tensor, eps: float | None = 1e-10, inverse: bool = False,
           scale_by_product: bool = False, clamp_in: torch.dtype | None = None,
           group: int = 128) -> Any:
    grouped = (n if clamp_in is not None else n.float()).reshape(4, 256 // group, group)
    amax = grouped.abs().amax(-1, keepdim=True)
    if clamp_in is not None:
        amax = amax.clamp(min=eps).to(torch.float32)  # clamped in the rows' dtype
    elif eps is not None:
        amax = amax.clamp(min=eps)
    scale = amax * (1 / 448.0) if scale_by_product else amax / 448.0
    quotient = grouped * scale.reciprocal() if inverse else grouped / scale
    return quotient.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).reshape(4, 256), scale


@pytest.mark.parametrize(("form", "dtype", "group", "why"), [
    ({}, torch.bfloat16, 128, ""),
    ({"group": 32}, torch.float32, 32, ""),
    ({"eps": 1e-4}, torch.bfloat16, 0, "eps 0.0001 is not fp8_group's 1e-10"),
    ({"eps": None}, torch.bfloat16, 0, "no eps clamp before the division by 448"),
    ({"inverse": True}, torch.bfloat16, 0, "not divided by the scale"),
    ({"scale_by_product": True}, torch.bfloat16, 0, "a multiplication by 1/448"),
    ({"clamp_in": torch.bfloat16}, torch.bfloat16, 0, "rounded to another dtype"),
])
def test_per_token_group_forms_the_matcher_takes_and_why_it_leaves_the_others(
        form: dict[str, Any], dtype: torch.dtype, group: int, why: str) -> None:
    found, reason = _group_quant_graph(lambda n: _quant(n, **form), dtype)
    assert (found.group_size if found is not None else 0) == group, (found, reason)
    assert why in reason and bool(reason) == bool(why), reason
