"""Adding a backend touches one new module and one registration: a stub backend, defined here,
is registered and then appears in settings, fault injection, the policy, ``explain`` and a real
negotiation, with no other change to arfuse."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

import arfuse
from arfuse import catalog, faults, settings
from arfuse.backends.base import Backend, Workspace
from arfuse.call_checks import CallArgs
from arfuse.catalog import BackendDescriptor, Footprint
from arfuse.epilogue import apply
from arfuse.result import FusedOutput
from arfuse.spec import Spec
from arfuse.topology import Topology

# --- the whole stub backend: a descriptor and an implementation --------------------------------


class StubWorkspace(Workspace):
    backend = "stub"

    def validate(self) -> None:
        """Nothing shared to check in a one-process stub."""

    poisoned = False

    def poison(self) -> None:
        self.poisoned = True

    def run(self, call: CallArgs) -> FusedOutput:  # every rank holds the same x
        return apply(call.x.float() * (0 if self.poisoned else self.ctx.world_size), call)

    def _free(self) -> None:
        """Nothing allocated."""


class StubBackend(Backend):
    name = "stub"

    def create(self, ctx: object, spec: Spec) -> Workspace | None:
        return StubWorkspace(ctx, spec, nbytes=123, capacity=spec.max_tokens)


def stub_unmet(topology: Topology, spec: Spec) -> str:
    return "" if spec.hidden <= 1024 else f"hidden {spec.hidden} over the stub's 1024"


STUB = BackendDescriptor(
    name="stub", fused=True, devices=("cpu",), auto_rank=-1,
    implementation=f"{__name__}:StubBackend", unmet=stub_unmet,
    footprint=lambda world, spec, topology: Footprint(123, spec.max_tokens))

# -------------------------------------------------------------------------------------------------


@pytest.fixture
def stub() -> Iterator[BackendDescriptor]:
    catalog.register(STUB)
    try:
        yield STUB
    finally:
        catalog.unregister("stub")


def test_registration_reaches_settings_faults_and_the_policy(stub: BackendDescriptor) -> None:
    assert "stub" in settings.backend_choices() and "stub" in catalog.fused_names()
    assert settings.Settings(backend="stub").backend == "stub"
    assert faults.parse("stub.create@0=raise")[0].backend == "stub"
    topo = Topology(device="cpu", world_size=2)
    plan = arfuse.resolve(settings.Settings(), topo, Spec(max_tokens=8, hidden=64))
    assert plan.viable[:2] == ("stub", "shm") and plan.backend == "stub"  # auto_rank -1: first
    assert plan.workspace_bytes == 123
    big = arfuse.resolve(settings.Settings(), topo, Spec(max_tokens=8, hidden=2048))
    assert big.candidate("stub").reason == "hidden 2048 over the stub's 1024"


def test_explain_lists_the_stub(stub: BackendDescriptor, capsys: pytest.CaptureFixture[str],
                                tmp_path: object) -> None:
    from arfuse.cli import main

    assert main(["explain", "--world-size", "2", "--hidden", "64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["backend"] == "stub"
    assert [c["backend"] for c in plan["candidates"]] == ["stub", "shm", "hier", "torch"]
    assert main(["explain", "--backend", "stub", "--world-size", "2", "--hidden", "64"]) == 0
    assert "chosen: stub (fused)" in capsys.readouterr().out


def test_a_real_negotiation_creates_and_runs_the_stub(stub: BackendDescriptor) -> None:
    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=64, dtype=torch.float32,
                                 backend="stub")
    assert comm.backend == "stub" and comm.workspace.nbytes == 123
    x = torch.full((2, 64), 3.0)
    assert torch.equal(comm(x).out, x)
    assert comm.stats()["fused"] == 1
    comm.close()


def test_names_are_checked_and_builtins_stay() -> None:
    with pytest.raises(ValueError, match="already registered"):
        catalog.register(catalog.get("shm"))
    with pytest.raises(ValueError, match="not valid"):
        catalog.register(BackendDescriptor(name="auto", fused=True, devices=("cpu",),
                                           implementation="x:y"))
    with pytest.raises(ValueError, match="built in"):
        catalog.unregister("torch")
