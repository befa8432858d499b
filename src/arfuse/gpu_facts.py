"""Every GPU fact the policy needs, read for this process's current CUDA device.

The policy only fuses on what every rank has (multicast, NVLink between every pair, an MNNVL
fabric), so each fact is read from the driver and NVML rather than guessed. Each library is
optional and imported only here, when asked: NVML (nvidia-ml-py, module ``pynvml``) gives the
GPU's identity, the GPUs of this host it has NVLink P2P to, and its fabric registration;
cuda-python gives the driver attributes (multicast, fabric handles), with torch's symmetric
memory as the multicast fallback. A fact that cannot be read is unknown (``None``) and
``unknown`` says why: a missing package or driver is a reason, never a crash or a silent "no".

A rank only sees its own GPU: whether every pair of the group's GPUs is linked, or whether all
ranks share one fabric clique, is decided by ``topology.merge`` over every rank's facts.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

SM, GPU, MULTICAST, NVLINK, FABRIC = "sm", "gpu", "multicast", "nvlink_all_pairs", "fabric"
"""Fact names: the ``Topology`` fields they feed (keys of ``unknown``)."""

NO_NVML = "nvidia-ml-py not installed"
NO_CUDA_PYTHON = "cuda-python not installed"
NO_DEVICE = "no CUDA device visible to torch (torch.cuda.is_available() is False)"

# cuda-python's module names: cuda-python >= 12.6 / 13 (cuda-bindings), then the older layout.
DRIVER_MODULES = ("cuda.bindings.driver", "cuda.cuda")
MULTICAST_ATTRIBUTE = "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED"
FABRIC_ATTRIBUTE = "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"

# NVML values (nvidia-ml-py 13.x pynvml.py), for a binding that lacks the constant.
_P2P_CAPS_INDEX_NVLINK = 2
_P2P_STATUS_OK = 0
_FABRIC_STATE_IN_PROGRESS = 2
_FABRIC_STATE_COMPLETED = 3
_NVML_SUCCESS = 0


@dataclass(frozen=True)
class GpuFacts:
    """What this process's GPU can do. ``None``: unknown, and ``unknown[fact]`` says why."""

    device_index: int | None = None
    sm: int | None = None
    gpu: str | None = None
    gpu_id: str | None = None
    """NVML UUID ("GPU-..."): the identity other ranks of this host name in their peers."""
    multicast: bool | None = None
    nvlink_peers: tuple[str, ...] | None = None
    """UUIDs of the other GPUs of this host this GPU has NVLink P2P to."""
    fabric: bool | None = None
    fabric_cluster: str | None = None
    fabric_clique: int | None = None
    unknown: Mapping[str, str] = field(default_factory=dict)


def read() -> GpuFacts:
    """Every fact of the current CUDA device; never raises for a missing library or driver."""
    import torch

    try:
        available = bool(torch.cuda.is_available())
    except Exception as exc:  # a broken CUDA install is a reason, not a crash
        return _all_unknown(f"call failed: torch.cuda.is_available(): {_describe(exc)}")
    if not available:
        return _all_unknown(NO_DEVICE)
    try:
        index = int(torch.cuda.current_device())
    except Exception as exc:
        return _all_unknown(f"call failed: torch.cuda.current_device(): {_describe(exc)}")

    unknown: dict[str, str] = {}
    sm: int | None = None
    gpu: str | None = None
    try:
        major, minor = torch.cuda.get_device_capability(index)
        sm = int(major) * 10 + int(minor)
    except Exception as exc:
        unknown[SM] = f"call failed: torch.cuda.get_device_capability: {_describe(exc)}"
    try:
        gpu = str(torch.cuda.get_device_name(index))
    except Exception as exc:
        unknown[GPU] = f"call failed: torch.cuda.get_device_name: {_describe(exc)}"

    multicast, why = read_multicast(index)
    if multicast is None:
        unknown[MULTICAST] = why
    nvml = read_nvml(index, _torch_uuid(index))
    if nvml.peers is None:
        unknown[NVLINK] = nvml.nvlink_why
    handles, why_handles = driver_attribute(index, FABRIC_ATTRIBUTE)
    fabric, why_fabric = _fabric(handles, why_handles, nvml)
    if fabric is None:
        unknown[FABRIC] = why_fabric
    return GpuFacts(
        device_index=index, sm=sm, gpu=gpu, gpu_id=nvml.gpu_id, multicast=multicast,
        nvlink_peers=nvml.peers, fabric=fabric,
        fabric_cluster=nvml.fabric_cluster if fabric else None,
        fabric_clique=nvml.fabric_clique if fabric else None, unknown=unknown)


