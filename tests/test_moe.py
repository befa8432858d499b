"""The MoE patterns (docs/design.md 3.12): the expert step's checks, its torch reference against
float64, the kernel's bytes against the reference on every ISA path, and real ranks on shm and
torch (bit-identical across ranks and backends; ranks that disagree fail together)."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import torch
from test_isa_paths import ISAS, every_isa_built  # noqa: F401 -- the fixture

from arfuse import moe, signature
from arfuse.arg_checks import OpShape
from arfuse.backends.shm import build as shm_build
from arfuse.pattern import ALL, Pattern

from harness import run_ranks, values
from numerics_check import ulps_apart
from ranks_moe import HIDDEN, moe_disagreement, moe_fast_and_checked, moe_results

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
CPU = torch.device("cpu")


def shape_of(dtype: torch.dtype, hidden: int = HIDDEN) -> OpShape:
    name = {v: k for k, v in DTYPES.items()}[dtype]
    return OpShape(hidden, dtype, name, CPU)


def finalize_step(dtype: torch.dtype, tokens: int = 5, top_k: int = 8, rows: int = 40,
                  shared: bool = True, routed: float = 2.5, seed: int = 0) -> moe.ExpertStep:
    g = torch.Generator().manual_seed(seed)
    return moe.check_finalize(
        shape_of(dtype), torch.randn(rows, HIDDEN, generator=g).to(dtype),
        torch.randint(-1, rows, (tokens, top_k), generator=g, dtype=torch.int32),
        torch.randn(tokens, top_k, generator=g),
        torch.randn(tokens, HIDDEN, generator=g).to(dtype) if shared else None, routed)


def reduce_step(dtype: torch.dtype, tokens: int = 5, experts: int = 6,
                seed: int = 0) -> moe.ExpertStep:
    g = torch.Generator().manual_seed(seed)
    return moe.check_reduce(shape_of(dtype),
                            torch.randn(experts, tokens, HIDDEN, generator=g).to(dtype),
                            torch.randn(experts, tokens, generator=g),
                            torch.randn(tokens, HIDDEN, generator=g).to(dtype))


def float64_rows(step: moe.ExpertStep) -> torch.Tensor:
    """The expert step in float64, term by term."""
    tokens = step.tokens
    acc = torch.zeros(tokens, HIDDEN, dtype=torch.float64)
    for t in range(tokens):
        if step.index is not None:
            for k in range(step.fan_in):
                i = int(step.index[t, k])
                if i >= 0:
                    acc[t] += float(step.scales[t, k]) * step.rows[i].double()
            acc[t] *= step.routed
        else:
            for e in range(step.fan_in):
                acc[t] += float(step.scales[e, t]) * step.rows[e, t].double()
    return acc + (step.add.double() if step.add is not None else 0.0)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaNs' signs and payloads included."""
    return torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


# --- the patterns and the signature --------------------------------------------------------------

def test_every_moe_pattern_has_its_own_code_and_name() -> None:
    moe_patterns = [p for p in ALL if p.moe]
    assert len(moe_patterns) == 48 and len({p.code for p in ALL}) == len(ALL) == 72
    assert all(Pattern.from_code(p.code) == p for p in ALL)
    assert Pattern("residual_rmsnorm", reduction="moe_finalize").name == \
        "moe_finalize+residual_rmsnorm"


def test_the_signature_carries_top_k_exactly_and_a_refused_call_as_fan_in_zero() -> None:
    step = finalize_step(torch.float32)
    pattern = Pattern("residual_rmsnorm", reduction="moe_finalize").code
    words = [signature.words(5, 2, HIDDEN, pattern, moe=s.signature_bits())
             for s in (step, moe.ExpertStep(step.reduction, step.rows, step.scales[:, :4],
                                            step.index[:, :4], step.add, step.routed))]
    text = signature.mismatch_message("shm", 3, words)
    assert "they differ in top_k;" in text and "top_k=8" in text and "top_k=4" in text
    refused = moe.ExpertStep(step.reduction, step.rows, step.scales, step.index, step.add,
                             step.routed, refused=True)
    assert "top_k=0" in signature.describe(
        *signature.words(5, 2, HIDDEN, pattern, moe=refused.signature_bits()))


