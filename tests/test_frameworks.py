"""The compile pass on the frameworks' own tensor parallelism, as their users run it: Hugging
Face's ``tp_plan="auto"`` (Llama, Qwen2 with tied embeddings and q/k/v biases, Mistral) and
DeepSpeed AutoTP (its own all-reduce op, and its fallback on the engine's group), 2 gloo
ranks, tiny random models: the whole model's greedy tokens eager and compiled, every chain
fused with no group named. And the line every compiled graph logs, from Inductor's cache too."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ranks_frameworks
from harness import run_ranks, values

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # tp_plan="auto" needs it
pytestmark = pytest.mark.filterwarnings("ignore")

LAYERS = 2


def _save(arch: str, path: Path, tied: bool = False) -> str:
    import tp_models as tm

    model = tm.tiny_model(arch, LAYERS)
    if tied:  # as Qwen2's small checkpoints: lm_head is the embedding
        model.config.tie_word_embeddings = True
        model.tie_weights()
    model.save_pretrained(path)
    return str(path)


def _same_on_every_rank(found: list[Any], *keys: str) -> None:
    for key in keys:
        assert all(f[key] == found[0][key] for f in found), key


def test_hf_tp_plan_llama_qwen2_mistral_fused_with_no_group_named(tmp_path: Path) -> None:
    """HF's plan: two row-parallel all-reduces per layer, each before a residual add and
    the next norm, and the vocabulary-parallel embedding's before the first norm."""
    paths = {"llama": _save("llama", tmp_path / "llama"),
             "qwen2": _save("qwen2", tmp_path / "qwen2", tied=True),
             "mistral": _save("mistral", tmp_path / "mistral")}
    found = values(run_ranks(ranks_frameworks.hf_plan, 2, paths, timeout=300))
    for name in paths:
        mine = found[0][name]
        assert mine["eager"] == mine["reference"], name
        assert mine["tokens"] == mine["reference"], name
        assert mine["fused"] == {"residual + RMSNorm": 2 * LAYERS, "RMSNorm": 1}, (name, mine)
        assert mine["left"] == {}, (name, mine)
        (ops,) = mine["stats"].values()  # one op, on the default group: every call fused
        assert ops["calls"] == ops["fused"] == 2 * LAYERS + 1, (name, mine)
        _same_on_every_rank([f[name] for f in found], "bits", "tokens")
    assert found[0]["qwen2"]["tied"]


def test_deepspeed_autotp_fused_on_its_op_and_on_its_fallback_group(tmp_path: Path) -> None:
    """``deepspeed.init_inference(model, tensor_parallel={"tp_size": 2})``: a row-parallel
    all-reduce per attention and MLP, each before a residual add and a norm, and the LM
    head's (no norm after it). DeepSpeed's op sums the host's ``LOCAL_SIZE`` ranks: set to
    the world, it is the default group's sum."""
    pytest.importorskip("deepspeed")
    path = _save("llama", tmp_path / "llama")
    with socket.socket() as held:  # DeepSpeed names its shared memory after MASTER_PORT:
        held.bind(("127.0.0.1", 0))  # a port held by this test is no other job's name
        port = held.getsockname()[1]
        env = {"LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        try:
            found = values(run_ranks(ranks_frameworks.deepspeed_autotp, 2, path, env=env,
                                     timeout=400))
        finally:  # DeepSpeed never unlinks its buffers (69 MB a rank)
            for buffer in Path("/dev/shm").glob(
                    f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"):
                buffer.unlink(missing_ok=True)
    mine = found[0]
    chains = {"residual + RMSNorm": 2 * LAYERS}
    head = {"no RMSNorm after it": 1}
    assert mine["eager"] == mine["fallback_eager"] == mine["reference"]
    assert mine["mp_group"] != mine["default_group"]
    op, other_host, fallback, filtered = (mine[k] for k in (
        "op", "op_other_host_size", "fallback", "fallback_default_group"))
    for compiled in (op, other_host, fallback, filtered):
        assert compiled["tokens"] == mine["reference"]
    assert (op["fused"], op["left"]) == (chains, head), op
    assert list(op["stats"]) == [f"group {mine['default_group']}, float32, hidden 64"], op
    assert other_host["fused"] == {}, other_host
    assert other_host["left"] == {"deepspeed.inference_all_reduce: LOCAL_SIZE=3 is not the "
                                  "world's 2 ranks (DeepSpeed's op sums one host's ranks)": 5}
    # the fallback's group is the engine's: fused there with no group named...
    assert (fallback["fused"], fallback["left"]) == (chains, head), fallback
    assert list(fallback["stats"]) == [f"group {mine['mp_group']}, float32, hidden 64"]
    # ...and left when another group (here the default one, the same ranks) is named
    assert filtered["left"] == {f"group {mine['mp_group']} (not the group given)": 5}
    for key in ("op", "fallback"):
        _same_on_every_rank([f[key] for f in found], "bits", "tokens")


CACHED = """
import socket
import torch, torch.distributed as dist, torch.nn.functional as F
import arfuse
from arfuse.compile import graph_pass

graph_pass.MIN_RANKS = 1  # one process: fused (its plan is unfused), no kernel to generate

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

def chain(x, m, r, w):
    y = torch.mm(x, m)
    dist.all_reduce(y)
    h = y + r
    return F.rms_norm(h, (32,), w, 1e-5), h

def plain(x):
    return torch.mm(x, x)

backend = arfuse.compile_backend()
for _ in range(2):  # the second time from Inductor's cache
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(chain, backend=backend)(*(torch.ones(n, 32) for n in (4, 32, 4)),
                                              torch.ones(32))
        torch.compile(plain, backend=backend)(torch.ones(4, 4))
dist.destroy_process_group()
"""


def test_every_compiled_graph_logs_its_count_from_inductors_cache_too(tmp_path: Path) -> None:
    """Two graphs compiled twice on a new Inductor cache: the second time Inductor takes them
    from its FX graph cache, where the pass does not run, and the counts it recorded show."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")},
           "ARFUSE_LOG": "info", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    counts = ["1 of 1 all-reduces fused (1 residual + RMSNorm)", "no all-reduce found"]
    cached = " (from Inductor's cache: the pass did not run)"
    result = subprocess.run([sys.executable, "-c", CACHED], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [ln for ln in result.stderr.splitlines() if "arfuse compile: graph" in ln]
    assert lines == [f"[arfuse INFO] arfuse compile: graph {n}: {count}{tail}"
                     for n, (count, tail) in enumerate(
                         [(c, "") for c in counts] + [(c, cached) for c in counts], 1)], \
        result.stderr[-3000:]
