"""The decision table of DESIGN 3.3, row by row, and vLLM's resolution rules it keeps."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from arfuse import negotiate
from arfuse.backends.flashinfer import version_tuple
from arfuse.policy import resolve
from arfuse.settings import Settings
from arfuse.spec import Spec
from arfuse.topology import Topology

NVSWITCH = Topology(device="cuda", world_size=8, hosts=("n0",) * 8, sm=90, gpu="H200",
                    multicast=True, nvlink_all_pairs=True, fabric=False, flashinfer="0.6.13")
SPEC = Spec(max_tokens=2048, hidden=4096, dtype="bf16")


def plan(topo: Topology = NVSWITCH, backend: str = "auto", spec: Spec = SPEC, strict: bool = False):
    return resolve(Settings(backend=backend, strict=strict), topo, spec)


def reasons(p) -> dict[str, str]:
    return {c.backend: c.reason for c in p.candidates}


# --- vLLM's rules: mnnvl first, trtllm only on one node, explicit never falls back ---------


def test_auto_on_one_node_tries_mnnvl_then_trtllm() -> None:
    p = plan()
    assert [c.backend for c in p.candidates] == ["mnnvl", "trtllm", "torch"]
    assert p.backend == "mnnvl" and p.viable == ("mnnvl", "trtllm", "torch")
    assert p.allow_fallback is True and p.fused and not p.explicit


def test_auto_across_nodes_tries_mnnvl_without_trtllm() -> None:
    topo = replace(NVSWITCH, world_size=16, hosts=("a",) * 8 + ("b",) * 8, fabric=True)
    p = plan(topo)
    assert p.backend == "mnnvl"
    assert p.viable == ("mnnvl", "torch")
    assert "single node only" in reasons(p)["trtllm"]
    assert p.allow_fallback is False


@pytest.mark.parametrize("backend", ["mnnvl", "trtllm"])
def test_an_explicit_backend_never_falls_back_to_another_fused_one(backend: str) -> None:
    p = plan(backend=backend)
    assert [c.backend for c in p.candidates] == [backend, "torch"]
    assert p.backend == backend and p.explicit and p.allow_fallback is False


def test_explicit_trtllm_across_nodes_is_a_value_error() -> None:
    topo = replace(NVSWITCH, world_size=16, hosts=("a",) * 8 + ("b",) * 8)
    with pytest.raises(ValueError, match="use 'mnnvl'"):
        plan(topo, backend="trtllm")


# --- every row: hard requirements -------------------------------------------------------------

MNNVL_ROWS = [
    ({"device": "cpu", "sm": None}, "needs CUDA"),
    ({"flashinfer": None}, "flashinfer is not importable"),
    ({"flashinfer": "0.6.12"}, "older than 0.6.13"),
    ({"sm": None}, "compute capability unknown"),
    ({"sm": 80}, "SM 80 not supported"),
    ({"sm": 120}, "SM 120 not supported"),
    ({"world_size": 6, "hosts": ("n0",) * 6}, "world size 6"),
    ({"multicast": False}, "no NVSwitch multicast"),
    ({"multicast": None}, "multicast unknown"),
    ({"world_size": 16, "hosts": ("a",) * 8 + ("b",) * 8, "fabric": False},
     "without an MNNVL fabric"),
]


@pytest.mark.parametrize(("change", "why"), MNNVL_ROWS)
def test_mnnvl_requirements(change: dict, why: str) -> None:
    p = plan(replace(NVSWITCH, **change), backend="mnnvl")
    assert not p.candidate("mnnvl").viable
    assert why in p.candidate("mnnvl").reason
    assert p.backend == "torch" and any(why in w for w in p.warnings)


@pytest.mark.parametrize("world", [2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("sm", [90, 100, 103])
def test_mnnvl_viable_sizes_and_sms(world: int, sm: int) -> None:
    p = plan(replace(NVSWITCH, world_size=world, hosts=("n0",) * world, sm=sm))
    assert p.candidate("mnnvl").viable and p.backend == "mnnvl"


def test_mnnvl_hidden_alignment() -> None:
    p = plan(spec=Spec(max_tokens=16, hidden=4100, dtype="bf16"))  # 8200 bytes, not 16-aligned
    assert not p.candidate("mnnvl").viable and "multiple of 16" in p.candidate("mnnvl").reason
    assert plan(spec=Spec(max_tokens=16, hidden=4100, dtype="fp32")).candidate("mnnvl").viable


TRTLLM_ROWS = [
    ({"device": "cpu", "sm": None}, "needs CUDA"),
    ({"flashinfer": None}, "not importable"),
    ({"sm": 80}, "SM 80 not supported"),
    ({"sm": 120, "flashinfer": "0.6.13"}, "SM 120 not supported"),
    ({"world_size": 32, "hosts": ("n0",) * 32}, "world size 32"),
    ({"world_size": 3, "hosts": ("n0",) * 3}, "world size 3"),
]


@pytest.mark.parametrize(("change", "why"), TRTLLM_ROWS)
def test_trtllm_requirements(change: dict, why: str) -> None:
    p = plan(replace(NVSWITCH, **change), backend="trtllm")
    assert not p.candidate("trtllm").viable and why in p.candidate("trtllm").reason
    assert p.backend == "torch"


def test_trtllm_sm12x_from_0_6_17() -> None:
    topo = replace(NVSWITCH, sm=120, multicast=False, flashinfer="0.6.17")
    assert plan(topo, backend="trtllm").backend == "trtllm"
    assert plan(topo).backend == "trtllm"  # auto: mnnvl not viable on SM 120


def test_auto_skips_trtllm_without_nvlink_between_all_pairs() -> None:
    """R3 / vLLM #48071: NVLink bridges, no multicast -> unfused, not the 34x-slower trtllm."""
    topo = replace(NVSWITCH, multicast=False, nvlink_all_pairs=False)
    p = plan(topo)
    assert p.backend == "torch" and not p.fused
    assert "NVLink between all pairs" in reasons(p)["trtllm"]
    assert any("unfused" in w for w in p.warnings)
    # explicit trtllm is still honoured: the user asked for it
    assert plan(topo, backend="trtllm").backend == "trtllm"