def test_the_kernel_describes_moe_signatures_in_the_same_words() -> None:
    kernel = shm_build.load()
    if kernel is None:
        pytest.skip(f"no kernel here: {shm_build.why_not()}")
    cases = []
    for reduction, epilogue, fan_in, shared, rows in itertools.product(
            ("moe_finalize", "moe_reduce"), ("none", "residual_rmsnorm"), (1, 8, 255),
            (False, True), (0, 40, 100_000)):
        code = Pattern(epilogue, reduction=reduction).code
        bits = signature.moe_bits(fan_in, shared, rows, 0x40200000)
        cases.append(signature.words(7, 0, HIDDEN, code, op=2, moe=bits))
    for words in cases:
        assert kernel.describe_signature(*words) == signature.describe(*words)
    for pair in itertools.combinations(cases[:12], 2):
        assert kernel.mismatch_message(9, list(pair)) == signature.mismatch_message(
            "shm", 9, list(pair))


# --- the checks ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("change", "words"), [
    ({"index": torch.zeros(40, dtype=torch.int32)}, "pass it as .view(tokens, top_k)"),
    ({"index": torch.zeros(5, 8, dtype=torch.int64)}, "expanded_idx_to_permuted_idx has dtype"),
    ({"index": torch.zeros(5, 0, dtype=torch.int32)}, "top_k"),
    ({"index": torch.zeros(5, 256, dtype=torch.int32)}, "it must be 1..255"),
    ({"scales": torch.ones(5, 4)}, "expert_scales must have shape (5, 8)"),
    ({"scales": torch.ones(5, 8, dtype=torch.float64)}, "expert_scales has dtype"),
    ({"expanded": torch.ones(40, HIDDEN + 1)}, "expanded must be 2-D [rows, hidden]"),
    ({"expanded": torch.ones(40, HIDDEN, dtype=torch.bfloat16)}, "expanded has dtype"),
    ({"expanded": torch.ones(HIDDEN, 40).t()}, "expanded must be contiguous"),
    ({"shared": torch.ones(4, HIDDEN)}, "shared_expert_output must have shape (5, 96)"),
    ({"routed": float("inf")}, "routed_scaling_factor=inf is not valid"),
    ({"routed": "2"}, "routed_scaling_factor must be a real number"),
    ({"expanded": [[1.0]]}, "expanded must be a torch.Tensor"),
])
def test_finalize_arguments_are_checked_by_name(change: dict[str, Any], words: str) -> None:
    args: dict[str, Any] = {"expanded": torch.ones(40, HIDDEN),
                            "index": torch.zeros(5, 8, dtype=torch.int32),
                            "scales": torch.ones(5, 8), "shared": None, "routed": 1.0}
    args.update(change)
    with pytest.raises((ValueError, TypeError)) as caught:
        moe.check_finalize(shape_of(torch.float32), args["expanded"], args["index"],
                           args["scales"], args["shared"], args["routed"])
    assert words in str(caught.value)


@pytest.mark.parametrize(("change", "words"), [
    ({"active": torch.ones(6, 5)}, "active_experts_token_input must be 3-D"),
    ({"scales": torch.ones(5, 6)}, "scale_input must have shape (6, 5)"),
    ({"token": torch.ones(5, HIDDEN + 1)}, "token_input must be 2-D"),
    ({"token": torch.ones(4, HIDDEN)}, "token_input must have shape (5, 96)"),
])
def test_reduce_arguments_are_checked_by_name(change: dict[str, Any], words: str) -> None:
    args: dict[str, Any] = {"active": torch.ones(6, 5, HIDDEN), "scales": torch.ones(6, 5),
                            "token": torch.ones(5, HIDDEN)}
    args.update(change)
    with pytest.raises(ValueError, match=None) as caught:
        moe.check_reduce(shape_of(torch.float32), args["active"], args["scales"], args["token"])
    assert words in str(caught.value)


