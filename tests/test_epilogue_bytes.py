"""The torch epilogue (the torch backend, shm's pure-torch path and every call over a fused
workspace's capacity) gives the shm kernel's bytes: every output, every pattern, dtype, hidden
size and token count, so a row's result does not depend on which path, and so which batch, it
went through.

One rank on private memory: the kernel's sum is ``x`` itself, so the torch epilogue on the same
``x`` must write the same bytes. Two real ranks over gloo: the same rows fused on shm (one-shot
and two-shot), over the shm workspace's capacity (unfused) and on the torch backend."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arfuse import epilogue
from arfuse.backends.shm import build as shm_build
from arfuse.backends.shm import layout as shm_layout
from arfuse.call_checks import CallArgs
from arfuse.moe import ExpertStep, local_rows
from arfuse.result import FusedOutput

from harness import run_ranks, values

DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EPS = 1e-6
QUANTS: dict[str | None, float | None] = {None: None, "fp8": 0.5, "fp8_dynamic": None,
                                          "nvfp4": 448.0}
OUTPUTS = ("out", "residual_out", "quant_out", "scale_out")
MAX_TOKENS = 300


def kernel(tokens: int, hidden: int, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
    """A one-rank shm kernel on private memory (and the memory, to keep alive)."""
    module = shm_build.load()
    if module is None:
        pytest.skip(f"no compiled kernel here: {shm_build.why_not()}")
    layout = shm_layout.ShmLayout(1, tokens, hidden, torch.tensor([], dtype=dtype).element_size())
    memory = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    comm = module.ShmComm(memory.data_ptr(), 1, 0, tokens, hidden, DTYPE_CODE[dtype],
                          shm_layout.HEADER_BYTES, layout.slot_bytes, layout.input_bytes,
                          10.0, 1 << 40)
    comm.set_result_type(FusedOutput)
    return comm, memory


def takes(quant: str | None, hidden: int, dtype: torch.dtype) -> bool:
    """NVFP4 needs a 16-bit dtype and whole blocks of 16."""
    return quant != "nvfp4" or (dtype != torch.float32 and hidden % 16 == 0)


def raw(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.new_empty(t.shape).copy_(t).view(torch.uint8)


def differing(got: FusedOutput, want: FusedOutput) -> list[str]:
    """The outputs whose bytes differ (one given and the other not counts)."""
    bad = []
    for name in OUTPUTS:
        if not same_bytes(raw(getattr(got, name)), raw(getattr(want, name))):
            bad.append(name)
    return bad


def same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return torch.equal(a, b)


def row_inputs(tokens: int, hidden: int, dtype: torch.dtype,
               seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    return x, residual, weight


def variants(hidden: int, dtype: torch.dtype) -> list[tuple[bool, bool, float, str | None]]:
    """(weight, residual, weight_bias, quant) of every pattern this shape takes."""
    out = []
    for norm, res, bias, quant in itertools.product((False, True), (False, True), (0.0, 1.0),
                                                    QUANTS):
        if (res and not norm) or (bias and not norm) or not takes(quant, hidden, dtype):
            continue
        out.append((norm, res, bias, quant))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [16, 37, 48, 1040, 1100])
def test_torch_epilogue_is_the_kernel_bytes(dtype: torch.dtype, hidden: int) -> None:
    """Hidden sizes below, at and past the 32 lanes, not multiples of 32, past a segment of
    the kernel's passes (512) with a scalar tail; 1 to 300 tokens; every pattern and output,
    nvfp4 in both scale layouts."""
    comm, _memory = kernel(MAX_TOKENS, hidden, dtype)
    failures = []
    for tokens in (1, 5, 64, MAX_TOKENS):
        x, residual, weight = row_inputs(tokens, hidden, dtype, seed=tokens * 7919 + hidden)
        for norm, res, bias, quant in variants(hidden, dtype):
            for layout in (("linear", "swizzled_128x4") if quant == "nvfp4" else ("linear",)):
                call = CallArgs(x, residual if res else None, weight if norm else None, EPS,
                                bias, quant, QUANTS[quant], layout)
                got = comm.call(call.x, call.residual, call.weight, call.eps, call.weight_bias,
                                call.quant, call.scale, call.layout, None, None)
                assert got is not None, call.pattern
                bad = differing(got, epilogue.apply(x.float(), call))
                if bad:
                    failures.append((tokens, str(call.pattern), bias, layout, bad))
    assert not failures, failures


@st.composite
def extreme_rows(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Rows whose magnitudes span the dtype's range: squares that underflow to subnormals or
    zero, sums of squares that overflow to inf (inv = 0), signed zeros, zero rows; eps from
    the smallest fp32 subnormal up."""
    dtype = draw(st.sampled_from(DTYPES))
    tokens = draw(st.integers(1, 9))
    hidden = draw(st.sampled_from([1, 7, 31, 32, 33, 64, 96, 200, 530]))
    top = 15 if dtype == torch.float16 else 100  # no inf in x: finite rows only
    low = -24 if dtype == torch.float16 else -130
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    exponents = torch.randint(low, top, (tokens, hidden), generator=gen).float()
    x = torch.randn(tokens, hidden, generator=gen) * torch.exp2(exponents)
    x[torch.rand(tokens, hidden, generator=gen) < 0.05] = -0.0
    if draw(st.booleans()):
        x[draw(st.integers(0, tokens - 1))] = 0.0
    residual = torch.randn(tokens, hidden, generator=gen) * 2.0 ** draw(st.integers(low, 10))
    weight = torch.rand(hidden, generator=gen) * 4 - 2
    eps = draw(st.sampled_from([2.0**-149, 1e-30, 1e-6, 1e-5, 0.5]))
    return x.to(dtype), residual.to(dtype), weight.to(dtype), eps


