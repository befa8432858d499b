"""The same bytes on every machine: every pattern and quantisation of the numerics matrix
(``test_isa_paths``: every dtype, odd and even hidden sizes, NaN, infinities, -0, denormals) on
inputs built from integer bits, whose outputs' digests were recorded on x86
(``cross_machine_digests.json``), and the MoE expert step's, are checked on every instruction
set this machine runs:
on x86 (AVX-512, AVX2, scalar) here, on aarch64 (NEON, scalar) by ``scripts/arm_check.sh``
under emulation. ``torch.randn`` gives other values on aarch64 for vectorised sizes, so the
inputs come from an integer hash, the same on every machine; the outputs are also checked
against the reference here.

``python tests/test_cross_machine.py --record`` writes the digests from this machine's build
(on x86: after a change that is meant to change the bytes).
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_isa_paths import (
    DTYPES,
    HIDDENS,
    INT_VIEW,
    ISAS,
    SPECIALS,
    TOKENS,
    built_for,
    call_kwargs,
    check_against_reference,
    patterns,
)

from arfuse.backends.shm import build as shm_build

from harness import run_ranks, values

RECORD = Path(__file__).with_name("cross_machine_digests.json")
WORLD = 2
_MASK = 0xFFFFFFFF


def hashed(count: int, seed: int) -> torch.Tensor:
    """``count`` pseudo-random 32-bit words (int64), integer arithmetic only (every product
    below 2**63): the same on every machine."""
    x = (torch.arange(count, dtype=torch.int64) + (seed << 20)) & _MASK
    for multiplier in (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39):
        x = ((x ^ (x >> 16)) * multiplier) & _MASK
    return x ^ (x >> 16)


def values_of(dtype: str, words: torch.Tensor, exponents: tuple[int, int]) -> torch.Tensor:
    """Elements of ``dtype`` from random words: a random sign and mantissa, the biased
    exponent in ``exponents`` (low, count; low 0 and count 1: denormals and zeros)."""
    low, count = exponents
    sign = words >> 31
    if dtype == "fp16":
        bits = (sign << 15) | ((low + (words >> 10) % count) << 10) | (words & 0x3FF)
        return bits.to(torch.int16).view(torch.float16)
    bits = (sign << 31) | ((low + (words >> 23) % count) << 23) | (words & 0x7FFFFF)
    as_f32 = (bits - ((bits >> 31) << 32)).to(torch.int32)
    if dtype == "fp32":
        return as_f32.view(torch.float32)
    return (as_f32 >> 16).to(torch.int16).view(torch.bfloat16)


def integer_floats(size: tuple[int, ...], seed: int) -> torch.Tensor:
    """fp32 values of 1/8 to 16, either sign, from integer bits."""
    count = 1
    for n in size:
        count *= n
    return values_of("fp32", hashed(count, seed), (124, 8)).reshape(size)


def quiet_nans(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every NaN the positive quiet NaN of its dtype, set as integer bits: torch's
    conversions make NaNs by the machine (x86 turns fp32's into bf16 0xffff, aarch64 0x7fc0)."""
    view = INT_VIEW[{torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[
        t.dtype]]
    bits = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000}[t.dtype]
    out = t.clone()
    out.view(view)[torch.isnan(t)] = bits
    return out


def integer_inputs(dtype: str, hidden: int, world: int) -> dict[str, Any]:
    """Every rank's x, the residual and the weight, as ``test_isa_paths.case_inputs`` lays
    them out (rows 0-1 ordinary values of 1/8 to 16, row 2 denormals, specials in rows 3-6)
    but built from integer bits."""
    normal = (124, 8) if dtype != "fp16" else (12, 5)
    n = TOKENS * hidden
    xs = []
    specials = SPECIALS[dtype]
    bits = 16 if dtype != "fp32" else 32
    for rank in range(world):
        x = values_of(dtype, hashed(n, 3 * hidden + rank), normal).reshape(TOKENS, hidden)
        x[2] = values_of(dtype, hashed(hidden, 5000 + hidden + rank), (0, 1))
        raw = x.view(INT_VIEW[dtype])
        for k in range(2 * len(specials)):
            value = specials[(k + rank) % len(specials)]
            raw[3 + k % 4, (5 * k + 3) % hidden] = value - (1 << bits) if value >> (bits - 1) \
                else value
        xs.append(x)
    residual = values_of(dtype, hashed(n, 7000 + hidden), normal).reshape(TOKENS, hidden)
    residual[2] = values_of(dtype, hashed(hidden, 9000 + hidden), (0, 1))
    weight_exponents = (126, 2) if dtype != "fp16" else (14, 2)  # 0.5 to 2
    weight = values_of(dtype, hashed(hidden, 11000 + hidden), weight_exponents).abs()
    return {"xs": xs, "residual": residual, "weight": weight}


def digest(outputs: tuple[torch.Tensor | None, ...]) -> str:
    h = hashlib.sha256()
    for t in outputs:
        h.update(b"-" if t is None else t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]


def _bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.new_empty(t.shape).copy_(t).view(torch.uint8)


MODES = ("oneshot", "twoshot")


