"""Suspend and resume: checkpointing the workspaces the drop-in holds for one group."""

from __future__ import annotations

import importlib
import logging
from typing import Any

from ... import log
from ..common import normalize as _normalize
from .workspaces import _held, _lock


def _workspaces_of(group: Any) -> list[Any]:
    group = _normalize(group)
    seen: set[int] = set()
    found: list[Any] = []
    for held in _held:
        if held.group is group and held.live and id(held.op.workspace) not in seen:
            seen.add(id(held.op.workspace))
            found.append(held.op.workspace)
    return found


def _checkpoint(workspace: Any, phase: str, group: Any) -> None:
    """arfuse's own checkpoint methods where the workspace has them, else FlashInfer's."""
    supports = getattr(workspace, "supports_checkpoint", None)
    method = getattr(workspace, f"checkpoint_{phase}", None)
    if supports is not None and method is not None:
        if callable(supports):
            supports = supports()
        if not supports:
            raise NotImplementedError(f"the arfuse {workspace.backend} workspace does not "
                                      "support checkpointing")
        method()
        return
    handle = workspace.handle
    if not hasattr(handle, f"checkpoint_{phase}"):
        raise NotImplementedError(f"FlashInfer's {type(handle).__name__} has no "
                                  f"checkpoint_{phase} (FlashInfer >= 0.7 has)")
    if phase == "prepare":
        handle.checkpoint_prepare()
    else:
        mnnvl = importlib.import_module("flashinfer.comm.mnnvl")
        handle.checkpoint_restore(mnnvl.TorchDistBackend(group=_normalize(group)))


def _checkpoint_all(group: Any, phase: str, skip_unsupported: bool) -> None:
    with _lock:
        for workspace in _workspaces_of(group):
            try:
                _checkpoint(workspace, phase, group)
            except NotImplementedError:
                if not skip_unsupported:
                    raise
                log.once(logging.INFO, ("vllm-checkpoint", workspace.backend),
                         "arfuse vLLM drop-in: the FlashInfer %s workspace cannot be "
                         "checkpointed; it stays resident during suspend", workspace.backend)


def checkpoint_prepare_fi_ar_workspaces(group: Any, skip_unsupported: bool = False) -> None:
    """Detach the physical memory of this group's workspaces (collective, as FlashInfer's)."""
    _checkpoint_all(group, "prepare", skip_unsupported)


def checkpoint_restore_fi_ar_workspaces(group: Any, skip_unsupported: bool = False) -> None:
    """Map this group's workspaces again, exchanging handles on this very group."""
    _checkpoint_all(group, "restore", skip_unsupported)

