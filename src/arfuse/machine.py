"""Facts about this CPU, read once from /proc/cpuinfo (empty on systems without it)."""

from __future__ import annotations

from functools import cache
from pathlib import Path


@cache
def _cpuinfo() -> tuple[str, ...]:
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def cpuinfo_value(*keys: str) -> str:
    """The value of the first line whose key is one of ``keys`` ("" when there is none)."""
    for line in _cpuinfo():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value.strip()
    return ""


def cpu_flags() -> set[str]:
    """Instruction-set flags (x86 ``flags``, Arm ``Features``)."""
    return set(cpuinfo_value("flags", "Features").split())


def cpu_model() -> str:
    return cpuinfo_value("model name", "Model")