def outputs_of_every_case(rank: int, world: int) -> dict[str, Any]:
    """This rank's outputs (raw bytes) of every case in each mode, by
    ``mode/dtype/hidden/pattern`` (both modes in one process: a process costs most of the
    time under emulation)."""
    import arfuse

    module = shm_build.load()
    report: dict[str, Any] = {"isa": "pure-torch" if module is None else str(module.isa)}
    for dtype in DTYPES:
        for hidden in HIDDENS:
            data = integer_inputs(dtype, hidden, world)
            comm = arfuse.FusedAllReduce(max_token_num=TOKENS, hidden_dim=hidden,
                                         dtype=DTYPES[dtype], backend="shm", strict=True,
                                         timeout_s=60)
            for mode in MODES:
                comm.workspace.set_mode(mode)  # type: ignore[attr-defined]
                for pattern in patterns(dtype, hidden):
                    res = comm(data["xs"][rank], **call_kwargs(pattern, data))
                    padded = (*res, None, None, None)[:4]
                    report[f"{mode}/{dtype}/{hidden}/{pattern}"] = tuple(_bytes(t)
                                                                         for t in padded)
            comm.close()
    return report


def run_isa(isa: str) -> list[dict[str, Any]]:
    return values(run_ranks(outputs_of_every_case, WORLD, timeout=300,
                            env={"ARFUSE_SHM_ISA": isa}))


def test_the_inputs_are_built_from_integers_only() -> None:
    """The builder gives fixed bits (a change would orphan the recorded digests), denormals
    in row 2 and ordinary values elsewhere."""
    assert hashed(4, 0).tolist() == hashed(4, 0).tolist() != hashed(4, 1).tolist()
    data = integer_inputs("bf16", 37, WORLD)
    x = data["xs"][0].float()
    assert torch.all((x[:2].abs() >= 0.125) & (x[:2].abs() < 32))
    assert torch.all(x[2].abs() < 2.0**-126)
    assert torch.isnan(data["xs"][1][3:]).any() and not torch.isnan(data["weight"]).any()
    assert RECORD.exists(), "record the digests on x86: python tests/test_cross_machine.py --record"


@pytest.mark.parametrize("isa", ISAS)
def test_every_case_gives_the_bytes_recorded_on_x86(isa: str) -> None:
    record = json.loads(RECORD.read_text())
    want = record["digests"]
    ranks = run_isa(isa)
    assert all(built_for(isa, r["isa"]) for r in ranks), [r["isa"] for r in ranks]
    for mode in MODES:
        cases = [key.split("/", 1)[1] for key in ranks[0] if key.startswith(f"{mode}/")]
        assert sorted(cases) == sorted(want), "the matrix changed: record the digests again"
        differ = []
        for key in cases:
            got = {digest(r[f"{mode}/{key}"]) for r in ranks}
            assert len(got) == 1, f"{mode} {key}: the ranks differ"
            if got.pop() != want[key]:
                differ.append(key)
        assert not differ, (f"{isa} {mode} on {platform.machine()}: {len(differ)} of "
                            f"{len(cases)} cases differ from {record['recorded_on']}: {differ}")
    if isa == ISAS[0]:  # the recorded bytes are the reference's
        for key in want:
            dtype, hidden, pattern = key.split("/")
            check_against_reference(dtype, int(hidden), WORLD, pattern, ranks[0][f"oneshot/{key}"],
                                    integer_inputs(dtype, int(hidden), WORLD))


def moe_digests(isa: str) -> tuple[str, dict[str, str]]:
    """The MoE expert step's outputs (finalize, reduce: test_moe's case matrix) on integer
    inputs, by case, from a process of ``isa``; on x86 each also equals torch's reference."""
    from test_moe import kernel_moe_bytes, same_bytes

    found = values(run_ranks(kernel_moe_bytes, 1, True, init=False,
                             env={"ARFUSE_SHM_ISA": isa}))[0]
    cases = {case: pair for case, pair in found.items() if case != "isa"}
    if shm_build.ARCH == "x86_64":  # torch's NaNs are the kernel's rule here
        assert all(same_bytes(*pair) for pair in cases.values())
    return str(found["isa"]), {case: digest((got,)) for case, (got, _) in cases.items()}


@pytest.mark.parametrize("isa", ISAS)
def test_the_moe_expert_step_gives_the_bytes_recorded_on_x86(isa: str) -> None:
    record = json.loads(RECORD.read_text())
    name, got = moe_digests(isa)
    assert built_for(isa, name), name
    assert sorted(got) == sorted(record["moe"]), "the MoE cases changed: record again"
    differ = [case for case, d in got.items() if d != record["moe"][case]]
    assert not differ, (f"{isa} on {platform.machine()}: {len(differ)} of {len(got)} MoE "
                        f"cases differ from {record['recorded_on']}: {differ}")


def record() -> None:
    ranks = run_isa(ISAS[0])
    digests = {key.split("/", 1)[1]: digest(value) for key, value in ranks[0].items()
               if key.startswith("oneshot/")}
    _, moe = moe_digests(ISAS[0])
    RECORD.write_text(json.dumps({"recorded_on": f"{platform.machine()} {ranks[0]['isa']}",
                                  "digests": dict(sorted(digests.items())),
                                  "moe": dict(sorted(moe.items()))}, indent=1) + "\n")
    print(f"{len(digests)} + {len(moe)} digests written to {RECORD}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: python tests/test_cross_machine.py --record")
    record()