def test_auto_trtllm_when_mnnvl_not_viable_on_one_node() -> None:
    p = plan(replace(NVSWITCH, multicast=False))
    assert p.backend == "trtllm" and p.allow_fallback is False


def test_auto_on_cpu() -> None:
    cpu = Topology(device="cpu", world_size=2, hosts=("h", "h"))
    p = plan(cpu)
    assert [c.backend for c in p.candidates] == ["shm", "hier", "torch"]
    assert p.backend == "shm" and p.fused and p.allow_fallback is False


@pytest.mark.parametrize(("topo", "why"), [
    (Topology(device="cpu", world_size=1), "world size 1"),
    (Topology(device="cpu", world_size=17), "world size 17"),
    (Topology(device="cpu", world_size=4, hosts=("a", "a", "b", "b")), "single node only"),
    (NVSWITCH, "needs CPU tensors"),
])
def test_shm_requirements(topo: Topology, why: str) -> None:
    p = plan(topo, backend="shm")
    assert not p.candidate("shm").viable and why in p.candidate("shm").reason
    assert p.backend == "torch"


def test_torch_always_last_and_viable() -> None:
    for topo in (NVSWITCH, Topology(device="cpu", world_size=1)):
        p = plan(topo, backend="torch")
        assert [c.backend for c in p.candidates] == ["torch"]
        assert p.backend == "torch" and not p.fused and p.workspace_bytes == 0


def test_strict_removes_unfused_fallback() -> None:
    with pytest.raises(ValueError, match="ARFUSE_STRICT=1"):
        plan(replace(NVSWITCH, multicast=False), backend="mnnvl", strict=True)
    p = plan(strict=True)
    assert p.backend == "mnnvl" and not p.candidate("torch").viable
    assert plan(backend="torch", strict=True).backend == "torch"


# --- quantisation is not a viability requirement -------------------------------------------------


@pytest.mark.parametrize(("topo_change", "backend", "quant", "dtype", "fused"), [
    ({}, "mnnvl", "fp8", "bf16", True),
    ({"flashinfer": "0.6.13"}, "mnnvl", "nvfp4", "bf16", False),  # SM 90: no NVFP4
    ({"sm": 100}, "mnnvl", "nvfp4", "bf16", True),
    ({}, "trtllm", "fp8", "bf16", True),
    ({"sm": 100}, "trtllm", "nvfp4", "fp16", True),
    ({"sm": 90}, "trtllm", "nvfp4", "bf16", False),
    ({}, "trtllm", None, "bf16", False),
])
def test_quant_fusion(topo_change: dict, backend: str, quant: str | None, dtype: str,
                      fused: bool) -> None:
    p = plan(replace(NVSWITCH, **topo_change), backend=backend,
             spec=Spec(max_tokens=128, hidden=4096, dtype=dtype, quant=quant))
    assert p.backend == backend and p.quant_fusion is fused
    if quant and not fused:
        assert any("separate step" in w for w in p.warnings)


