"""Fuzzing with hypothesis: every input either works and matches the reference, or raises
ValueError / TypeError naming the argument; never a crash, a hang or a wrong result.

* ``FusedAllReduce.__call__`` in one process (group=None: the torch backend) over shapes,
  dtypes, strides, devices, scales, destinations and argument combinations, judged by rules
  written here from the README's contract (not from ``call_checks``), and on a real 2-rank shm
  group with a bounded number of examples;
* the parsers: settings (``ARFUSE_*``), topology (``Topology.from_dict``, ``topology.load``),
  faults (``faults.parse``);
* the shm kernel's entries called directly with bad arguments (``ShmComm.call`` / ``.run`` and
  the torch operator), in a subprocess so that a segfault fails the test instead of pytest.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import arfuse
from arfuse import faults, topology
from arfuse import settings as settings_mod
from arfuse.scenarios import mapped_segments

import ranks_fuzz
from harness import run_ranks, values
from reference import fp8_codes_independent, nvfp4_independent, swizzle_offset

ROOT = Path(__file__).resolve().parent.parent
FIGURES: Counter[str] = Counter()
FP32_MAX = float(np.finfo(np.float32).max)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ULP = {"bf16": 2.0**-7, "fp16": 2.0**-10, "fp32": 2.0**-21}
NAMES = ("x", "residual", "weight", "eps", "weight_bias", "quant", "scale", "layout", "out",
         "residual_out")
QUICK = settings(deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                 suppress_health_check=list(HealthCheck))


def quick(examples: int) -> settings:
    """Deterministic, no shrinking (a failure prints the example as drawn): bounded time."""
    return settings(QUICK, max_examples=examples)


@pytest.fixture(scope="module", autouse=True)
def report_figures() -> Iterator[None]:
    yield
    print("\nfuzz figures: " + json.dumps(dict(sorted(FIGURES.items()))))
    arfuse.destroy_all()
    assert mapped_segments() == [], "a segment is still mapped after the fuzz tests"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"arfuse-{os.getpid()}-")]


# --- the op in one process ---------------------------------------------------------------------

_OPS: dict[tuple[str, int], arfuse.FusedAllReduce] = {}


def op(dtype: str, hidden: int) -> arfuse.FusedAllReduce:
    if (dtype, hidden) not in _OPS:
        _OPS[(dtype, hidden)] = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=hidden,
                                                      dtype=DTYPES[dtype])
    return _OPS[(dtype, hidden)]


def fp32_value(v: Any) -> float | None:
    """The README's numbers: a real scalar (Python, NumPy, one-element tensor), not bool, that
    fp32 carries (finite after rounding); ``None`` when it is not one."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.dtype == torch.bool or v.is_complex():
            return None
        v = v.item()
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer,
                                                             np.floating)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    if not math.isfinite(f) or abs(f) > FP32_MAX:
        return None
    return float(np.float32(f))


GOOD_EPS = st.one_of(st.floats(1e-8, 1.0), st.sampled_from(
    [np.float32(1e-5), np.float64(1e-6), torch.tensor(1e-5), torch.tensor([1e-6]), 1]))
BAD_NUMBERS = st.sampled_from([0.0, -1e-5, float("nan"), float("inf"), 1e39, 10**400, -1e39,
                               True, "1e-5", None, [1e-5], torch.tensor([1.0, 2.0]),
                               torch.tensor(True), 1e-50, complex(1, 0), np.bool_(False)])
GOOD_BIAS = st.one_of(st.floats(-1.0, 1.0), st.sampled_from([0, np.float32(0.5),
                                                             torch.tensor([[0.25]])]))
GOOD_FP8_SCALE = st.one_of(st.floats(0.02, 2.0), st.sampled_from([np.float64(0.0625),
                                                                  torch.tensor(0.125)]))
GOOD_NVFP4_SCALE = st.floats(20.0, 800.0)
QUANTS = st.sampled_from([None, "none", "fp8", "nvfp4", " FP8 ", "int8", 8, "nvfp4"])
LAYOUTS = st.sampled_from(["swizzled_128x4", "linear", "linear", "swizzled", None, 3])
X_KINDS = ("ok", "ok", "ok", "offset_view", "wrong_dtype", "wrong_hidden", "non_contiguous",
           "three_d", "meta", "list")
