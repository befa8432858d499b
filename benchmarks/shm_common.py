"""What the shm benchmark scripts share: one rank's start and the results file."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from arfuse.launch import init_from_env, pin_to_core
from arfuse.torch_types import TORCH_DTYPES as DTYPES


def start_rank(rank: int, world: int, max_tokens: int, hidden: int, dtype: str) -> Any:
    """One torch thread, the process group, this rank's core (after the group: gloo's threads
    stay free), then the fused op on the shm backend (strict: no silent fallback)."""
    import arfuse

    torch.set_num_threads(1)
    init_from_env("cpu")
    pin_to_core(rank, world)
    return arfuse.FusedAllReduce(max_token_num=max_tokens, hidden_dim=hidden,
                                 dtype=DTYPES[dtype], backend="shm", strict=True)


def save(out: str, world: int, hidden: int, dtype: str, rows: list[dict[str, Any]]) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"world_size": world, "hidden": hidden, "dtype": dtype,
                                "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
                                "rows": rows}, indent=2))
    print(f"wrote {out}")
