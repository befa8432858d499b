"""The MoE patterns on FlashInfer's ``trtllm`` (patterns 6 and 7), driven through the stand-in of
``test_flashinfer_backend`` whose kernels read their arguments as FlashInfer's do (this machine
has no GPU: not a hardware test; ``tests/contract/flashinfer_contract.py`` checks the real
packages). What arfuse passes, what it runs apart and why (``moe_rules``), and what ``explain``
says of it."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from test_flashinfer_backend import (
    BACKENDS,
    FakeFlashInfer,
    Wire,
    context,
    group_contexts,
    on_ranks,
)

from arfuse import catalog, moe, policy
from arfuse.arg_checks import OpShape
from arfuse.backends.flashinfer import moe_rules, sizes
from arfuse.call_checks import CallArgs
from arfuse.ops import run_on
from arfuse.pattern import ALL, Pattern, quant_output
from arfuse.quant import quantize
from arfuse.settings import Settings
from arfuse.spec import Spec
from arfuse.topology import Topology

HIDDEN = 64
TOPOLOGY = Topology(device="cuda", world_size=2, sm=100, multicast=True, nvlink_all_pairs=True,
                    flashinfer="0.7.2.post1")


def finalize_step(dtype: torch.dtype = torch.bfloat16, tokens: int = 3, top_k: int = 4,
                  rows: int = 10, routed: float = 1.0, scales: torch.dtype | None = None,
                  seed: int = 0) -> moe.ExpertStep:
    g = torch.Generator().manual_seed(seed)
    shape = OpShape(HIDDEN, dtype, {torch.bfloat16: "bf16", torch.float16: "fp16",
                                    torch.float32: "fp32"}[dtype], torch.device("cpu"))
    index = torch.randint(-1, max(rows, 1), (tokens, top_k), generator=g, dtype=torch.int32)
    if rows == 0:
        index.fill_(-1)
    return moe.check_finalize(
        shape, torch.randn(rows, HIDDEN, generator=g).to(dtype), index,
        torch.rand(tokens, top_k, generator=g).to(scales or dtype),
        torch.randn(tokens, HIDDEN, generator=g).to(dtype), routed)


def reduce_step(dtype: torch.dtype = torch.bfloat16, tokens: int = 3, experts: int = 5,
                seed: int = 1) -> moe.ExpertStep:
    g = torch.Generator().manual_seed(seed)
    shape = OpShape(HIDDEN, dtype, "bf16" if dtype == torch.bfloat16 else "fp16",
                    torch.device("cpu"))
    return moe.check_reduce(shape, torch.randn(experts, tokens, HIDDEN, generator=g).to(dtype),
                            torch.rand(experts, tokens, generator=g).to(dtype),
                            torch.randn(tokens, HIDDEN, generator=g).to(dtype))


def moe_call(step: moe.ExpertStep, residual: bool = True, seed: int = 2) -> CallArgs:
    dtype = step.rows.dtype
    g = torch.Generator().manual_seed(seed)
    res = torch.randn(step.tokens, HIDDEN, generator=g).to(dtype) if residual else None
    return CallArgs(torch.empty(step.tokens, HIDDEN, dtype=dtype), res,
                    torch.ones(HIDDEN, dtype=dtype), 1e-6, 0.0, moe=step)


def trtllm(max_tokens: int = 8, dtype: str = "bf16", ctx: Any = None) -> Any:
    ws = BACKENDS["trtllm"]().create(ctx or context(),
                                     Spec(max_tokens=max_tokens, hidden=HIDDEN, dtype=dtype))
    assert ws is not None
    return ws


def takes(ws: Any) -> Any:
    return lambda pattern: ws.takes(TOPOLOGY, pattern)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFlashInfer:
    f = FakeFlashInfer()
    f.install(monkeypatch)
    return f


# --- what the kernel receives ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["finalize", "reduce"])
def test_two_ranks_sum_the_rows_the_kernel_makes(monkeypatch: pytest.MonkeyPatch,
                                                 kind: str) -> None:
    """Each rank's call is one ``allreduce_fusion`` of pattern 7 (6): the expert rows and the
    index as the kernel reads them, and what comes back is the sum over both ranks plus the
    residual, within bf16 rounding of the torch reference (the kernel rounds every step to
    bf16, the reference to fp32)."""
    fake = FakeFlashInfer(wire=Wire(2))
    fake.install(monkeypatch)
    steps = [finalize_step(seed=r) if kind == "finalize" else reduce_step(seed=r)
             for r in range(2)]
    calls = [moe_call(step) for step in steps]
    calls[1] = CallArgs(calls[1].x, calls[0].residual, calls[0].weight, 1e-6, 0.0,
                        moe=steps[1])  # one residual, as in tensor parallelism

    def rank(ctx: Any) -> Any:
        ws = trtllm(ctx=ctx)
        assert not ws.moe_refusal(calls[ctx.rank])
        return run_on(ws, calls[ctx.rank], takes(ws))

    results = on_ranks(group_contexts(2), rank)
    kernel_calls = [c for c in fake.calls if c["pattern"] in (6, 7)]
    assert len(kernel_calls) == len(fake.calls) == 2
    for call, step in zip(sorted(kernel_calls, key=lambda c: c["workspace"].rank), steps,
                          strict=True):
        if kind == "finalize":
            assert call["pattern"] == moe_rules.K_MOE_FINALIZE and call["input"] is step.rows
            assert call["expanded_idx_to_permuted_idx"] is step.index
            assert call["expanded_idx_to_permuted_idx"].shape == (3, 4)  # [T, top_k], not flat
            assert call["expert_scale_factor"] is step.scales
            assert call["shared_expert_output"] is step.add
        else:
            assert call["pattern"] == moe_rules.K_MOE_REDUCTION
            assert call["moe_reduction_device_num_experts"] == 5
            assert call["moe_reduction_scale_input"].dtype == torch.float32
            assert torch.equal(call["moe_reduction_scale_input"], step.scales.float())
            assert call["moe_reduction_active_experts_token_input"] is step.rows
            assert call["moe_reduction_token_input"] is step.add
        assert "use_oneshot" not in call and "fp32_acc" not in call
    reference = sum(moe.local_rows(s, torch.empty(3, HIDDEN)).float() for s in steps)
    want = reference + calls[0].residual.float()  # type: ignore[union-attr]
    for result in results:
        torch.testing.assert_close(result.residual_out.float(), want, rtol=0.05, atol=0.1)
    assert torch.equal(results[0].residual_out, results[1].residual_out)


def test_a_call_without_residual_gets_zeros(fake: FakeFlashInfer) -> None:
    ws = trtllm()
    call = moe_call(finalize_step(), residual=False)
    run_on(ws, call, takes(ws))
    assert torch.equal(fake.calls[-1]["residual_in"], torch.zeros(3, HIDDEN, dtype=torch.bfloat16))


def test_a_bad_index_never_reaches_the_kernel(fake: FakeFlashInfer) -> None:
    """The kernel reads any index it is given: arfuse checks them first and refuses the call
    (``RefusedStep``: the op then meets its peers with a refused signature)."""
    step = finalize_step()
    step.index[1, 2] = 10  # expanded has rows 0..9
    ws = trtllm()
    before = len(fake.calls)
    with pytest.raises(moe.RefusedStep, match=r"expanded_idx_to_permuted_idx\[1, 2\] = 10"):
        run_on(ws, moe_call(step), takes(ws))
    assert len(fake.calls) == before


def test_quantisation_follows_the_kernel_as_a_step_of_its_own(fake: FakeFlashInfer) -> None:
    ws = trtllm()
    base = moe_call(finalize_step())
    call = CallArgs(base.x, base.residual, base.weight, 1e-6, 0.0, "fp8", 0.5, moe=base.moe)
    assert not ws.takes(TOPOLOGY, call.pattern)
    assert ws.takes(TOPOLOGY, call.pattern.without_quant())
    got = run_on(ws, call, takes(ws))
    assert fake.calls[-1]["pattern"] == 7 and fake.calls[-1].get("quant_out") is None
    want = quantize(got.out, quant_output("fp8"), 0.5)[0]
    assert got.quant_out is not None
    assert torch.equal(got.quant_out.view(torch.uint8), want.view(torch.uint8))


# --- what runs apart, and why ------------------------------------------------------------------


@pytest.mark.parametrize(("change", "why"), [
    ({"routed": 2.5}, moe_rules.ROUTED),
    ({"scales": torch.float32}, moe_rules.SCALES),
    ({"tokens": 0}, moe_rules.TOKENS),
    ({"tokens": 129}, moe_rules.TOKENS),
    ({"rows": 0}, moe_rules.NO_ROWS),
])
def test_calls_the_kernel_cannot_honour_run_their_expert_step_apart(
        fake: FakeFlashInfer, caplog: pytest.LogCaptureFixture, change: dict[str, Any],
        why: str) -> None:
    """The torch reference computes the rows, then the plain fused pattern (1) sums them: the
    same bytes as the reference, never the kernel with an argument it would drop or misread.
    The reason is logged once per workspace."""
    ws = trtllm(max_tokens=256)
    call = moe_call(finalize_step(**change))
    assert ws.takes(TOPOLOGY, call.pattern) and ws.moe_refusal(call) == why
    with caplog.at_level(logging.INFO, logger="arfuse"):
        got = run_on(ws, call, takes(ws))
        run_on(ws, moe_call(finalize_step(**change)), takes(ws))
    assert [c["pattern"] for c in fake.calls[-2:]] == [1, 1]
    assert sum(why in r.getMessage() for r in caplog.records) == 1
    assert call.moe is not None and call.residual is not None
    rows = moe.local_rows(call.moe, torch.empty_like(call.x))
    assert torch.equal(got.residual_out, rows + call.residual)


def test_mnnvl_runs_every_moe_call_apart(fake: FakeFlashInfer) -> None:
    """The op never hands mnnvl a MoE call (it takes no MoE pattern); its run would still run
    the step apart, with the same bytes as the op's own step."""
    ws = BACKENDS["mnnvl"]().create(context(), Spec(max_tokens=8, hidden=HIDDEN))
    assert ws is not None
    call = moe_call(finalize_step())
    assert ws.moe_refusal(call) == moe_rules.TRTLLM_ONLY
    direct = ws.run(call)
    again = moe_call(finalize_step())
    via_op = run_on(ws, again, takes(ws))
    assert [c["pattern"] for c in fake.calls] == [1, 1]
    assert torch.equal(direct.residual_out, via_op.residual_out)