T_KINDS = ("none", "ok", "ok", "wrong_dtype", "wrong_shape", "non_contiguous", "meta",
           "numpy")
OUT_KINDS = ("none", "none", "fresh", "x", "residual", "partial_x", "wrong_dtype",
             "wrong_shape", "requires_grad", "non_contiguous", "meta")
ROUT_KINDS = ("none", "none", "fresh", "residual", "x", "same_as_out", "requires_grad",
              "wrong_shape")


@st.composite
def calls(draw: Any) -> dict[str, Any]:
    """Half the examples break anything; the other half are valid calls with at most one
    argument drawn from everything (so that valid calls of every kind run too)."""
    wild = draw(wild_calls())
    if draw(st.booleans()):
        return wild
    weight = draw(st.sampled_from(["none", "ok"]))
    case = {**wild, "x": draw(st.sampled_from(["ok", "offset_view"])), "weight": weight,
            "residual": draw(st.sampled_from(["none", "ok"])) if weight == "ok" else "none",
            "eps": draw(GOOD_EPS), "weight_bias": draw(GOOD_BIAS),
            "quant": draw(st.sampled_from([None, "fp8", "nvfp4", "none"])),
            "fp8_scale": draw(GOOD_FP8_SCALE), "nvfp4_scale": draw(GOOD_NVFP4_SCALE),
            "layout": draw(st.sampled_from(["swizzled_128x4", "linear"])),
            "out": draw(st.sampled_from(["none", "fresh", "x"])),
            "residual_out": "none"}
    if weight == "ok":
        own = "x" if case["residual"] == "none" and case["out"] != "x" else "residual"
        case["residual_out"] = draw(st.sampled_from(["none", "fresh", own]))
    if case["dtype"] == "fp32" and case["quant"] == "nvfp4":
        case["quant"] = "fp8"
    changed = draw(st.sampled_from([None, "x", "residual", "weight", "eps", "weight_bias",
                                    "quant", "fp8_scale", "nvfp4_scale", "layout", "out",
                                    "residual_out"]))
    if changed is not None:
        case[changed] = wild[changed]
    return case


@st.composite
def wild_calls(draw: Any) -> dict[str, Any]:
    return {
        "dtype": draw(st.sampled_from(list(DTYPES))),
        "hidden": draw(st.sampled_from([16, 48])),
        "tokens": draw(st.integers(0, 6)),
        "x": draw(st.sampled_from(X_KINDS)),
        "residual": draw(st.sampled_from(T_KINDS)),
        "weight": draw(st.sampled_from(T_KINDS)),
        "eps": draw(st.one_of(GOOD_EPS, GOOD_EPS, BAD_NUMBERS)),
        "weight_bias": draw(st.one_of(GOOD_BIAS, GOOD_BIAS, BAD_NUMBERS)),
        "quant": draw(QUANTS),
        "fp8_scale": draw(st.one_of(GOOD_FP8_SCALE, GOOD_FP8_SCALE, BAD_NUMBERS)),
        "nvfp4_scale": draw(st.one_of(GOOD_NVFP4_SCALE, GOOD_NVFP4_SCALE, BAD_NUMBERS)),
        "layout": draw(LAYOUTS),
        "out": draw(st.sampled_from(OUT_KINDS)),
        "residual_out": draw(st.sampled_from(ROUT_KINDS)),
        "seed": draw(st.integers(0, 2**16)),
    }


def _tensor(kind: str, like: torch.Tensor, shape: tuple[int, ...], gen: torch.Generator) -> Any:
    values = torch.randn(*shape, generator=gen).to(like.dtype)
    if kind == "wrong_dtype":
        return values.to(torch.float64)
    if kind == "wrong_shape":
        return torch.randn(*shape[:-1], shape[-1] + 16, generator=gen).to(like.dtype)
    if kind == "non_contiguous":
        return torch.cat([values, values], dim=-1)[..., ::2]
    if kind == "meta":
        return values.to("meta")
    if kind == "numpy":
        return values.float().numpy()
    return values