def _all_unknown(why: str) -> GpuFacts:
    return GpuFacts(unknown={name: why for name in (SM, GPU, MULTICAST, NVLINK, FABRIC)})


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _torch_uuid(index: int) -> str | None:
    """The device's UUID as torch reports it (maps the CUDA ordinal to NVML exactly, whatever
    CUDA_DEVICE_ORDER is); ``None`` when this torch cannot tell."""
    import torch

    try:
        value = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except Exception:
        return None
    return str(value) if value is not None else None


# --- the CUDA driver (cuda-python) --------------------------------------------------------------


def cuda_driver() -> tuple[ModuleType | None, str]:
    """cuda-python's driver module, or why there is none."""
    for name in DRIVER_MODULES:
        try:
            return importlib.import_module(name), ""
        except ImportError:
            continue
        except Exception as exc:  # an install whose import fails is not installed, for us
            return None, f"cuda-python not importable: {_describe(exc)}"
    return None, NO_CUDA_PYTHON


def _cu_name(result: Any) -> str:
    return str(getattr(result, "name", None) or result)


def driver_attribute(index: int, attribute: str) -> tuple[int | None, str]:
    """``cuDeviceGetAttribute(attribute, index)``, as FlashInfer's ``is_multicast_supported``
    asks it; ``(None, why)`` when it cannot be read."""
    driver, why = cuda_driver()
    if driver is None:
        return None, why
    try:
        (status, *_) = driver.cuInit(0)
    except Exception as exc:  # cuda-python without libcuda raises here
        return None, f"no CUDA driver: {_describe(exc)}"
    if int(status) != 0:
        return None, f"no CUDA driver: cuInit returned {_cu_name(status)}"
    enum = getattr(driver.CUdevice_attribute, attribute, None)
    if enum is None:
        return None, f"cuda-python too old: no CUdevice_attribute.{attribute}"
    short = attribute.removeprefix("CU_DEVICE_ATTRIBUTE_")
    try:
        status, value = driver.cuDeviceGetAttribute(enum, index)
    except Exception as exc:
        return None, f"call failed: cuDeviceGetAttribute({short}): {_describe(exc)}"
    if int(status) != 0:
        return None, f"call failed: cuDeviceGetAttribute({short}) returned {_cu_name(status)}"
    return int(value), ""


def read_multicast(index: int) -> tuple[bool | None, str]:
    """CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED via cuda-python; without cuda-python, torch's
    symmetric memory asks the driver the same question."""
    value, why = driver_attribute(index, MULTICAST_ATTRIBUTE)
    if value is not None:
        return value != 0, ""
    if why != NO_CUDA_PYTHON:
        return None, why
    return torch_multicast(index)


def torch_multicast(index: int) -> tuple[bool | None, str]:
    """``_SymmetricMemory.has_multicast_support(DeviceType.CUDA, index)`` (torch 2.5+), which
    reads the same driver attribute (and is false under TORCH_SYMM_MEM_DISABLE_MULTICAST=1)."""
    try:
        from torch._C._autograd import DeviceType
        from torch._C._distributed_c10d import _SymmetricMemory

        return bool(_SymmetricMemory.has_multicast_support(DeviceType.CUDA, index)), ""
    except Exception as exc:
        return None, (f"{NO_CUDA_PYTHON}, and torch symmetric memory cannot tell: "
                      f"{_describe(exc)}")


# --- NVML (nvidia-ml-py) ------------------------------------------------------------------------


