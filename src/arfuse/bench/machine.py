"""The machine record of a bench report (the CPU facts come from ``arfuse.machine``)."""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import torch

from ..machine import cpu_flags, cpu_model

ISA_FLAGS = ("avx512f", "avx512bw", "avx2", "fma", "f16c")  # the flags a report names


def kernel_isa() -> str:
    """The instruction set the shm kernel of this run was built for (ARFUSE_SHM_ISA or the
    host's best), or why there is no compiled kernel."""
    from ..backends.shm import build as shm_build

    module = shm_build.load()
    return str(module.isa) if module is not None else f"none ({shm_build.why_not()})"


def machine_record(pinned: bool, world: int, threads: int = 1) -> dict[str, Any]:
    """What the figures of a run depend on: CPU, ISA, software, pinning, ranks, date."""
    return {"cpu": cpu_model() or platform.processor(), "cores": os.cpu_count(),
            "isa": " ".join(f for f in ISA_FLAGS if f in cpu_flags()),
            "kernel_isa": kernel_isa(),
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "ranks_pinned": pinned,
            "pinning": "main thread, after init (library threads free)" if pinned else "none",
            "world_size": world,
            "threads_per_rank": threads, "date": time.strftime("%Y-%m-%d")}