def build(case: dict[str, Any]) -> tuple[dict[str, Any], set[str], dict[str, Any]]:
    """The call's arguments, the arguments that break the contract, and what the reference
    needs (the inputs before the call). ``inputs["maybe"]``: arguments that only touch
    another without sharing a byte (empty tensors): refusing them is fine too."""
    dtype, hidden, tokens = DTYPES[case["dtype"]], case["hidden"], case["tokens"]
    gen = torch.Generator().manual_seed(case["seed"])
    bad: set[str] = set()
    base = (torch.randn(tokens + 1, hidden, generator=gen) * 2).to(dtype)
    x: Any = base[:tokens]
    kind = case["x"]
    if kind == "offset_view":
        x = base[1:tokens + 1]  # contiguous, at an offset into its storage: fine
    elif kind == "wrong_dtype":
        x, bad = x.to(torch.float64), bad | {"x"}
    elif kind == "wrong_hidden":
        x, bad = torch.randn(tokens, hidden + 16, generator=gen).to(dtype), bad | {"x"}
    elif kind == "non_contiguous":
        x = torch.cat([x, x], dim=1)[:, ::2]
        bad = bad if x.is_contiguous() else bad | {"x"}  # no rows: contiguous after all
    elif kind == "three_d":
        x, bad = x.unsqueeze(0), bad | {"x"}
    elif kind == "meta":
        x, bad = x.to("meta"), bad | {"x"}
    elif kind == "list":
        x, bad = x.tolist(), bad | {"x"}
    like = base[:tokens]
    args: dict[str, Any] = {"x": x}
    residual = None if case["residual"] == "none" else _tensor(case["residual"], like,
                                                               (tokens, hidden), gen)
    weight = None if case["weight"] == "none" else (
        _tensor(case["weight"], like, (hidden,), gen) if case["weight"] != "ok"
        else (torch.rand(hidden, generator=gen) + 0.5).to(dtype))
    for name, made in (("residual", residual), ("weight", weight)):
        if case[name] not in ("none", "ok") and not (
                case[name] == "non_contiguous" and made.is_contiguous()):
            bad.add(name)
    if residual is not None and weight is None:
        bad.add("residual")  # a residual needs the norm
    args.update(residual=residual, weight=weight)
    if weight is not None:
        args.update(eps=case["eps"], weight_bias=case["weight_bias"])
        if fp32_value(case["eps"]) is None or not fp32_value(case["eps"]) > 0:  # type: ignore[operator]
            bad.add("eps")
        if fp32_value(case["weight_bias"]) is None:
            bad.add("weight_bias")
    quant = case["quant"]
    args["quant"] = quant
    name = quant.strip().lower() if isinstance(quant, str) else quant
    if name == "none":
        name = None
    if name not in (None, "fp8", "nvfp4"):
        bad.add("quant")
        name = None
    if name == "fp8":
        args["scale"] = case["fp8_scale"]
        v = fp32_value(case["fp8_scale"])
        if v is None or not v > 0 or not math.isfinite(float(np.float32(1.0) / np.float32(v))):
            bad.add("scale")
    elif name == "nvfp4":
        args["scale"], args["layout"] = case["nvfp4_scale"], case["layout"]
        v = fp32_value(case["nvfp4_scale"])
        if v is None or not v > 0:
            bad.add("scale")
        if case["dtype"] == "fp32":
            bad.add("quant")
        if case["layout"] not in ("swizzled_128x4", "linear"):
            bad.add("layout")
    else:
        args["scale"], args["layout"] = case["fp8_scale"], case["layout"]  # ignored
    args["out"], bad = _destination(case["out"], "out", args, base, tokens, bad, gen)
    args["residual_out"], bad = _destination(case["residual_out"], "residual_out", args, base,
                                             tokens, bad, gen)
    if args["residual_out"] is not None and weight is None:
        bad.add("residual_out")
    out, rout = args["out"], args["residual_out"]
    if out is not None and out is rout and "out" not in bad and tokens:
        bad.add("residual_out")  # out and residual_out must be different memory
    maybe = set()
    if not tokens:  # zero tokens: "overlapping" empty tensors share no byte
        maybe = bad & {"out", "residual_out"}
        bad = bad - maybe if all(_empty(args[n]) for n in maybe) else bad
        maybe = maybe - bad
    inputs = {"x": x.clone() if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x,
              "residual": residual.clone() if isinstance(residual, torch.Tensor) else residual,
              "maybe": maybe}
    return args, bad, inputs