@dataclass(frozen=True)
class NvmlFacts:
    """This GPU's identity, NVLink peers and fabric registration as NVML reports them."""

    gpu_id: str | None = None
    peers: tuple[str, ...] | None = None
    nvlink_why: str = ""
    fabric: bool | None = None
    fabric_cluster: str | None = None
    fabric_clique: int | None = None
    fabric_why: str = ""

    @classmethod
    def unknown(cls, why: str) -> NvmlFacts:
        return cls(nvlink_why=why, fabric_why=why)


def nvml_module() -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module("pynvml"), ""
    except ImportError:
        return None, NO_NVML
    except Exception as exc:
        return None, f"nvidia-ml-py not importable: {_describe(exc)}"


def read_nvml(index: int, torch_uuid: str | None = None) -> NvmlFacts:
    """One NVML session (init ... shutdown) for everything NVML tells about CUDA device
    ``index``; each failure becomes the reason of the facts it leaves unknown."""
    nvml, why = nvml_module()
    if nvml is None:
        return NvmlFacts.unknown(why)
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return NvmlFacts.unknown(f"NVML init failed: {_describe(exc)}")
    try:
        return _read_nvml_session(nvml, index, torch_uuid)
    except Exception as exc:  # a binding that breaks mid-way: unknown, never a crash
        return NvmlFacts.unknown(f"call failed: {_describe(exc)}")
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_nvml_session(nvml: Any, index: int, torch_uuid: str | None) -> NvmlFacts:
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except Exception as exc:
        return NvmlFacts.unknown(f"call failed: nvmlDeviceGetCount: {_describe(exc)}")
    handles: list[Any] = []
    uuids: list[str | None] = []
    for i in range(count):
        try:  # a GPU this process may not open is skipped; only its own must be readable
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            handles.append(handle)
            uuids.append(_text(nvml.nvmlDeviceGetUUID(handle)))
        except Exception:
            handles.append(None)
            uuids.append(None)
    mine, why = physical_index(index, uuids, torch_uuid)
    if mine is None or handles[mine] is None or uuids[mine] is None:
        return NvmlFacts.unknown(why or f"call failed: NVML cannot open GPU {mine}")
    peers, nvlink_why = _nvlink_peers(nvml, handles, uuids, mine)
    fabric, cluster, clique, fabric_why = _nvml_fabric(nvml, handles[mine])
    return NvmlFacts(gpu_id=uuids[mine], peers=peers, nvlink_why=nvlink_why, fabric=fabric,
                     fabric_cluster=cluster, fabric_clique=clique, fabric_why=fabric_why)


def physical_index(index: int, uuids: list[str | None],
                   torch_uuid: str | None = None) -> tuple[int | None, str]:
    """NVML's index of CUDA device ``index``: NVML ignores CUDA_VISIBLE_DEVICES, so map it
    through the variable as vLLM does (``device_id_to_physical_device_id``), accepting GPU
    UUIDs (and their unique prefixes) too. The UUID torch reports, when NVML knows it, wins."""
    if torch_uuid:
        wanted = torch_uuid if torch_uuid.startswith("GPU-") else f"GPU-{torch_uuid}"
        if wanted in uuids:
            return uuids.index(wanted), ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        entry = str(index)
    else:
        entries = [e.strip() for e in visible.split(",")]
        if not 0 <= index < len(entries):
            return None, f"CUDA_VISIBLE_DEVICES={visible!r} has no entry for cuda:{index}"
        entry = entries[index]
    if entry.startswith("MIG-"):
        return None, f"cuda:{index} is a MIG instance ({entry}); NVML P2P and fabric not read"
    if entry.startswith("GPU-"):
        matches = [i for i, u in enumerate(uuids) if u is not None and u.startswith(entry)]
        if len(matches) != 1:
            return None, (f"CUDA_VISIBLE_DEVICES entry {entry!r} matches {len(matches)} of the "
                          f"{len(uuids)} GPUs NVML lists")
        return matches[0], ""
    try:
        physical = int(entry)
    except ValueError:
        return None, f"CUDA_VISIBLE_DEVICES entry {entry!r} is neither an index nor a GPU UUID"
    if not 0 <= physical < len(uuids):
        return None, f"cuda:{index} is GPU {physical} but NVML lists {len(uuids)} GPUs"
    return physical, ""


