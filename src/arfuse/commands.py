"""Collective CLI commands (run, bench, doctor)."""
from __future__ import annotations

from typing import Any


def add_subcommands(sub: Any, *helpers: Any) -> None:
    del sub, helpers