@settings(max_examples=150, deadline=None)
@given(rows=extreme_rows(), bias=st.sampled_from([0.0, 1.0, -0.75]),
       quant=st.sampled_from(list(QUANTS)), with_residual=st.booleans())
def test_torch_epilogue_is_the_kernel_bytes_at_the_extremes(
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float], bias: float,
        quant: str | None, with_residual: bool) -> None:
    x, residual, weight, eps = rows
    tokens, hidden = x.shape
    if not takes(quant, hidden, x.dtype):
        quant = "fp8"
    comm, _memory = kernel(tokens, hidden, x.dtype)
    call = CallArgs(x, residual if with_residual else None, weight, eps, bias, quant,
                    QUANTS[quant], "linear")
    got = comm.call(x, call.residual, weight, eps, bias, quant, call.scale, "linear", None,
                    None)
    assert got is not None
    assert not differing(got, epilogue.apply(x.float(), call))


# NaNs of both signs with payloads (quiet and signalling) in the activation dtype's bits
NAN_BITS = {torch.float32: (0x7FC00000, -0x005EDCBB, 0x7F812345, -0x00200001),  # 0xffa12345..
            torch.bfloat16: (0x7FC0, -0x005F, 0x7F81, -0x0021),
            torch.float16: (0x7E00, -0x017F, 0x7C81, -0x0301)}
INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def with_specials(x: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` with NaNs (each row its own), infinities of both signs (inf - inf and inf * 0 make
    the machine's NaN), a row overflowing the dtype, and NaN in a row's last element (a vector
    form's scalar tail)."""
    x = x.clone()
    bits = x.view(INT_OF[x.dtype])
    for row, nan in enumerate(NAN_BITS[x.dtype]):
        bits[row, (seed + 3 * row) % x.shape[1]] = nan
    # signalling, in the scalar tail: with one rank (its sum adds nothing) it reaches the
    # amaxes of fp8_dynamic and fp8_group as it is, and counts there no more than a quiet one
    bits[5, -1] = NAN_BITS[x.dtype][2]
    x[6, 0], x[6, -1] = float("inf"), -float("inf")
    x[7, 1 % x.shape[1]] = float("inf")
    x[8] = torch.finfo(x.dtype).max
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [37, 1040])
def test_torch_epilogue_is_the_kernel_bytes_with_nan_and_inf(dtype: torch.dtype,
                                                             hidden: int) -> None:
    """NaN and infinities in x and in the residual: the same bytes, NaNs' signs and payloads
    included (so quantised NaNs keep their sign). Two NaNs of different payloads meeting in
    one addition are left out: which one torch keeps depends on its loop (docs/design.md 3.6)."""
    tokens = 12
    comm, _memory = kernel(tokens, hidden, dtype)
    x, residual, weight = row_inputs(tokens, hidden, dtype, seed=hidden)
    x = with_specials(x, seed=1)
    residual = with_specials(residual, seed=2)
    failures = []
    for norm, res, bias, quant in variants(hidden, dtype):
        call = CallArgs(x, residual if res else None, weight if norm else None, EPS, bias,
                        quant, QUANTS[quant], "linear")
        got = comm.call(x, call.residual, call.weight, EPS, bias, quant, call.scale, "linear",
                        None, None)
        assert got is not None, call.pattern
        bad = differing(got, epilogue.apply(x.float(), call))
        if bad:
            failures.append((str(call.pattern), bias, bad))
    assert not failures, failures


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["moe_finalize", "moe_reduce"])
def test_moe_step_then_torch_epilogue_is_the_kernel_bytes(dtype: torch.dtype,
                                                          reduction: str) -> None:
    """The MoE patterns: the torch expert step (``arfuse.moe.local_rows``) and the torch
    epilogue after it write what the kernel's one call does, RMSNorm and quantisation
    included."""
    hidden, fan_in = 1040, 4
    comm, _memory = kernel(64, hidden, dtype)
    failures = []
    for tokens in (1, 5, 64):
        gen = torch.Generator().manual_seed(tokens)
        _, residual, weight = row_inputs(tokens, hidden, dtype, seed=tokens + 1)
        if reduction == "moe_finalize":
            rows = torch.randn(tokens * fan_in, hidden, generator=gen).to(dtype)
            index = torch.randperm(tokens * fan_in, generator=gen).view(tokens, fan_in)
            index[0, 1] = -1
            index = index.to(torch.int32)
            scales = torch.rand(tokens, fan_in, generator=gen)
            shared = torch.randn(tokens, hidden, generator=gen).to(dtype)
            step = ExpertStep(reduction, rows, scales, index, shared, 2.5)
        else:
            rows = torch.randn(fan_in, tokens, hidden, generator=gen).to(dtype)
            scales = torch.rand(fan_in, tokens, generator=gen).to(dtype)
            step = ExpertStep(reduction, rows, scales, None,
                              torch.randn(tokens, hidden, generator=gen).to(dtype))
        for norm, res, bias, quant in variants(hidden, dtype):
            x = local_rows(step, torch.empty(tokens, hidden, dtype=dtype))
            call = CallArgs(x, residual if res else None, weight if norm else None, EPS, bias,
                            quant, QUANTS[quant], "linear")
            got = comm.call_moe(step.rows, step.index, step.scales, step.add, step.routed,
                                call.residual, call.weight, EPS, bias, quant, call.scale,
                                "linear", None, None)
            assert got is not None, call.pattern
            bad = differing(got, epilogue.apply(x.float(), call))
            if bad:
                failures.append((tokens, str(call.pattern), bias, bad))
    assert not failures, failures


# --- two real ranks: fused, over capacity and on the torch backend ---------------------------

CAPACITY = 64
ROWS = 300
CHUNKS = (1, 5, 58, 64, 64, 64, 44)  # fused calls covering the ROWS rows, one- and two-shot
assert sum(CHUNKS) == ROWS and max(CHUNKS) <= CAPACITY


def rank_cases(hidden: int, dtype: torch.dtype) -> list[tuple[str, dict[str, Any]]]:
    cases: list[tuple[str, dict[str, Any]]] = [("plain", {}), ("plain", {"quant": "fp8"})]
    for norm, res, bias, quant in variants(hidden, dtype):
        if norm and (res or quant in (None, "fp8")):
            cases.append(("norm", {"residual": res, "weight_bias": bias, "quant": quant}))
    cases += [("moe_finalize", {"residual": True, "quant": None}),
              ("moe_reduce", {"residual": True, "quant": "nvfp4" if takes("nvfp4", hidden, dtype)
                              else "fp8_dynamic"})]
    return cases


def rank_rows(rank: int, hidden: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every input of the ROWS rows: x (NaNs and infinities in its first rows) and the expert
    rows this rank's own, the residual and the weight the same on every rank (tensor
    parallelism)."""
    gen = torch.Generator().manual_seed(hidden + 101 * rank)
    same = torch.Generator().manual_seed(hidden)
    x = with_specials((torch.randn(ROWS, hidden, generator=gen) * 3).to(dtype), seed=rank)
    x[11, 0] = float("inf") if rank == 0 else -float("inf")
    return {
        "x": x,
        "expanded": torch.randn(2 * ROWS, hidden, generator=gen).to(dtype),
        "index": torch.randperm(2 * ROWS, generator=gen).view(ROWS, 2).to(torch.int32),
        "expert_scales": torch.rand(ROWS, 2, generator=gen),
        "shared": torch.randn(ROWS, hidden, generator=gen).to(dtype),
        "active": torch.randn(3, ROWS, hidden, generator=gen).to(dtype),
        "scale_input": torch.rand(3, ROWS, generator=gen),
        "residual": torch.randn(ROWS, hidden, generator=same).to(dtype),
        "weight": (torch.rand(hidden, generator=same) + 0.5).to(dtype),
    }


def call_rows(op: Any, kind: str, opts: dict[str, Any], rows: dict[str, torch.Tensor], b: int,
              e: int) -> FusedOutput:
    """One call of ``kind`` on rows [b, e)."""
    kwargs: dict[str, Any] = {}
    if kind != "plain":
        kwargs.update(weight=rows["weight"], eps=EPS, weight_bias=opts.get("weight_bias", 0.0))
        if opts.get("residual"):
            kwargs["residual"] = rows["residual"][b:e]
    quant = opts.get("quant")
    if quant is not None:
        kwargs.update(quant=quant, scale=QUANTS[quant], layout="linear")
    if kind == "moe_finalize":
        result: FusedOutput = op.moe_finalize(
            rows["expanded"], rows["index"][b:e].contiguous(),
            rows["expert_scales"][b:e].contiguous(), shared_expert_output=rows["shared"][b:e],
            routed_scaling_factor=2.5, **kwargs)
        return result
    if kind == "moe_reduce":
        result = op.moe_reduce(rows["active"][:, b:e].contiguous(),
                               rows["scale_input"][:, b:e].contiguous(), rows["x"][b:e],
                               **kwargs)
        return result
    result = op(rows["x"][b:e], **kwargs)
    return result


def cat_rows(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """One output of consecutive calls, their rows in order (None when the calls have none)."""
    given = [t for t in parts if t is not None]
    return torch.cat(given) if given else None


def paths_agree(rank: int, world: int) -> dict[Any, Any]:
    """Every case on every path; returns per case and path the outputs' bytes over all ROWS
    rows (nvfp4 scales in the linear layout, so that chunks concatenate)."""
    import arfuse

    report: dict[Any, Any] = {}
    for dtype in DTYPES:
        for hidden in (37, 1040):
            shm = arfuse.FusedAllReduce(max_token_num=CAPACITY, hidden_dim=hidden, dtype=dtype,
                                        backend="shm", strict=True, timeout_s=60)
            ref = arfuse.FusedAllReduce(max_token_num=CAPACITY, hidden_dim=hidden, dtype=dtype,
                                        backend="torch", strict=True, timeout_s=60)
            rows = rank_rows(rank, hidden, dtype)
            for kind, opts in rank_cases(hidden, dtype):
                key = (str(dtype), hidden, kind, tuple(sorted(opts.items())))
                pieces = []
                at = 0
                for n in CHUNKS:
                    pieces.append(call_rows(shm, kind, opts, rows, at, at + n))
                    at += n
                fused = [cat_rows([p[i] for p in pieces]) for i in range(len(OUTPUTS))]
                report[key] = {
                    "fused": [raw(t) for t in fused],
                    "over_capacity": [raw(t) for t in call_rows(shm, kind, opts, rows, 0, ROWS)],
                    "torch": [raw(t) for t in call_rows(ref, kind, opts, rows, 0, ROWS)],
                }
            report[(str(dtype), hidden, "stats")] = shm.stats()
            shm.close()
            ref.close()
    return report


def test_fused_over_capacity_and_torch_give_the_same_bytes_on_real_ranks() -> None:
    """Two ranks over gloo: the ROWS rows fused on shm in calls of 1 to 64 rows (one-shot and
    two-shot), in one call of ROWS rows over the workspace's capacity (unfused), and on the
    torch backend: the same bytes in every output, on every rank."""
    if shm_build.load() is None:
        pytest.skip(f"no compiled kernel here: {shm_build.why_not()}")
    reports = values(run_ranks(paths_agree, 2, timeout=300))
    failures = []
    for key, entry in reports[0].items():
        if key[-1] == "stats":
            assert entry["unfused_over_capacity"] > 0 and entry["fused"] > 0, entry
            continue
        for rank, report in enumerate(reports):
            mine = report[key]
            for path in ("fused", "over_capacity", "torch"):
                for name, got, want in zip(OUTPUTS, mine[path], reports[0][key]["fused"],
                                           strict=True):
                    if not same_bytes(got, want):
                        failures.append((rank, key, path, name))
    assert not failures, failures[:20]