def _empty(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() == 0 \
        and t.dtype == DTYPES.get(str(t.dtype).removeprefix("torch."), t.dtype) \
        and not t.requires_grad and t.is_contiguous()


def _destination(kind: str, name: str, args: dict[str, Any], base: torch.Tensor, tokens: int,
                 bad: set[str], gen: torch.Generator) -> tuple[Any, set[str]]:
    x, residual = args["x"], args["residual"]
    fresh = torch.empty_like(base[:tokens])
    valid_x = isinstance(x, torch.Tensor) and "x" not in bad
    if kind == "none":
        return None, bad
    if kind == "fresh":
        return fresh, bad
    if kind == "x":
        if not valid_x:
            return fresh, bad
        own = name == "out" or residual is None
        return x, bad if own else bad | {name}
    if kind == "residual":
        if not isinstance(residual, torch.Tensor) or "residual" in bad:
            return fresh, bad
        return residual, bad if name == "residual_out" else bad | {name}
    if kind == "same_as_out":
        out = args["out"]
        if out is None:
            return fresh, bad
        return out, bad | {name} if out.numel() else bad
    if kind == "partial_x":
        if not valid_x or x.data_ptr() != base.data_ptr():
            return fresh, bad
        shifted = base[1:tokens + 1]
        return shifted, bad | {name} if tokens >= 2 else bad
    if kind == "requires_grad":
        return fresh.requires_grad_(), bad | {name}
    made = _tensor(kind, base[:tokens], (tokens, base.shape[1]), gen)
    return made, bad if kind == "non_contiguous" and made.is_contiguous() else bad | {name}


def names_in(message: str) -> set[str]:
    return {n for n in NAMES if re.search(rf"(?<![\w.]){n}(?![\w])", message)}


def check_numbers(case: dict[str, Any], args: dict[str, Any], inputs: dict[str, Any],
                  result: Any) -> None:
    """The result against float64 (one rank: the sum is x), quantised codes against the
    independent quantisers of tests/reference.py."""
    dtype = case["dtype"]
    eps_u = ULP[dtype]
    x = inputs["x"].double()
    out = result.out.double()
    if args["out"] is not None:
        assert result.out is args["out"], "out= was not the tensor returned"
    weight = args["weight"]
    if weight is None:
        assert torch.equal(result.out, inputs["x"]), "plain all-reduce of one rank is not x"
        assert result.residual_out is None
    else:
        eps = fp32_value(args["eps"])
        bias = fp32_value(args["weight_bias"])
        assert eps is not None and bias is not None
        pre = x if inputs["residual"] is None else x + inputs["residual"].double()
        res = result.residual_out.double()
        bound = eps_u * (x.abs() + pre.abs()) + 1e-30
        assert torch.all((res - pre).abs() <= bound), "residual_out off"
        r = res
        ref = r * torch.rsqrt((r * r).mean(dim=-1, keepdim=True) + eps) * (
            weight.double() + bias)
        scale = ref.abs().max().item() if ref.numel() else 0.0
        assert torch.all((out - ref).abs() <= 4 * eps_u * (scale + ref.abs()) + 1e-30), \
            f"out off by {(out - ref).abs().max().item() if ref.numel() else 0}"
        if args["residual_out"] is not None:
            assert result.residual_out is args["residual_out"]
    quant = args["quant"].strip().lower() if isinstance(args["quant"], str) else None
    if quant == "fp8":
        expected = fp8_codes_independent(result.out, fp32_value(args["scale"]) or 1.0)
        got = result.quant_out.view(torch.uint8)
        assert (expected != got).float().mean().item() <= 1e-3 if got.numel() else True
    elif quant == "nvfp4" and result.out.numel():
        codes, sfs = nvfp4_independent(result.out, fp32_value(args["scale"]) or 1.0)
        packed = result.quant_out
        unpacked = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(codes.shape)
        assert (unpacked != codes).float().mean().item() <= 1e-3
        flat = result.scale_out.flatten()
        cols = codes.shape[1] // 16
        for m in range(codes.shape[0]):
            for k in range(cols):
                at = m * cols + k if args["layout"] == "linear" else swizzle_offset(m, k, cols)
                assert flat[at] == sfs[m, k], "nvfp4 scale misplaced"


@quick(1200)
@given(calls())
def test_fused_op_one_process(case: dict[str, Any]) -> None:
    args, bad, inputs = build(case)
    comm = op(case["dtype"], case["hidden"])
    FIGURES["op_one_process_examples"] += 1
    suspect = bad | inputs["maybe"]
    try:
        result = comm(**args)
    except (ValueError, TypeError) as exc:
        FIGURES["op_one_process_refused"] += 1
        assert suspect, f"a valid call was refused: {type(exc).__name__}: {exc}"
        named = names_in(str(exc))
        assert named & suspect, f"{type(exc).__name__} names {sorted(named)}, the bad " \
                                f"argument(s) are {sorted(suspect)}: {exc}"
        return
    assert not bad, f"arguments {sorted(bad)} break the contract but the call ran"
    FIGURES["op_one_process_ran"] += 1
    check_numbers(case, args, inputs, result)


# --- the op on a real 2-rank shm group ----------------------------------------------------------


@st.composite
def shm_cases(draw: Any) -> dict[str, Any]:
    bad = draw(st.sampled_from([None, None, None, "eps", "scale", "x_dtype", "x_stride",
                                "weight_shape", "out_overlap"]))
    case = {"tokens": draw(st.sampled_from([1, 2, 15, 16, 47, 48, 49, 60])),
            "pattern": draw(st.sampled_from(["plain", "norm", "norm_residual", "fp8", "nvfp4",
                                             "in_place", "slot"])),
            "bad": bad}
    if bad in ("eps", "scale"):
        case["value"] = draw(st.sampled_from([0.0, -1.0, float("nan"), float("inf"), 1e39,
                                              "0.1", True]))
    return case


BAD_NAMES = {"eps": "eps", "scale": "scale", "x_dtype": "x", "x_stride": "x",
             "weight_shape": "weight", "out_overlap": "out"}


@settings(deadline=None, max_examples=5, derandomize=True, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(st.lists(shm_cases(), min_size=20, max_size=30))
def test_fused_op_on_a_real_shm_group(cases: list[dict[str, Any]]) -> None:
    results = values(run_ranks(ranks_fuzz.fuzz_shm_calls, 2, cases, timeout=60))
    for per_rank in results:
        assert per_rank[0]["backend"] == "shm", per_rank[0]
    for i, case in enumerate(cases, start=1):
        FIGURES["op_shm_group_examples"] += 1
        for per_rank in results:
            got = per_rank[i]
            if case["bad"] is None:
                assert got["ok"] and got["ratio"] <= 1.0, (case, got)
            else:
                assert not got["ok"], (case, got)
                assert BAD_NAMES[case["bad"]] in names_in(got["error"]), (case, got)


# --- the parsers --------------------------------------------------------------------------------

ENV_VALUES = {
    "ARFUSE_BACKEND": st.sampled_from(["auto", "shm", "torch", "mnnvl", "trtllm", " SHM ", "nccl",
                                       "", "auto,shm"]),
    "ARFUSE_STRICT": st.sampled_from(["0", "1", " 1", "true", "2", "", "yes"]),
    "ARFUSE_REPLICATED_RESIDUAL": st.sampled_from(["0", "1", " 0 ", "True", "", "on", "check",
                                                   " check", "CHECK"]),
    "ARFUSE_TIMEOUT_S": st.sampled_from(["60", "0.5", "1e3", " 2 ", "0", "-1", "inf", "nan",
                                         "abc", "", "1e400"]),
    "ARFUSE_LOG": st.sampled_from(["debug", "INFO", "warning", "error", "", "verbose"]),
    "ARFUSE_TOPOLOGY": st.sampled_from(["/nonexistent.json", "", "x.json"]),
    "ARFUSE_FAULTS": st.sampled_from(["", "shm.create@1=raise", "garbage"]),
}


def _expected_setting(var: str, text: str) -> tuple[bool, Any]:
    """(valid, value) by the README's settings table."""
    t = text.strip()
    if not t:
        return True, None
    if var == "ARFUSE_BACKEND":
        return t.lower() in ("auto", "shm", "torch", "mnnvl", "trtllm"), t.lower()
    if var == "ARFUSE_STRICT":
        return t in ("0", "1"), t == "1"
    if var == "ARFUSE_REPLICATED_RESIDUAL":
        promise = {"check": "checked", "1": "same"}.get(t, "none")
        return t in ("0", "1", "check"), settings_mod.ResidualPromise(promise)
    if var == "ARFUSE_TIMEOUT_S":
        try:
            f = float(t)
        except ValueError:
            return False, None
        return math.isfinite(f) and f > 0, f
    if var == "ARFUSE_LOG":
        return t.lower() in ("debug", "info", "warning"), t.lower()
    return True, t


@quick(500)
@given(st.fixed_dictionaries({}, optional=dict(ENV_VALUES)),
       st.dictionaries(st.sampled_from(list(ENV_VALUES)), st.text(max_size=12), max_size=2))
def test_settings_parser(env: dict[str, str], noise: dict[str, str]) -> None:
    env = {**env, **noise}
    FIGURES["settings_examples"] += 1
    verdicts = {var: _expected_setting(var, text) for var, text in env.items()}
    try:
        conf = settings_mod.from_env(env)
    except (ValueError, TypeError) as exc:
        wrong = [var for var, (ok, _) in verdicts.items() if not ok]
        assert wrong, f"valid settings refused: {env}: {exc}"
        assert any(var in str(exc) for var in wrong), (env, str(exc))
        return
    assert all(ok for ok, _ in verdicts.values()), f"invalid settings accepted: {env}"
    fields = {"ARFUSE_BACKEND": "backend", "ARFUSE_STRICT": "strict",
              "ARFUSE_TIMEOUT_S": "timeout_s", "ARFUSE_LOG": "log_level",
              "ARFUSE_REPLICATED_RESIDUAL": "replicated_residual"}
    for var, (_, value) in verdicts.items():
        if var in fields and value is not None:
            assert getattr(conf, fields[var]) == value, (var, env)


JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 70000),
                                 st.floats(allow_nan=True), st.text(max_size=6)),
                       lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)


