"""GPU fact detection (``arfuse.gpu_facts``) and how ``topology.merge`` combines every rank's facts.

There is no GPU here, so NVML and the CUDA driver are replaced by stand-ins at the level of
their Python APIs: ``FakeNvml`` stands in for nvidia-ml-py's ``pynvml`` module (same function,
constant, exception and ctypes-structure names as pynvml 13.x), ``FakeDriver`` for cuda-python's
``cuda.bindings.driver`` (same call shapes: a tuple whose first item is a ``CUresult``). Both
are injected into ``sys.modules`` with monkeypatch; what ``local_facts`` asks torch
(is_available, current_device, get_device_capability, get_device_name, get_device_properties)
is patched too. What the stand-ins cannot prove (that a real driver answers as they do) is left
to a GPU machine.
"""

from __future__ import annotations

import ctypes
import enum
import json
import subprocess
import sys
import types
import uuid
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from arfuse import gpu_facts, topology
from arfuse.policy import resolve
from arfuse.settings import Settings
from arfuse.spec import Spec
from arfuse.topology import LocalFacts, Topology, merge

ROOT = Path(__file__).resolve().parent.parent
UUIDS = [f"GPU-{i:08x}-1111-2222-3333-44444444444{i}" for i in range(8)]
CLUSTER = uuid.UUID("6f1c0d2e-0000-4000-8000-00000000beef")


# --- the NVML stand-in --------------------------------------------------------------------------


class NVMLError(Exception):
    """pynvml.NVMLError: carries the NVML return code; str() is NVML's text for it."""

    TEXT: ClassVar[dict[int, str]] = {3: "Not Supported", 9: "Driver Not Loaded",
                                      12: "NVML Shared Library Not Found", 999: "Unknown Error"}

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self.TEXT.get(self.value, f"NVML Error with code {self.value}")


class NVMLError_NotSupported(NVMLError):
    def __init__(self) -> None:
        super().__init__(3)


class c_nvmlGpuFabricInfo_v2_t(ctypes.Structure):
    """pynvml.c_nvmlGpuFabricInfoV_t (= c_nvmlGpuFabricInfo_v2_t), same fields."""

    _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_uint8 * 16),
                ("status", ctypes.c_int), ("cliqueId", ctypes.c_uint32),
                ("state", ctypes.c_uint), ("healthMask", ctypes.c_uint32)]


class c_nvmlGpuFabricInfo_t(ctypes.Structure):
    _fields_ = [("clusterUuid", ctypes.c_uint8 * 16), ("status", ctypes.c_int),
                ("cliqueId", ctypes.c_uint32), ("state", ctypes.c_uint)]


FABRIC_OK = (3, 0, CLUSTER.bytes, 7)   # state COMPLETED, status NVML_SUCCESS, cluster, clique


class FakeNvml(types.ModuleType):
    """Stand-in for nvidia-ml-py's ``pynvml`` (its Python API, not the C library): ``count``
    GPUs with ``UUIDS``; ``links`` the NVLink-connected pairs of NVML indices (default: all);
    ``fabric`` what nvmlDeviceGetGpuFabricInfoV fills in, or an exception it raises."""

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    c_nvmlGpuFabricInfoV_t = c_nvmlGpuFabricInfo_v2_t
    c_nvmlGpuFabricInfo_t = c_nvmlGpuFabricInfo_t
    NVML_SUCCESS = 0
    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0
    NVML_P2P_STATUS_NOT_SUPPORTED = 5
    NVML_GPU_FABRIC_STATE_NOT_SUPPORTED = 0
    NVML_GPU_FABRIC_STATE_NOT_STARTED = 1
    NVML_GPU_FABRIC_STATE_IN_PROGRESS = 2
    NVML_GPU_FABRIC_STATE_COMPLETED = 3

    def __init__(self, count: int = 8, links: set[frozenset[int]] | None = None,
                 fabric: tuple[int, int, bytes, int] | Exception = FABRIC_OK,
                 init_error: Exception | None = None,
                 p2p_error: Exception | None = None) -> None:
        super().__init__("pynvml")
        self.count = count
        self.links = (links if links is not None else
                      {frozenset((a, b)) for a in range(count) for b in range(a + 1, count)})
        self.fabric = fabric
        self.init_error = init_error
        self.p2p_error = p2p_error
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < self.count:
            raise NVMLError(2)
        return 1000 + index  # an opaque handle

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return UUIDS[handle - 1000]

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        assert index == self.NVML_P2P_CAPS_INDEX_NVLINK
        self.calls.append(f"p2p {a - 1000}-{b - 1000}")
        if self.p2p_error is not None:
            raise self.p2p_error
        linked = frozenset((a - 1000, b - 1000)) in self.links
        return self.NVML_P2P_STATUS_OK if linked else self.NVML_P2P_STATUS_NOT_SUPPORTED

    def _fill_fabric(self, info_ref: Any) -> int:
        self.calls.append("fabric")
        if isinstance(self.fabric, Exception):
            raise self.fabric
        info = info_ref._obj  # what ctypes.byref points at, as the C library would write it
        info.state, info.status, raw, info.cliqueId = self.fabric
        ctypes.memmove(info.clusterUuid, raw, 16)
        return self.NVML_SUCCESS

    def nvmlDeviceGetGpuFabricInfoV(self, handle: int, info_ref: Any) -> int:
        assert isinstance(info_ref._obj, c_nvmlGpuFabricInfo_v2_t)
        return self._fill_fabric(info_ref)

    def nvmlDeviceGetGpuFabricInfo(self, handle: int, info_ref: Any) -> int:
        assert isinstance(info_ref._obj, c_nvmlGpuFabricInfo_t)
        return self._fill_fabric(info_ref)