def test_patterns_trtllm_does_not_take_whole() -> None:
    """bf16/fp16 with RMSNorm only; a quantised one runs its quantisation after; fp32, a hidden
    size the kernels cannot launch and mnnvl take none."""
    moe_patterns = [p for p in ALL if p.moe]
    trt, mnnvl = catalog.get("trtllm"), catalog.get("mnnvl")
    taken = {p.name for p in moe_patterns if trt.fuses(TOPOLOGY, Spec(8, HIDDEN), p)}
    assert taken == {"moe_reduce+rmsnorm", "moe_reduce+residual_rmsnorm",
                     "moe_finalize+rmsnorm", "moe_finalize+residual_rmsnorm"}
    for spec in (Spec(8, HIDDEN, "fp32"), Spec(8, 8200, "bf16")):
        assert not any(trt.fuses(TOPOLOGY, spec, p) for p in moe_patterns)
    assert not any(mnnvl.fuses(TOPOLOGY, Spec(8, HIDDEN), p) for p in moe_patterns)
    quantised = Pattern("residual_rmsnorm", "fp8", reduction="moe_finalize")
    assert moe_rules.pattern_refusal(Spec(8, HIDDEN), quantised) == moe_rules.QUANT_APART


def test_the_kernels_launch_geometry() -> None:
    """trtllm_moe_allreduce_fusion.cuh's launchers: threads per block for one token."""
    assert moe_rules.block_threads(4096, 2) == 64     # 16 warps, a cluster of 8
    assert moe_rules.block_threads(7168, 2) == 224    # 28 warps, a cluster of 4
    assert moe_rules.block_threads(8192, 2) == 128
    assert moe_rules.block_threads(8200, 2) == 1056   # 33 warps: one block, over 1024