def _nvlink_peers(nvml: Any, handles: list[Any], uuids: list[str | None],
                  mine: int) -> tuple[tuple[str, ...] | None, str]:
    """The GPUs of this host with ``nvmlDeviceGetP2PStatus(mine, other, NVLINK) == OK``
    (vLLM's ``is_fully_connected`` test, one side of each pair)."""
    caps = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", _P2P_CAPS_INDEX_NVLINK)
    ok = getattr(nvml, "NVML_P2P_STATUS_OK", _P2P_STATUS_OK)
    not_supported = getattr(nvml, "NVMLError_NotSupported", ())
    peers: list[str] = []
    for other, (handle, identity) in enumerate(zip(handles, uuids, strict=True)):
        if other == mine or handle is None or identity is None:
            continue
        try:
            status = nvml.nvmlDeviceGetP2PStatus(handles[mine], handle, caps)
        except not_supported:  # no NVLink P2P between these two: a known "no"
            continue
        except Exception as exc:
            return None, (f"call failed: nvmlDeviceGetP2PStatus(GPU {mine}, GPU {other}, "
                          f"NVLINK): {_describe(exc)}")
        if status == ok:
            peers.append(identity)
    return tuple(peers), ""


def _nvml_fabric(nvml: Any, handle: Any) -> tuple[bool | None, str | None, int | None, str]:
    """``nvmlDeviceGetGpuFabricInfoV`` (or the older ``nvmlDeviceGetGpuFabricInfo``): a fabric
    only when registration completed, succeeded, and named a non-zero cluster UUID."""
    if hasattr(nvml, "nvmlDeviceGetGpuFabricInfoV") and hasattr(nvml, "c_nvmlGpuFabricInfoV_t"):
        name, call, info = ("nvmlDeviceGetGpuFabricInfoV", nvml.nvmlDeviceGetGpuFabricInfoV,
                            nvml.c_nvmlGpuFabricInfoV_t())
    elif hasattr(nvml, "nvmlDeviceGetGpuFabricInfo") and hasattr(nvml, "c_nvmlGpuFabricInfo_t"):
        name, call, info = ("nvmlDeviceGetGpuFabricInfo", nvml.nvmlDeviceGetGpuFabricInfo,
                            nvml.c_nvmlGpuFabricInfo_t())
    else:
        return None, None, None, "nvidia-ml-py too old: no nvmlDeviceGetGpuFabricInfo"
    not_supported = getattr(nvml, "NVMLError_NotSupported", ())
    try:
        call(handle, ctypes.byref(info))
    except not_supported:  # a GPU (or driver) without fabric support: no fabric
        return False, None, None, ""
    except Exception as exc:
        return None, None, None, f"call failed: {name}: {_describe(exc)}"
    state = int(info.state)
    if state == getattr(nvml, "NVML_GPU_FABRIC_STATE_IN_PROGRESS", _FABRIC_STATE_IN_PROGRESS):
        return None, None, None, f"fabric registration still in progress ({name})"
    if state != getattr(nvml, "NVML_GPU_FABRIC_STATE_COMPLETED", _FABRIC_STATE_COMPLETED):
        return False, None, None, ""
    if int(info.status) != getattr(nvml, "NVML_SUCCESS", _NVML_SUCCESS):
        return False, None, None, ""
    raw = bytes(info.clusterUuid)
    if not any(raw):
        return False, None, None, ""
    return True, str(uuid.UUID(bytes=raw[:16])), int(info.cliqueId), ""


def _fabric(handles: int | None, why_handles: str, nvml: NvmlFacts) -> tuple[bool | None, str]:
    """MNNVL needs both: the driver can export fabric handles, and NVML's fabric registered."""
    if handles == 0 or nvml.fabric is False:
        return False, ""
    if handles is None:
        return None, why_handles
    if nvml.fabric is None:
        return None, nvml.fabric_why
    return True, ""
