"""Properties of ``resolve`` over random topologies, settings and specs (hypothesis)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from arfuse import catalog
from arfuse.policy import resolve
from arfuse.settings import Settings, backend_choices
from arfuse.spec import Spec
from arfuse.topology import Topology


@st.composite
def topologies(draw: st.DrawFn) -> Topology:
    device = draw(st.sampled_from(["cpu", "cuda"]))
    world = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 16, 17, 32, 64, 128]))
    nodes = draw(st.integers(1, min(world, 4)))
    hosts = tuple(f"n{(r * nodes) // world}" for r in range(world))
    maybe_bool = st.sampled_from([True, False, None])
    return Topology(
        device=device,
        world_size=world,
        hosts=hosts,
        sm=draw(st.sampled_from([None, 80, 89, 90, 100, 103, 120])) if device == "cuda" else None,
        multicast=draw(maybe_bool),
        nvlink_all_pairs=draw(maybe_bool),
        fabric=draw(maybe_bool),
        flashinfer=draw(st.sampled_from([None, "0.6.12", "0.6.13", "0.6.17", "0.7.2.post1"])),
    )


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    dtype = draw(st.sampled_from(["bf16", "fp16", "fp32"]))
    quant = draw(st.sampled_from([None, "fp8", "nvfp4"]))
    if quant == "nvfp4" and dtype == "fp32":
        quant = "fp8"
    hidden = draw(st.integers(1, 9000))
    if quant == "nvfp4":
        hidden = max(16, hidden // 16 * 16)
    return Spec(max_tokens=draw(st.integers(1, 16384)), hidden=hidden, dtype=dtype, quant=quant)


def safe_resolve(conf: Settings, topo: Topology, spec: Spec):
    try:
        return resolve(conf, topo, spec)
    except ValueError:
        return None


@settings(max_examples=600, deadline=None)
@given(topologies(), specs(), st.sampled_from(backend_choices()), st.booleans())
def test_plan_invariants(topo: Topology, spec: Spec, backend: str, strict: bool) -> None:
    conf = Settings(backend=backend, strict=strict)
    plan = safe_resolve(conf, topo, spec)
    if plan is None:
        # Only two things are resolve-time errors: trtllm across nodes, and strict with nothing.
        assert (backend == "trtllm" and topo.node_count > 1) or strict
        return
    names = [c.backend for c in plan.candidates]
    # torch is always last, and viable unless strict forbids the unfused path
    assert names[-1] == "torch"
    assert plan.candidate("torch").viable == (not strict or backend == "torch")
    # explicit never yields a different fused backend
    if backend != "auto":
        assert plan.backend in (backend, "torch")
        assert set(names) <= {backend, "torch"}
        assert plan.allow_fallback is False
    # trtllm is never viable across nodes
    if topo.node_count > 1:
        assert "trtllm" not in plan.viable
    # every viable candidate meets its hard requirements; every non-viable one says why
    for cand in plan.candidates:
        if cand.viable:
            assert catalog.get(cand.backend).unmet(topo, spec) == ""
        assert cand.reason
    # the chosen backend is the first viable candidate
    assert plan.backend == plan.viable[0]
    assert plan.fused == (plan.backend in catalog.fused_names())
    # allow_fallback: auto with more than one fused candidate left
    fused_left = [b for b in plan.viable if b in catalog.fused_names()]
    assert plan.allow_fallback == (backend == "auto" and len(fused_left) > 1)
    # R3: auto never picks trtllm without NVLink between all pairs
    if backend == "auto" and not topo.nvlink_all_pairs:
        assert "trtllm" not in plan.viable
    # capacity and bytes are consistent with fusion
    if plan.fused:
        assert plan.workspace_bytes > 0 and 0 < plan.max_fused_tokens <= spec.max_tokens
    else:
        assert plan.workspace_bytes == 0 and plan.max_fused_tokens == 0
    if not spec.quant:
        assert plan.quant_fusion is False


@settings(max_examples=200, deadline=None)
@given(topologies(), specs(), st.sampled_from(backend_choices()))
def test_same_inputs_same_plan(topo: Topology, spec: Spec, backend: str) -> None:
    conf = Settings(backend=backend)
    first = safe_resolve(conf, topo, spec)
    again = safe_resolve(Settings(backend=backend), replace(topo), replace(spec))
    assert first == again


@settings(max_examples=200, deadline=None)
@given(topologies())
def test_topology_json_round_trip(topo: Topology) -> None:
    back = Topology.from_dict(topo.to_dict())
    # unknown capabilities (None) are written as null and read back as the safe value, False
    assert back.node_count == topo.node_count and back.world_size == topo.world_size
    for name in ("multicast", "nvlink_all_pairs", "fabric"):
        assert getattr(back, name) == bool(getattr(topo, name))