def test_one_shot_bytes_as_each_version_counts_them() -> None:
    """0.6.13's finalize wrapper counts the expanded rows (it raises past MAX_COMM_SIZE although
    the tokens fit); 0.7.2 counts the tokens; the kernel writes world*tokens*hidden*elem."""
    spec = Spec(max_tokens=128, hidden=7168, dtype="bf16")
    rows = sizes.MAX_COMM_SIZE // (8 * 7168 * 2) + 1
    old, new = sizes.version_tuple("0.6.13"), sizes.version_tuple("0.7.2.post1")
    assert moe_rules.call_refusal(old, 8, spec, True, 4, rows, 1.0, True) == moe_rules.ONESHOT
    assert moe_rules.call_refusal(new, 8, spec, True, 4, rows, 1.0, True) == ""
    assert moe_rules.call_refusal(old, 8, spec, False, 4, rows, 1.0, True) == ""
    small = Spec(max_tokens=4, hidden=7168, dtype="bf16")
    assert moe_rules.call_refusal(new, 8, small, True, 5, 40, 1.0, True) == moe_rules.ONESHOT


# --- what explain says -------------------------------------------------------------------------


def test_explain_names_the_moe_patterns_and_every_rule() -> None:
    settings = Settings(backend="trtllm")
    plan = policy.resolve(settings, TOPOLOGY, Spec(max_tokens=128, hidden=4096))
    cand = plan.candidate("trtllm")
    assert {"moe_finalize+residual_rmsnorm", "moe_reduce+rmsnorm"} <= set(cand.fuses)
    text = plan.explain()
    for rule in (*moe_rules.CALL_RULES, moe_rules.NEEDS_NORM, moe_rules.QUANT_APART):
        assert rule in text
    assert plan.to_dict()["candidates"][0]["notes"] == list(cand.notes)
    assert "notes" not in plan.to_dict()["candidates"][-1]  # torch: none
    fp32 = policy.resolve(settings, TOPOLOGY, Spec(max_tokens=128, hidden=4096, dtype="fp32"))
    assert fp32.candidate("trtllm").notes == (
        f"MoE: {moe_rules.NOT_BF16}; the expert step runs apart, then the fused all-reduce",)