@pytest.mark.parametrize("bad", [-2, 40, 2**31 - 1])
def test_an_index_outside_expanded_is_refused_by_torch_and_by_the_kernel_alike(bad: int) -> None:
    step = finalize_step(torch.float32)
    index = step.index.clone()
    index[3, 6] = bad
    step = moe.check_finalize(shape_of(torch.float32), step.rows, index, step.scales, step.add,
                              step.routed)
    want = (f"expanded_idx_to_permuted_idx[3, 6] = {bad} is not a row of expanded (it must be "
            "-1, for none, or 0..39)")
    with pytest.raises(moe.RefusedStep) as caught:
        moe.local_rows(step, torch.empty(5, HIDDEN))
    assert str(caught.value) == want
    kernel = shm_build.load()
    if kernel is not None:
        dst = torch.zeros(5, HIDDEN)
        assert kernel.moe_finalize(dst, step.rows, index, step.scales, step.add,
                                   step.routed) == want
        assert not dst.any()  # nothing written


# --- the arithmetic -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("kind", ["finalize", "finalize_no_shared", "reduce"])
def test_the_reference_is_within_rounding_of_float64(dtype: torch.dtype, kind: str) -> None:
    step = (reduce_step(dtype) if kind == "reduce" else
            finalize_step(dtype, shared=kind == "finalize", routed=2.5 if kind == "finalize"
                          else 1.0))
    got = moe.local_rows(step, torch.empty(5, HIDDEN, dtype=dtype)).double()
    want = float64_rows(step)
    # fp32 sums of 8 terms, then one rounding to the dtype
    tolerance = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-21}[dtype]
    assert torch.all((got - want).abs() <= tolerance * want.abs() * 2 + 1e-6)