# --- the cuda-python stand-in -------------------------------------------------------------------


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 128
    CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 132


class FakeDriver(types.ModuleType):
    """Stand-in for cuda-python's ``cuda.bindings.driver``: ``attributes`` answers
    cuDeviceGetAttribute; ``init`` is what cuInit returns or raises; ``attribute_error`` a
    CUresult cuDeviceGetAttribute returns instead of a value."""

    CUresult = CUresult
    CUdevice_attribute = CUdevice_attribute

    def __init__(self, multicast: int = 1, fabric_handles: int = 1,
                 init: CUresult | Exception = CUresult.CUDA_SUCCESS,
                 attribute_error: CUresult | None = None, name: str = "cuda.bindings.driver"
                 ) -> None:
        super().__init__(name)
        self.attributes = {CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: multicast,
                           CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED:
                               fabric_handles}
        self.init = init
        self.attribute_error = attribute_error
        self.asked: list[tuple[str, int]] = []

    def cuInit(self, flags: int) -> tuple[CUresult]:
        if isinstance(self.init, Exception):
            raise self.init
        return (self.init,)

    def cuDeviceGetAttribute(self, attribute: CUdevice_attribute,
                             device: int) -> tuple[CUresult, int]:
        self.asked.append((attribute.name, device))
        if self.attribute_error is not None:
            return self.attribute_error, 0
        return CUresult.CUDA_SUCCESS, self.attributes[attribute]


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """torch sees a CUDA H200; change ``state["device"]`` to be another rank's device. No NVML,
    no cuda-python (even where they are installed) until a test installs a stand-in."""
    state: dict[str, Any] = {"device": 0, "uuid": None}

    def properties(index: int) -> Any:
        if state["uuid"] is None:
            raise AssertionError("Torch not compiled with CUDA enabled")
        return types.SimpleNamespace(uuid=state["uuid"])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["device"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("pynvml", "cuda.bindings.driver", "cuda.cuda"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: ImportError
    monkeypatch.setattr(gpu_facts, "torch_multicast",
                        lambda index: (None, "cuda-python not installed, and torch (stand-in) "
                                             "cannot tell"))
    return state


def install_nvml(monkeypatch: pytest.MonkeyPatch, nvml: FakeNvml) -> FakeNvml:
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def install_driver(monkeypatch: pytest.MonkeyPatch, driver: FakeDriver) -> FakeDriver:
    package = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    monkeypatch.setitem(sys.modules, "cuda", package)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, driver.__name__, driver)
    return driver


# --- NVML: absent, failing, answering -----------------------------------------------------------


def test_nvml_absent_leaves_nvlink_and_fabric_unknown_with_the_reason(gpu: dict[str, Any]) -> None:
    with pytest.raises(ImportError):
        import pynvml  # noqa: F401
    facts = gpu_facts.read()
    assert facts.sm == 90 and facts.gpu == "NVIDIA H200" and facts.device_index == 0
    assert facts.gpu_id is None and facts.nvlink_peers is None and facts.fabric is None
    assert facts.unknown["nvlink_all_pairs"] == "nvidia-ml-py not installed"
    # fabric: cuda-python is missing too; the first reason found is kept
    assert facts.unknown["fabric"] == "cuda-python not installed"


def test_nvml_absent_but_driver_says_no_fabric_handles_is_a_known_no(
        gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    install_driver(monkeypatch, FakeDriver(fabric_handles=0))
    facts = gpu_facts.read()
    assert facts.fabric is False and "fabric" not in facts.unknown
    assert facts.unknown["nvlink_all_pairs"] == "nvidia-ml-py not installed"


def test_nvml_init_failing_is_the_reason_and_no_shutdown_follows(
        gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = install_nvml(monkeypatch, FakeNvml(init_error=NVMLError(9)))
    install_driver(monkeypatch, FakeDriver())
    facts = gpu_facts.read()
    assert facts.nvlink_peers is None and facts.fabric is None
    assert facts.unknown["nvlink_all_pairs"] == "NVML init failed: NVMLError: Driver Not Loaded"
    assert facts.unknown["fabric"] == "NVML init failed: NVMLError: Driver Not Loaded"
    assert nvml.calls == ["init"]


def test_nvml_full_mesh_reports_identity_and_every_peer(
        gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = install_nvml(monkeypatch, FakeNvml())
    install_driver(monkeypatch, FakeDriver())
    gpu["device"] = 2
    facts = gpu_facts.read()
    assert facts.gpu_id == UUIDS[2]
    assert facts.nvlink_peers == tuple(u for i, u in enumerate(UUIDS) if i != 2)
    assert "nvlink_all_pairs" not in facts.unknown
    assert nvml.calls[0] == "init" and nvml.calls[-1] == "shutdown"
    assert nvml.calls.count("init") == nvml.calls.count("shutdown") == 1


def test_nvml_missing_link_is_left_out_of_the_peers(
        gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    links = {frozenset((a, b)) for a in range(8) for b in range(a + 1, 8)} - {frozenset((0, 3))}
    install_nvml(monkeypatch, FakeNvml(links=links))
    facts = gpu_facts.read()
    assert facts.nvlink_peers is not None and UUIDS[3] not in facts.nvlink_peers
    assert len(facts.nvlink_peers) == 6


def test_nvml_p2p_not_supported_is_no_link_other_errors_unknown(
        gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    install_nvml(monkeypatch, FakeNvml(p2p_error=NVMLError_NotSupported()))
    assert gpu_facts.read().nvlink_peers == ()
    install_nvml(monkeypatch, FakeNvml(p2p_error=NVMLError(999)))
    facts = gpu_facts.read()
    assert facts.nvlink_peers is None
    assert facts.unknown["nvlink_all_pairs"].startswith(
        "call failed: nvmlDeviceGetP2PStatus(GPU 0, GPU 1, NVLINK): NVMLError: Unknown Error")


@pytest.mark.parametrize(("visible", "device", "physical"), [
    ("4,5,6,7", 1, 5),
    (" 6 , 2 ", 0, 6),
    (f"{UUIDS[6]},{UUIDS[2]}", 1, 2),
    (f"{UUIDS[7][:12]}", 0, 7),        # a unique UUID prefix, as CUDA accepts
])
def test_cuda_visible_devices_maps_to_the_physical_gpu(
        gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch, visible: str, device: int,
        physical: int) -> None:
    nvml = install_nvml(monkeypatch, FakeNvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    gpu["device"] = device
    facts = gpu_facts.read()
    assert facts.gpu_id == UUIDS[physical]
    assert f"p2p {physical}-{(physical + 1) % 8}" in nvml.calls
    assert facts.nvlink_peers is not None and UUIDS[physical] not in facts.nvlink_peers


@pytest.mark.parametrize(("visible", "why"), [
    ("0,1", "has no entry for cuda:3"),
    ("MIG-7d4d8e3c-aaaa-bbbb-cccc-000000000000", "is a MIG instance"),
    ("GPU-0000", "matches 8 of the 8 GPUs"),
    ("abc", "neither an index nor a GPU UUID"),
    ("1,2,3,9", "is GPU 9 but NVML lists 8 GPUs"),
])
def test_cuda_visible_devices_that_cannot_be_mapped_are_reasons(
        gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch, visible: str, why: str) -> None:
    install_nvml(monkeypatch, FakeNvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    gpu["device"] = {"0,1": 3, "1,2,3,9": 3}.get(visible, 0)
    facts = gpu_facts.read()
    assert facts.gpu_id is None and facts.nvlink_peers is None
    assert why in facts.unknown["nvlink_all_pairs"]


def test_the_uuid_torch_reports_wins_over_the_device_order(
        gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's default order (FASTEST_FIRST) may differ from NVML's; torch's UUID does not."""
    install_nvml(monkeypatch, FakeNvml())
    gpu["uuid"] = UUIDS[5].removeprefix("GPU-")
    assert gpu_facts.read().gpu_id == UUIDS[5]
    gpu["uuid"] = "00000000-not-a-gpu-nvml-knows"  # unknown to NVML: the env mapping decides
    assert gpu_facts.read().gpu_id == UUIDS[0]


# --- the driver (cuda-python): multicast and fabric handles ------------------------------------


@pytest.mark.parametrize(("value", "expected"), [(1, True), (0, False)])
def test_driver_answers_multicast(gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                  value: int, expected: bool) -> None:
    driver = install_driver(monkeypatch, FakeDriver(multicast=value))
    gpu["device"] = 3
    facts = gpu_facts.read()
    assert facts.multicast is expected and "multicast" not in facts.unknown
    assert ("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED", 3) in driver.asked


def test_the_older_cuda_python_layout_answers_too(gpu: dict[str, Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    install_driver(monkeypatch, FakeDriver(multicast=1, name="cuda.cuda"))
    assert gpu_facts.read().multicast is True


def test_without_cuda_python_multicast_asks_torch_symmetric_memory(
        gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def torch_says(index: int) -> tuple[bool | None, str]:
        asked.append(index)
        return True, ""

    monkeypatch.setattr(gpu_facts, "torch_multicast", torch_says)
    gpu["device"] = 1
    assert gpu_facts.read().multicast is True and asked == [1]


def test_without_cuda_python_or_torch_multicast_is_unknown_with_the_reason(
        gpu: dict[str, Any]) -> None:
    facts = gpu_facts.read()
    assert facts.multicast is None
    assert facts.unknown["multicast"].startswith("cuda-python not installed")


def test_torch_symmetric_memory_answers_a_bool_or_a_reason() -> None:
    """The real call (False on a CPU-only torch, which has no CUDA symmetric memory)."""
    value, why = gpu_facts.torch_multicast(0)
    assert (value in (True, False) and why == "") or (value is None and why)


@pytest.mark.parametrize(("driver", "why"), [
    (FakeDriver(init=RuntimeError('"cuda" is an NVIDIA driver library and can only be found '
                                  "via system search")), "no CUDA driver: RuntimeError: "),
    (FakeDriver(init=CUresult.CUDA_ERROR_NO_DEVICE),
     "no CUDA driver: cuInit returned CUDA_ERROR_NO_DEVICE"),
    (FakeDriver(attribute_error=CUresult.CUDA_ERROR_INVALID_DEVICE),
     "call failed: cuDeviceGetAttribute(MULTICAST_SUPPORTED) returned CUDA_ERROR_INVALID_DEVICE"),
])
def test_driver_failing_leaves_multicast_unknown_without_asking_torch(
        gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch, driver: FakeDriver,
        why: str) -> None:
    monkeypatch.setattr(gpu_facts, "torch_multicast", lambda index: pytest.fail("asked torch"))
    install_driver(monkeypatch, driver)
    facts = gpu_facts.read()
    assert facts.multicast is None and facts.unknown["multicast"].startswith(why)
    assert facts.fabric is None and facts.unknown["fabric"].startswith(why.replace(
        "MULTICAST_SUPPORTED", "HANDLE_TYPE_FABRIC_SUPPORTED"))


# --- fabric: NVML's registration in each state, and the driver's fabric handles -----------------


@pytest.mark.parametrize(("fabric", "expected", "why"), [
    (FABRIC_OK, True, ""),
    ((0, 0, CLUSTER.bytes, 7), False, ""),               # NOT_SUPPORTED
    ((1, 0, bytes(16), 0), False, ""),                   # NOT_STARTED
    ((2, 0, bytes(16), 0), None, "fabric registration still in progress"),  # IN_PROGRESS
    ((3, 999, CLUSTER.bytes, 7), False, ""),             # COMPLETED, registration failed
    ((3, 0, bytes(16), 7), False, ""),                   # COMPLETED, no cluster
    (NVMLError_NotSupported(), False, ""),
    (NVMLError(999), None, "call failed: nvmlDeviceGetGpuFabricInfoV: NVMLError: Unknown Error"),
])
def test_fabric_in_each_state(gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                              fabric: Any, expected: bool | None, why: str) -> None:
    install_nvml(monkeypatch, FakeNvml(fabric=fabric))
    install_driver(monkeypatch, FakeDriver(fabric_handles=1))
    facts = gpu_facts.read()
    assert facts.fabric is expected
    if expected is None:
        assert facts.unknown["fabric"].startswith(why)
    else:
        assert "fabric" not in facts.unknown
    if expected:
        assert (facts.fabric_cluster, facts.fabric_clique) == (str(CLUSTER), 7)
    else:
        assert facts.fabric_cluster is None and facts.fabric_clique is None


def test_fabric_needs_the_drivers_fabric_handles(gpu: dict[str, Any],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    install_nvml(monkeypatch, FakeNvml(fabric=FABRIC_OK))
    install_driver(monkeypatch, FakeDriver(fabric_handles=0))
    assert gpu_facts.read().fabric is False
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    facts = gpu_facts.read()
    assert facts.fabric is None and facts.unknown["fabric"] == "cuda-python not installed"


def test_fabric_with_an_older_nvml_binding(gpu: dict[str, Any],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-ml-py without the versioned call: nvmlDeviceGetGpuFabricInfo."""
    monkeypatch.delattr(FakeNvml, "nvmlDeviceGetGpuFabricInfoV")
    install_nvml(monkeypatch, FakeNvml(fabric=FABRIC_OK))
    install_driver(monkeypatch, FakeDriver())
    facts = gpu_facts.read()
    assert facts.fabric is True and facts.fabric_clique == 7


# --- local_facts ---------------------------------------------------------------------------------


def test_local_facts_without_a_cuda_device_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    facts = topology.local_facts("cuda")
    assert facts.sm is None and facts.multicast is None and facts.fabric is None
    assert set(facts.unknown) == {"sm", "gpu", "multicast", "nvlink_all_pairs", "fabric"}
    assert all("is_available() is False" in why for why in facts.unknown.values())


def test_local_facts_of_each_rank_merge_to_an_nvswitch_node(
        gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight ranks of one NVSwitch H200 node, each reading its own GPU, then merged as
    ``negotiate`` does (JSON in between): ``auto`` may now pick a fused backend."""
    install_nvml(monkeypatch, FakeNvml(fabric=NVMLError_NotSupported()))
    install_driver(monkeypatch, FakeDriver(multicast=1, fabric_handles=0))
    monkeypatch.setattr(topology, "flashinfer_version", lambda: "0.6.13")
    payloads = []
    for rank in range(8):
        gpu["device"] = rank
        payloads.append(json.loads(json.dumps(asdict(topology.local_facts("cuda")))))
    topo = merge([LocalFacts(**p) for p in payloads])
    assert (topo.multicast, topo.nvlink_all_pairs, topo.fabric) == (True, True, False)
    assert topo.sm == 90 and topo.unknown == {}
    plan = resolve(Settings(), topo, Spec(max_tokens=2048, hidden=4096, dtype="bf16"))
    assert plan.backend == "mnnvl" and plan.viable == ("mnnvl", "trtllm", "torch")


def test_local_facts_with_a_missing_link_merge_to_no_nvlink(
        gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    links = {frozenset((a, b)) for a in range(4) for b in range(a + 1, 4)} - {frozenset((1, 2))}
    install_nvml(monkeypatch, FakeNvml(count=4, links=links))
    facts = []
    for rank in range(4):
        gpu["device"] = rank
        facts.append(topology.local_facts("cuda"))
    assert merge(facts).nvlink_all_pairs is False


# --- merge, with hand-made facts -----------------------------------------------------------------


def rank(host: str = "n0", gpu_id: str | None = None, peers: list[str] | None = None,
         **kw: Any) -> LocalFacts:
    fields: dict[str, Any] = {"sm": 90, "gpu": "H200", "multicast": True, "fabric": True,
                              "fabric_cluster": str(CLUSTER), "fabric_clique": 1,
                              "flashinfer": "0.6.13"}
    fields.update(kw)
    return LocalFacts(host=host, device="cuda", gpu_id=gpu_id, nvlink_peers=peers, **fields)


def mesh(host: str, ids: list[str], **kw: Any) -> list[LocalFacts]:
    return [rank(host, g, [o for o in ids if o != g], **kw) for g in ids]


def test_merge_all_known_and_all_present() -> None:
    topo = merge(mesh("n0", UUIDS))
    assert (topo.multicast, topo.nvlink_all_pairs, topo.fabric) == (True, True, True)
    assert topo.unknown == {}


def test_merge_one_rank_without_multicast_is_false() -> None:
    facts = mesh("n0", UUIDS)
    facts[5] = replace(facts[5], multicast=False)
    topo = merge(facts)
    assert topo.multicast is False and "multicast" not in topo.unknown


def test_merge_one_unknown_is_unknown_with_its_rank_and_reason() -> None:
    facts = mesh("n0", UUIDS)
    facts[3] = replace(facts[3], multicast=None, unknown={"multicast": "cuda-python not installed"})
    topo = merge(facts)
    assert topo.multicast is None
    assert topo.unknown == {"multicast": "rank 3: cuda-python not installed"}


def test_merge_false_wins_over_unknown() -> None:
    facts = mesh("n0", UUIDS[:4])
    facts[0] = replace(facts[0], multicast=None, unknown={"multicast": "x"})
    facts[1] = replace(facts[1], multicast=False)
    assert merge(facts).multicast is False and merge(facts).unknown == {}


def test_merge_groups_reasons_by_rank() -> None:
    facts = [rank(multicast=None, unknown={"multicast": "nvidia-ml-py not installed"})
             for _ in range(6)]
    facts[4] = replace(facts[4], unknown={"multicast": "no CUDA driver: cuInit returned X"})
    assert merge(facts).unknown["multicast"] == ("ranks 0-3, 5: nvidia-ml-py not installed; "
                                                 "rank 4: no CUDA driver: cuInit returned X")
    assert merge([rank(multicast=None)]).unknown["multicast"] == "rank 0: not reported"


def test_merge_fabric_needs_one_cluster_and_one_clique() -> None:
    facts = mesh("a", UUIDS[:4]) + mesh("b", UUIDS[4:])
    assert merge(facts).fabric is True
    other_clique = [*facts[:7], replace(facts[7], fabric_clique=2)]
    assert merge(other_clique).fabric is False
    other_cluster = [*facts[:7], replace(facts[7], fabric_cluster=str(uuid.uuid4()))]
    assert merge(other_cluster).fabric is False
    no_fabric = [*facts[:7], replace(facts[7], fabric=False, fabric_cluster=None,
                                     fabric_clique=None)]
    assert merge(no_fabric).fabric is False
    unknown = [*facts[:7], replace(facts[7], fabric=None, unknown={"fabric": "NVML init failed"})]
    topo = merge(unknown)
    assert topo.fabric is None and topo.unknown["fabric"] == "rank 7: NVML init failed"


def test_merge_two_hosts_each_fully_nvlinked() -> None:
    topo = merge(mesh("a", UUIDS[:4]) + mesh("b", UUIDS[4:]))
    assert topo.nvlink_all_pairs is True and topo.node_count == 2


def test_merge_a_missing_link_is_false() -> None:
    facts = mesh("a", UUIDS[:4]) + mesh("b", UUIDS[4:])
    facts[5] = replace(facts[5], nvlink_peers=[UUIDS[4], UUIDS[7]])   # 5 misses 6 ...
    facts[6] = replace(facts[6], nvlink_peers=[UUIDS[4], UUIDS[7]])   # ... and 6 misses 5
    assert merge(facts).nvlink_all_pairs is False


def test_merge_a_link_counts_when_either_side_reports_it() -> None:
    facts = mesh("a", UUIDS[:4])
    facts[1] = replace(facts[1], nvlink_peers=[UUIDS[0], UUIDS[3]])   # 1 does not list 2 ...
    assert merge(facts).nvlink_all_pairs is True                       # ... but 2 lists 1


def test_merge_one_gpu_per_host_is_trivially_linked() -> None:
    facts = [rank(f"h{i}", None, None, unknown={"nvlink_all_pairs": "nvidia-ml-py not installed"})
             for i in range(4)]
    topo = merge(facts)
    assert topo.nvlink_all_pairs is True and "nvlink_all_pairs" not in topo.unknown


def test_merge_unknown_peers_on_a_shared_host_are_unknown_with_the_reason() -> None:
    blind = rank("b", None, None, unknown={"nvlink_all_pairs": "nvidia-ml-py not installed"})
    facts = [*mesh("a", UUIDS[:4]), blind, blind]
    topo = merge(facts)
    assert topo.nvlink_all_pairs is None
    assert topo.unknown["nvlink_all_pairs"] == "ranks 4-5: nvidia-ml-py not installed"


def test_merge_one_rank_unknown_but_its_neighbour_knows_the_link_is_there() -> None:
    facts = mesh("a", UUIDS[:2])
    facts[1] = replace(facts[1], nvlink_peers=None, unknown={"nvlink_all_pairs": "x"})
    assert merge(facts).nvlink_all_pairs is True            # rank 0 lists rank 1's GPU
    facts[0] = replace(facts[0], nvlink_peers=[])
    assert merge(facts).nvlink_all_pairs is False           # rank 0 knows and has no link


def test_merge_an_unknown_link_and_a_missing_one_is_false() -> None:
    facts = mesh("a", UUIDS[:2]) + mesh("b", UUIDS[2:4])
    facts[0] = replace(facts[0], gpu_id=None, nvlink_peers=None)
    facts[1] = replace(facts[1], nvlink_peers=None)
    facts[3] = replace(facts[3], nvlink_peers=[])
    facts[2] = replace(facts[2], nvlink_peers=[])
    assert merge(facts).nvlink_all_pairs is False


def test_merge_keeps_a_ranks_own_verdict() -> None:
    cpu = [LocalFacts("h", "cpu", multicast=False, nvlink_all_pairs=False, fabric=False)] * 2
    assert merge(cpu).nvlink_all_pairs is False
    claims = [rank("a", None, None, nvlink_all_pairs=True) for _ in range(4)]
    assert merge(claims).nvlink_all_pairs is True


def test_merge_of_cpu_ranks_has_nothing_unknown() -> None:
    """GPU facts do not apply to CPU ranks: absent, not unknown (explain stays quiet)."""
    cpu = [topology.local_facts("cpu"), replace(topology.local_facts("cpu"), flashinfer="0.6.13")]
    assert merge(cpu).unknown == {} and merge(cpu).sm is None


def test_merge_names_mixed_flashinfer_versions() -> None:
    facts = mesh("a", UUIDS[:4])
    facts[2] = replace(facts[2], flashinfer="0.6.15")
    facts[3] = replace(facts[3], flashinfer=None)
    topo = merge(facts)
    assert topo.flashinfer is None
    assert topo.unknown["flashinfer"] == ("ranks disagree: ranks 0-1: 0.6.13; rank 2: 0.6.15; "
                                          "rank 3: not installed")


# --- the topology JSON: ``unknown`` is optional ------------------------------------------------


def test_topology_unknown_round_trips_and_is_optional() -> None:
    topo = merge([rank(host, multicast=None, unknown={"multicast": "cuda-python not installed"})
                  for host in ("a", "b")])
    data = topo.to_dict()
    assert data["multicast"] is None and data["unknown"] == {
        "multicast": "ranks 0-1: cuda-python not installed"}
    back = Topology.from_dict(json.loads(json.dumps(data)))
    assert back == topo and back.multicast is None
    assert "unknown" not in merge(mesh("a", UUIDS[:2])).to_dict()
    assert hash(topo) == hash(replace(topo, unknown={}))


def test_shipped_topologies_still_load() -> None:
    for path in sorted((ROOT / "examples" / "topologies").glob("*.json")):
        topo = topology.load(path)
        assert topo.unknown == {}
        assert Topology.from_dict(topo.to_dict()) == topo


def test_a_null_capability_without_a_reason_still_reads_as_false() -> None:
    topo = Topology.from_dict({"device": "cuda", "world_size": 2, "multicast": None,
                               "unknown": {"fabric": "NVML init failed"}, "fabric": None})
    assert topo.multicast is False and topo.fabric is None
    assert topo.unknown == {"fabric": "NVML init failed"}


def test_a_reason_for_a_known_fact_is_dropped() -> None:
    topo = Topology(device="cuda", world_size=2, multicast=True, unknown={"multicast": "stale"})
    assert topo.unknown == {}


@pytest.mark.parametrize(("unknown", "error"), [
    ([], "a JSON object"),
    ({"gpus": "x"}, "names no fact"),
    ({"fabric": 3}, "strings"),
])
def test_bad_unknown_in_a_topology_file(tmp_path: Path, unknown: Any, error: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"device": "cuda", "world_size": 2, "fabric": None,
                                "unknown": unknown}))
    with pytest.raises(ValueError, match=error):
        topology.load(path)


# --- the what-if of this machine ----------------------------------------------------------------


@pytest.mark.parametrize(("peers", "world", "expected"), [
    (UUIDS[1:], 8, True), ([UUIDS[1]], 8, False), ([UUIDS[1]], 2, True), ([], 1, True),
])
def test_this_machine_judges_nvlink_from_this_gpus_peers(peers: list[str], world: int,
                                                         expected: bool) -> None:
    facts = rank("n0", UUIDS[0], peers)
    assert topology.this_machine(world, facts=facts).nvlink_all_pairs is expected


def test_this_machine_with_unknown_peers_keeps_the_reason() -> None:
    facts = rank("n0", None, None, unknown={"nvlink_all_pairs": "nvidia-ml-py not installed"})
    topo = topology.this_machine(8, facts=facts)
    assert topo.nvlink_all_pairs is None
    assert topo.unknown["nvlink_all_pairs"] == "ranks 0-7: nvidia-ml-py not installed"


# --- the CLI on a (stand-in) GPU machine, and with no GPU library at all -----------------------


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    from arfuse.cli import main

    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_doctor_prints_each_fact_or_why_it_is_unknown(
        gpu: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    out = run_cli(capsys, "doctor")
    assert "GPU NVIDIA H200, SM 90" in out
    assert "multicast:     unknown (cuda-python not installed" in out
    assert "NVLink:        unknown (nvidia-ml-py not installed)" in out
    assert "MNNVL fabric:  unknown (cuda-python not installed)" in out
    assert "not detected yet" not in out


def test_doctor_on_an_nvswitch_node(gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    install_nvml(monkeypatch, FakeNvml(fabric=FABRIC_OK))
    install_driver(monkeypatch, FakeDriver(multicast=1, fabric_handles=1))
    out = run_cli(capsys, "doctor")
    assert f"SM 90 ({UUIDS[0]})" in out
    assert "multicast:     yes" in out
    assert "NVLink:        P2P to 7 other GPUs of this host; every pair of 8 ranks: yes" in out
    assert f"MNNVL fabric:  yes (cluster {CLUSTER}, clique 7)" in out


def test_explain_names_the_unknown_facts(gpu: dict[str, Any],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = run_cli(capsys, "explain")
    assert "unknown facts (treated as absent):" in out
    assert "  nvlink_all_pairs: ranks 0-7: nvidia-ml-py not installed" in out
    plan = json.loads(run_cli(capsys, "explain", "--json"))
    assert plan["unknown_facts"]["nvlink_all_pairs"] == "ranks 0-7: nvidia-ml-py not installed"
    assert plan["unknown_facts"]["multicast"].startswith("ranks 0-7: cuda-python not installed")


BLOCKED = ("import sys\n"
           "for name in ('pynvml', 'cuda', 'cuda.bindings', 'cuda.bindings.driver', 'cuda.cuda'):\n"
           "    sys.modules[name] = None  # not importable, even where installed\n"
           "for name in ('pynvml', 'cuda.bindings.driver', 'cuda.cuda'):\n"
           "    try:\n"
           "        __import__(name)\n"
           "    except ImportError:\n"
           "        pass\n"
           "    else:\n"
           "        raise SystemExit(name + ' is importable')\n")


@pytest.mark.parametrize("argv", [[], ["doctor"], ["explain"], ["explain", "--json"]])
def test_arfuse_works_without_nvml_or_cuda_python(argv: list[str]) -> None:
    script = BLOCKED + ("import arfuse, arfuse.gpu_facts\n" if not argv else
                        f"from arfuse.cli import main\nsys.exit(main({argv!r}))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