def test_shm_fuses_both_quant_patterns() -> None:
    cpu = Topology(device="cpu", world_size=2)
    for quant in ("fp8", "nvfp4"):
        assert plan(cpu, spec=Spec(max_tokens=8, hidden=64, quant=quant)).quant_fusion


# --- sizing ------------------------------------------------------------------------------------


def test_workspace_predictions() -> None:
    p = plan(backend="trtllm")
    # 4*tp*S in three IPC buffers (FlashInfer 0.6.13, bf16), each with its allocator's signal
    # pad rounded to the 2 MiB granularity: +2 MiB on each of the two large ones and the flags
    assert p.workspace_bytes == 4 * 8 * 2048 * 4096 * 2 + 3 * 2**21
    m = plan()
    assert m.workspace_bytes > 0 and 0 < m.max_fused_tokens <= 2048
    cpu = plan(Topology(device="cpu", world_size=2))
    assert cpu.max_fused_tokens == 2048 and cpu.workspace_bytes >= 2048 * 4096 * 2


def test_mnnvl_capacity_is_the_backends_own_answer() -> None:
    """vLLM #50877: triple buffering; capacity counts what fits one buffer in the real mode."""
    from arfuse.backends import flashinfer

    spec = Spec(max_tokens=2048, hidden=4096, dtype="bf16")
    buffer = flashinfer.mnnvl_buffer_bytes(8, spec)
    cap = flashinfer.mnnvl_footprint(8, spec, Topology(device="cuda", world_size=8)).capacity
    assert flashinfer.mnnvl_need(8, cap, 4096 * 2) <= buffer
    assert cap == spec.max_tokens or flashinfer.mnnvl_need(8, cap + 1, 4096 * 2) > buffer


def test_version_tuple() -> None:
    assert version_tuple("0.6.13.post1") == (0, 6, 13)
    assert version_tuple("0.7.0rc1+cu128") == (0, 7, 0)
    assert version_tuple(None) == ()
    assert version_tuple("junk") == ()


def test_explain_mentions_every_candidate() -> None:
    text = plan(spec=Spec(max_tokens=64, hidden=4096, quant="fp8")).explain()
    for word in ("mnnvl", "trtllm", "torch", "MiB", "capacity", "fp8"):
        assert word in text


def test_unknown_facts_are_explained_but_decide_nothing() -> None:
    """A fact some rank could not read is treated as absent (the rules do not change); the plan
    carries why, for ``explain`` and ``explain --json``."""
    why = {"multicast": "rank 3: cuda-python not installed",
           "nvlink_all_pairs": "ranks 0-7: nvidia-ml-py not installed"}
    unknown = replace(NVSWITCH, multicast=None, nvlink_all_pairs=None, unknown=why)
    absent = replace(NVSWITCH, multicast=None, nvlink_all_pairs=None)
    told, silent = plan(unknown), plan(absent)
    assert told.candidates == silent.candidates and told.backend == silent.backend == "torch"
    assert dict(told.unknown_facts) == why and silent.unknown_facts == ()
    text = told.explain()
    assert "unknown facts (treated as absent):" in text
    assert "  multicast: rank 3: cuda-python not installed" in text
    assert "  nvlink_all_pairs: ranks 0-7: nvidia-ml-py not installed" in text
    assert "unknown facts" not in silent.explain()
    assert told.to_dict()["unknown_facts"] == why
    assert "unknown_facts" not in silent.to_dict()


def test_a_topology_file_of_another_group_size_is_refused() -> None:
    topo = Topology(world_size=2)
    topo.check_rank_count(2, "group")
    with pytest.raises(ValueError, match="describes world_size=2 but the group has 3 ranks"):
        topo.check_rank_count(3, "group")
    # negotiation reads only the group's size from its context
    group_of_three = SimpleNamespace(world_size=3)
    payloads = [{"file_topology": topo.to_dict(), "facts": None}] * 3
    with pytest.raises(ValueError, match="but the group has 3 ranks"):
        negotiate.topology_of(group_of_three, payloads)  # type: ignore[arg-type]


def test_auto_on_cpu_hosts_picks_hier_with_its_layout() -> None:
    two = Topology(device="cpu", world_size=4, hosts=("a", "a", "b", "b"))
    p = plan(two)
    assert p.backend == "hier" and "2 hosts x 2 ranks" in p.explain()
    uneven = plan(Topology(device="cpu", world_size=3, hosts=("a", "a", "b")))
    assert uneven.backend == "torch"
    assert "different numbers of ranks" in {c.backend: c.reason
                                            for c in uneven.candidates}["hier"]
    one_each = plan(Topology(device="cpu", world_size=2, hosts=("a", "b")))
    assert one_each.backend == "hier"