def kernel_moe_bytes(rank: int, world: int, integer: bool = False) -> dict[str, Any]:
    """The kernel's expert step (this process's ISA) and the reference over a case matrix:
    every dtype, hidden sizes with and without a scalar tail, -1 entries, routed scaling, NaN
    and infinities in the scales and rows. ``integer``: inputs built from integer bits (the
    same on every machine: test_cross_machine) instead of torch.randn."""
    from arfuse.backends.shm import build

    kernel = build.load()
    assert kernel is not None
    found: dict[str, Any] = {"isa": kernel.isa}
    for name, dtype in DTYPES.items():
        for hidden, seed in itertools.product((37, 96, 1040), (0, 1)):
            shape = OpShape(hidden, dtype, name, CPU)
            g = torch.Generator().manual_seed(seed)
            salt = iter(range(hidden * 10 + seed * 5, hidden * 10 + seed * 5 + 5))

            def draw(*size: int, g: torch.Generator = g, salt: Any = salt) -> torch.Tensor:
                if not integer:
                    return torch.randn(*size, generator=g)
                from test_cross_machine import integer_floats

                return integer_floats(size, next(salt))

            rows = draw(12, hidden).to(dtype)
            if integer:  # and a NaN's bits set as integers (torch's conversions differ)
                from test_cross_machine import hashed, quiet_nans

                index = (hashed(15, 99 + seed) % 13 - 1).to(torch.int32).reshape(3, 5)
            else:
                index = torch.randint(-1, 12, (3, 5), generator=g, dtype=torch.int32)
            scales = draw(3, 5)
            if seed:
                rows[2, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
                scales[1, 2], scales[0, 0] = float("nan"), float("inf")
            scales_in = scales.to(dtype) if seed else scales
            if integer:
                rows, scales_in = quiet_nans(rows), quiet_nans(scales_in)
            shared = draw(3, hidden).to(dtype)
            for add, routed in ((None, 1.0), (shared, 0.375)):
                step = moe.check_finalize(shape, rows, index, scales_in, add, routed)
                want = moe.local_rows(step, torch.empty(3, hidden, dtype=dtype))
                got = torch.empty(3, hidden, dtype=dtype)
                assert kernel.moe_finalize(got, rows, step.index, step.scales, add, routed) == ""
                found[f"finalize {name} {hidden} {seed} {routed}"] = (got, want)
            active = draw(4, 3, hidden).to(dtype)
            if seed:
                active[1, 2, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
            if integer:
                active = quiet_nans(active)
            scale_input = scales[:, :4].t().contiguous()
            step = moe.check_reduce(shape, active, scale_input, shared)
            want = moe.local_rows(step, torch.empty(3, hidden, dtype=dtype))
            got = torch.empty(3, hidden, dtype=dtype)
            kernel.moe_reduce(got, active, step.scales, shared)
            found[f"reduce {name} {hidden} {seed}"] = (got, want)
    return found


@pytest.mark.usefixtures("every_isa_built")
def test_the_kernel_gives_the_reference_bytes_on_every_isa() -> None:
    by_isa = {isa: values(run_ranks(kernel_moe_bytes, 1, init=False,
                                    env={"ARFUSE_SHM_ISA": isa}))[0] for isa in ISAS}
    first = next(iter(by_isa.values()))
    # torch's NaNs follow the machine (aarch64: a made NaN is positive), the kernel's one rule
    # (conversions.h): there the reference is matched NaN for NaN, the ISAs bit for bit
    x86 = shm_build.ARCH == "x86_64"
    for isa, found in by_isa.items():
        for case, pair in found.items():
            if case == "isa":
                continue
            got, want = pair
            nan = torch.isnan(want)
            assert (same_bytes(got, want) if x86 else torch.equal(torch.isnan(got), nan)
                    and same_bytes(got[~nan], want[~nan])), f"{isa} ({found['isa']}): {case}"
            assert torch.equal(got.view(INT_VIEW[got.dtype]),
                               first[case][0].view(INT_VIEW[got.dtype])), f"{isa}: {case}"


# --- real ranks ----------------------------------------------------------------------------------

CASES = [("finalize", 5, 16), ("finalize_fp8", 5, 16), ("finalize_plain", 3, 16),
         ("reduce", 5, 16), ("finalize", 9, 4)]  # the last over capacity: runs unfused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_ranks_agree_bit_for_bit_on_shm_and_torch(dtype: torch.dtype) -> None:
    """The ranks of a backend agree in every byte; across backends the rows each rank
    all-reduces (so ``residual_out`` and a plain call's ``out``) are the same bytes, and the
    normed ``out`` and its quant codes are within the kernel's documented tolerance of torch's
    (its sum of squares is added up in another order: README, tests/test_shm.py)."""
    shm = values(run_ranks(moe_results, 2, "shm", dtype, CASES, timeout=120))
    torch_backend = values(run_ranks(moe_results, 2, "torch", dtype, CASES, timeout=120))
    for i, (pattern, tokens, capacity) in enumerate(CASES):
        assert shm[0][i]["backend"] == "shm" and torch_backend[0][i]["backend"] == "torch"
        for ranks in (shm, torch_backend):
            for got, want in zip(ranks[1][i]["outputs"], ranks[0][i]["outputs"], strict=True):
                assert (got is None) == (want is None)
                if got is not None:
                    assert torch.equal(got, want), (pattern, "ranks differ")
        out, residual_out, quant_out = (shm[0][i]["outputs"] + [None, None])[:3]
        t_out, t_residual_out, t_quant_out = (torch_backend[0][i]["outputs"] + [None, None])[:3]
        if residual_out is not None:
            assert torch.equal(residual_out, t_residual_out), pattern
        if pattern == "finalize_plain":
            assert torch.equal(out, t_out), pattern
        else:
            apart = ulps_apart(out.view(dtype), t_out.view(dtype)).max().item()
            assert apart <= (8 if dtype == torch.float32 else 1), (pattern, apart)
        if quant_out is not None:
            differ = (quant_out != t_quant_out).float().mean().item()
            assert differ <= 0.01, f"{pattern}: {differ:.2%} quant codes differ"
        over = tokens > capacity
        assert shm[0][i]["stats"]["unfused_over_capacity"] == int(over)
        assert shm[0][i]["stats"]["fused"] == int(not over)


def test_ranks_that_disagree_on_top_k_fail_together_and_stay_in_step() -> None:
    for backend in ("shm", "torch"):
        first, after = zip(*values(run_ranks(moe_disagreement, 2, backend, "top_k",
                                             timeout=90)), strict=True)
        assert [f["type"] for f in first] == ["MismatchedCall"] * 2, (backend, first)
        assert all("they differ in top_k" in f["error"] for f in first), first
        assert [a["type"] for a in after] == ["", ""], (backend, after)


def test_a_bad_index_on_one_rank_fails_it_by_name_and_its_peer_at_once() -> None:
    for backend in ("shm", "torch"):
        results = values(run_ranks(moe_disagreement, 2, backend, "index", timeout=90))
        peer, refusing = results[0][0], results[1][0]
        assert refusing["type"] == "RefusedStep" and "[2, 5] = 40" in refusing["error"]
        # not CallTimeout: the peer learnt of the refusal instead of waiting for it
        assert peer["type"] == "MismatchedCall" and "top_k=0" in peer["error"], peer
        assert [r[1]["type"] for r in results] == ["", ""], (backend, results)


@pytest.mark.parametrize(("case", "message"), [
    ("flat", "a flat index: pass it as .view(tokens, top_k)"),
    ("reduce_scales", "scale_input must have shape (8, 4)")])
@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_a_call_one_rank_refuses_by_its_checks_fails_its_peer_at_once(
        backend: str, case: str, message: str) -> None:
    """An argument of a MoE call that only one rank's checks refuse (a flat index, scales of
    the wrong shape): that rank raises the ValueError, its peer MismatchedCall at once (not a
    timeout), and the next good call works on both."""
    results = values(run_ranks(moe_disagreement, 2, backend, case, timeout=90))
    peer, refusing = results[0][0], results[1][0]
    assert refusing["type"] == "ValueError" and message in refusing["error"], refusing
    assert peer["type"] == "MismatchedCall", peer
    assert "top_k=0" in peer["error"] or "experts=0" in peer["error"], peer
    assert peer["seconds"] < 5, peer  # the call's timeout is 10 s
    assert [r[1]["type"] for r in results] == ["", ""], (backend, results)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_kernels_fast_path_and_the_checked_path_agree(dtype: torch.dtype) -> None:
    """A rank on the kernel's fast path and one on the checked Python path meet with the same
    signature and get the same bytes; the fast path declines every call the Python path
    refuses (or handles: an index past the rows, a call over capacity)."""
    if shm_build.load() is None:
        pytest.skip(f"no kernel here: {shm_build.why_not()}")
    fast, checked = values(run_ranks(moe_fast_and_checked, 2, dtype, timeout=120))
    assert fast["fast_calls"] == 4 and checked["fast_calls"] == 0
    for got, want in zip(checked["outputs"], fast["outputs"], strict=True):
        for a, b in zip(got, want, strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    for declined in (fast["declined"], checked["declined"]):
        assert declined and all(declined.values()), [k for k, v in declined.items() if not v]


def test_the_kernel_computes_the_moe_fields_as_python_does() -> None:
    kernel = shm_build.load()
    if kernel is None:
        pytest.skip(f"no kernel here: {shm_build.why_not()}")
    gen = random.Random(7)
    for _ in range(3000):
        fields = (gen.randint(0, 255), gen.random() < 0.5, gen.randint(0, 2**40),
                  gen.randint(0, 2**32 - 1))
        assert kernel.diagnostics.moe_bits(*fields) == signature.moe_bits(*fields), fields