@st.composite
def topologies(draw: Any) -> tuple[dict[str, Any], bool | None]:
    """A topology dict and whether the README says it is valid."""
    world = draw(st.integers(1, 9))
    valid_hosts = draw(st.lists(st.sampled_from(["n0", "n1", "tray-2"]), min_size=world,
                                max_size=world))
    data: dict[str, Any] = {"device": draw(st.sampled_from(["cpu", "cuda"])),
                            "world_size": world, "hosts": valid_hosts}
    for name, strategy in (("sm", st.sampled_from([None, 80, 90, 100])),
                           ("gpu", st.sampled_from([None, "H200"])),
                           ("multicast", st.sampled_from([True, False, None])),
                           ("nvlink_all_pairs", st.booleans()), ("fabric", st.booleans()),
                           ("flashinfer", st.sampled_from([None, "0.6.13", "0.7.2.post1"]))):
        if draw(st.booleans()):
            data[name] = draw(strategy)
    valid: bool | None = True
    if draw(st.integers(0, 3)) == 0:  # break one thing
        key = draw(st.sampled_from(["device", "world_size", "hosts", "sm", "multicast",
                                    "bogus", "gpu"]))
        data[key] = draw(JSONISH)
        valid = None  # may or may not be valid: only the error class is judged
    return data, valid


