"""Package attributes loaded on first use (a module ``__getattr__``): names whose modules
import torch stay out of the packages' import, so what needs no torch starts without it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def attributes(package: str, homes: Mapping[str, str],
               namespace: dict[str, Any]) -> Callable[[str], Any]:
    """``package``'s ``__getattr__``: a name of ``homes`` from its module (``homes[name]``,
    relative to ``package``), imported on first use and then kept in ``namespace``."""

    def load(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{home}", package), name)
        namespace[name] = value
        return value

    return load