@quick(500)
@given(topologies())
def test_topology_from_dict(drawn: tuple[dict[str, Any], bool | None]) -> None:
    data, valid = drawn
    FIGURES["topology_examples"] += 1
    try:
        topo = topology.Topology.from_dict(data)
    except (ValueError, TypeError):
        assert valid is not True, f"a valid topology was refused: {data}"
        return
    if valid:
        assert topo.world_size == data["world_size"]
        assert topo.node_count == len(set(data["hosts"]))
    assert isinstance(topo.world_size, int) and len(topo.hosts) == topo.world_size


@quick(200)
@given(st.one_of(st.binary(max_size=64), JSONISH.map(lambda v: json.dumps(v).encode()),
                 topologies().map(lambda d: json.dumps(d[0]).encode())))
def test_topology_files(content: bytes) -> None:
    import tempfile

    FIGURES["topology_file_examples"] += 1
    with tempfile.NamedTemporaryFile(suffix=".json") as handle:
        handle.write(content)
        handle.flush()
        try:
            topo = topology.load(handle.name)
        except ValueError as exc:
            assert handle.name in str(exc), str(exc)
            return
    assert len(topo.hosts) == topo.world_size


CLAUSE = st.builds(lambda b, p, r, m: f"{b}.{p}@{r}={m}",
                   st.sampled_from(["shm", "torch", "mnnvl", "trtllm"]),
                   st.sampled_from(["probe", "create", "validate", "call"]),
                   st.sampled_from(["*", "0", "1,2", "3"]),
                   st.sampled_from(["raise", "none", "null", "hang", "exit", "oom"]))


@quick(500)
@given(st.one_of(st.lists(CLAUSE, max_size=3).map("; ".join), st.text(max_size=30),
                 st.lists(st.sampled_from(["shm", ".", "@", "=", "*", "1", ",", ";", "raise",
                                           "create", " ", "-1"]), max_size=12).map("".join)))
def test_faults_parser(text: str) -> None:
    FIGURES["faults_examples"] += 1
    clauses = [c.strip() for c in text.split(";") if c.strip()]
    try:
        parsed = faults.parse(text)
    except ValueError as exc:
        assert "ARFUSE_FAULTS" in str(exc), str(exc)
        return
    assert len(parsed) == len(clauses)
    for clause, fault in zip(clauses, parsed, strict=True):
        target, mode = clause.split("=")
        where, ranks = target.split("@")
        backend, phase = where.split(".")
        assert (fault.backend, fault.phase, fault.mode) == (backend.strip(), phase.strip(),
                                                            mode.strip())
        want = None if ranks.strip() == "*" else frozenset(int(r) for r in ranks.split(","))
        assert fault.ranks == want
        assert mode.strip() != "null" or phase.strip() in ("create", "validate")


# --- the kernel's entries, called directly ------------------------------------------------------

KERNEL_FUZZ = textwrap.dedent('''
    import math, sys, traceback
    import torch
    from hypothesis import given, settings, HealthCheck, Phase, strategies as st
    sys.path.insert(0, sys.argv[2])
    from test_kernel_exact import kernel_on_private_memory
    from arfuse.result import FusedOutput
    log = open(sys.argv[1], "w")
    made = {}
    def comm_for(dtype):
        if dtype not in made:
            made[dtype] = kernel_on_private_memory(16, 32, dtype)
            if hasattr(made[dtype][0], "set_result_type"):
                made[dtype][0].set_result_type(FusedOutput)
        return made[dtype][0]
    DT = [torch.bfloat16, torch.float16, torch.float32]
    def tensor(draw, like_tokens, dtype):
        kind = draw(st.sampled_from(["none", "ok", "ok", "dtype", "hidden", "tokens", "1d",
                                     "noncontig", "empty", "huge_tokens", "int", "meta",
                                     "notatensor", "scalar"]))
        t, h = like_tokens, 32
        if kind == "none": return None
        if kind == "ok": return torch.randn(t, h).to(dtype)
        if kind == "dtype": return torch.randn(t, h, dtype=torch.float64)
        if kind == "hidden": return torch.randn(t, draw(st.sampled_from([1, 31, 33, 64, 4096])))
        if kind == "tokens": return torch.randn(t + draw(st.integers(1, 40)), h).to(dtype)
        if kind == "1d": return torch.randn(h).to(dtype)
        if kind == "noncontig": return torch.randn(h, t).to(dtype).t()
        if kind == "empty": return torch.empty(0, h, dtype=dtype)
        if kind == "huge_tokens": return torch.empty(100000, h, dtype=dtype)
        if kind == "int": return torch.zeros(t, h, dtype=torch.int32)
        if kind == "meta": return torch.empty(t, h, dtype=dtype, device="meta")
        if kind == "scalar": return torch.tensor(1.0)
        return [[1.0] * h] * t
    NUM = st.sampled_from([1e-6, 0.0, -1.0, float("nan"), float("inf"), 1e39, 10**400, True,
                           None, "x", torch.tensor([1.0, 2.0]), 2**70, -2**63])
    @settings(max_examples=int(sys.argv[3]), deadline=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data):
        draw = data.draw
        dtype = draw(st.sampled_from(DT))
        comm = comm_for(dtype)
        tokens = draw(st.integers(0, 20))
        x = tensor(draw, tokens, dtype)
        if x is None:
            x = torch.randn(tokens, 32).to(dtype)
        weight = tensor(draw, 1, dtype)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and len(weight) and draw(
                st.booleans()):
            weight = weight[0]
        args = [x, tensor(draw, tokens, dtype), weight, draw(NUM), draw(NUM),
                draw(st.sampled_from([None, "fp8", "nvfp4", "none", 7, "bogus"])), draw(NUM),
                draw(st.sampled_from(["linear", "swizzled_128x4", None, 3, "x"])),
                tensor(draw, tokens, dtype), tensor(draw, tokens, dtype)]
        if draw(st.booleans()):  # half the examples: valid but for at most one argument
            w = torch.rand(32).to(dtype) + 0.5
            fine = [torch.randn(tokens, 32).to(dtype), None, w, 1e-6, 0.0, None, 1.0, "linear",
                    None, None]
            if draw(st.booleans()):
                fine[1] = torch.randn(tokens, 32).to(dtype)
            fine[5] = draw(st.sampled_from([None, "fp8", "nvfp4"]))
            keep = draw(st.integers(0, 10))
            args = [a if i == keep else fine[i] for i, a in enumerate(args)]
        entry = draw(st.sampled_from(["call", "run", "op"]))
        handle = 0
        if entry in ("run", "op"):
            codes = {None: 0, "none": 0, "fp8": 1, "nvfp4": 2}  # the output codes
            args[5] = draw(st.sampled_from([codes.get(args[5], 0), 0, 1, 2, 3, 4, 5, -1, 2**40]))
            del args[7]  # the output code names the layout too
        if entry == "op":
            handle = draw(st.sampled_from([getattr(comm, "handle", 0), 0, -1, 12345]))
        shown = [type(a).__name__ + (str(tuple(a.shape)) + str(a.dtype)
                                     if hasattr(a, "shape") else repr(a)[:40]) for a in args]
        log.write(f"{entry} {shown}\\n")
        log.flush()
        try:
            if entry == "call":
                r = comm.call(*args)
            elif entry == "run":
                r = comm.run(*args)
            else:
                r = torch.ops.arfuse.shm_fused_allreduce(handle, *args)
            assert r is None or isinstance(r, (tuple, list)), type(r)
        except (AssertionError, SystemExit, KeyboardInterrupt):
            raise
        except Exception as exc:
            log.write(f"  -> {type(exc).__name__}: {str(exc)[:120]}\\n")
            return
        log.write("  -> " + ("None" if r is None else "result") + "\\n")
    try:
        comm_for(torch.bfloat16)
    except BaseException as exc:
        print("SKIP", type(exc).__name__, exc)
        sys.exit(77)
    fuzz()
    print("OK")
''')


def test_kernel_entries_with_bad_arguments(tmp_path: Path) -> None:
    """An exception or None, never a segfault (a crash ends the subprocess, not pytest)."""
    log = tmp_path / "kernel-fuzz.log"
    examples = 600
    proc = subprocess.run([sys.executable, "-c", KERNEL_FUZZ, str(log), str(ROOT / "tests"),
                           str(examples)], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "ARFUSE_LOG": "warning"})
    if proc.returncode == 77:
        pytest.skip(f"no compiled kernel: {proc.stdout.strip()}")
    lines = log.read_text().splitlines() if log.exists() else []
    tried = sum(1 for line in lines if not line.startswith("  ->"))
    FIGURES["kernel_examples"] += tried
    outcomes = Counter(line.split("->")[1].split(":")[0].strip() for line in lines
                       if line.startswith("  ->"))
    FIGURES.update({f"kernel_outcome_{k}": v for k, v in outcomes.items()})
    assert proc.returncode == 0, (
        f"the kernel fuzz process ended with {proc.returncode} (negative: killed by a signal) "
        f"after {tried} calls; last call: {lines[-1] if lines else '-'}\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
