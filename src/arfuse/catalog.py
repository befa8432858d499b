"""The table of backends: one descriptor each, registered the way
``torch.distributed.Backend.register_backend`` lets each backend own its entry.

A descriptor is pure data and pure functions (no torch, no I/O): what the backend needs (the
reasons it cannot run, from topology + spec), which quantisations it fuses, its predicted bytes
and capacity, its place in ``auto``'s order, and where its implementation lives (imported only
when a workspace is made). The policy, settings, fault injection and the CLI iterate over this
table; nothing else lists backend names.

Adding a backend: one module that defines ``DESCRIPTORS`` (and its implementation), plus its
module name in ``BUILTIN_MODULES`` (or a ``register()`` call from your own code).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from .pattern import ALL as ALL_PATTERNS
from .pattern import Pattern
from .spec import Spec
from .topology import Topology

UNLIMITED = 2**62
UNFUSED = "torch"  # the backend every plan ends with, and every over-capacity call runs on
BUILTIN_MODULES: tuple[str, ...] = (
    "arfuse.backends.flashinfer",
    "arfuse.backends.hier",
    "arfuse.backends.shm",
    "arfuse.backends.torch",
)


def _never(topology: Topology, spec: Spec) -> str:
    return ""


def _fuses_nothing(topology: Topology, spec: Spec, pattern: Pattern) -> bool:
    return False


@dataclass(frozen=True)
class Footprint:
    """What a workspace costs and holds: bytes per rank, and tokens per call that run fused."""

    bytes_per_rank: int
    capacity: int


@dataclass(frozen=True)
class BackendDescriptor:
    """Everything the decision needs to know about one backend (DESIGN 3.3)."""

    name: str
    fused: bool
    devices: tuple[str, ...]
    implementation: str                     # "module:attribute" of its Backend class
    unmet: Callable[[Topology, Spec], str] = _never
    """Which hard requirement this topology or spec does not meet ("" when it meets all)."""
    auto_skip: Callable[[Topology, Spec], str] = _never
    """Why ``auto`` skips it although it could run (R3: known slower than unfused)."""
    explicit_refusal: Callable[[Topology], str] = field(default=lambda topology: "")
    """A request for it that is a user error on this topology (raises at resolve time)."""
    fuses: Callable[[Topology, Spec, Pattern], bool] = _fuses_nothing
    """Whether its kernel computes ``pattern`` in one step here (a quantised pattern it does
    not fuse runs as the pattern without quantisation, then the quantisation on its own)."""
    notes: Callable[[Topology, Spec], tuple[str, ...]] = field(
        default=lambda topology, spec: ())
    """What ``explain`` adds to the patterns it fuses: the conditions that depend on the call,
    not the spec (when a call of a fused pattern still runs in steps)."""
    footprint: Callable[[int, Spec, Topology], Footprint] = field(
        default=lambda world, spec, topology: Footprint(0, 0))
    auto_rank: int | None = None
    """Place in ``auto``'s order on its devices (lower first); ``None``: never picked by auto."""


_lock = threading.Lock()
_table: dict[str, BackendDescriptor] = {}
_loaded = False


def register(descriptor: BackendDescriptor) -> BackendDescriptor:
    """Add a backend to the table; its name must be new."""
    if not isinstance(descriptor, BackendDescriptor):
        raise TypeError(f"descriptor must be a BackendDescriptor, got {type(descriptor).__name__}")
    if not descriptor.name or descriptor.name == "auto" or not descriptor.name.isidentifier():
        raise ValueError(f"backend name {descriptor.name!r} is not valid; use an identifier "
                         "other than 'auto'")
    _ensure_builtins()
    with _lock:
        if descriptor.name in _table:
            raise ValueError(f"backend {descriptor.name!r} is already registered")
        _table[descriptor.name] = descriptor
    return descriptor


def unregister(name: str) -> None:
    """Remove a registered backend (a built-in one cannot be removed)."""
    _ensure_builtins()
    with _lock:
        if name in _BUILTIN_NAMES:
            raise ValueError(f"backend {name!r} is built in and cannot be removed")
        _table.pop(name, None)


_BUILTIN_NAMES: set[str] = set()


def _ensure_builtins() -> None:
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        for module_name in BUILTIN_MODULES:
            module = importlib.import_module(module_name)
            for descriptor in module.DESCRIPTORS:
                _table[descriptor.name] = descriptor
                _BUILTIN_NAMES.add(descriptor.name)
        _loaded = True


def descriptors() -> tuple[BackendDescriptor, ...]:
    _ensure_builtins()
    with _lock:
        return tuple(_table.values())


def get(name: str) -> BackendDescriptor:
    _ensure_builtins()
    with _lock:
        found = _table.get(name)
    if found is None:
        raise ValueError(f"backend={name!r} is not valid; use one of {', '.join(names())}")
    return found


def names() -> tuple[str, ...]:
    return tuple(d.name for d in descriptors())


def fused_names() -> tuple[str, ...]:
    return tuple(d.name for d in descriptors() if d.fused)


def auto_order(device: str) -> tuple[BackendDescriptor, ...]:
    """The fused backends ``auto`` tries on ``device``, in order."""
    ranked = [d for d in descriptors()
              if d.fused and d.auto_rank is not None and device in d.devices]
    return tuple(sorted(ranked, key=lambda d: d.auto_rank or 0))


def fused_patterns(descriptor: BackendDescriptor, topology: Topology,
                   spec: Spec) -> tuple[Pattern, ...]:
    """The patterns ``descriptor``'s backend fuses for ``spec`` on ``topology``."""
    return tuple(p for p in ALL_PATTERNS if descriptor.fuses(topology, spec, p))


_PLAIN = (type(None), bool, int, float, str)


def _shape_of(value: Any, depth: int = 0) -> str:
    """What ``value`` is, as text that is the same in every process running the same code:
    plain data by value, a function by its name, its code, defaults and closure (a lambda that
    returns another reason, a factory's other limit differ), anything else by its type (the
    process's own addresses never enter it)."""
    if depth > 8:
        return "..."
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (tuple, list, frozenset, set)):
        items = [_shape_of(v, depth + 1) for v in value]
        return type(value).__name__ + "(" + ", ".join(
            sorted(items) if isinstance(value, (set, frozenset)) else items) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_shape_of(k, depth + 1)}: {_shape_of(v, depth + 1)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, types.CodeType):
        return (value.co_code.hex() + repr(value.co_names)
                + _shape_of(tuple(value.co_consts), depth + 1))
    if isinstance(value, functools.partial):
        return (f"partial({_shape_of(value.func, depth + 1)}, {_shape_of(value.args, depth + 1)}"
                f", {_shape_of(value.keywords, depth + 1)})")
    if isinstance(value, types.MethodType):
        return f"{_shape_of(value.__func__, depth + 1)} of {type(value.__self__).__qualname__}"
    if isinstance(value, types.FunctionType):
        cells = tuple(c.cell_contents for c in value.__closure__ or ()
                      if c.cell_contents is not value)
        return (f"{value.__module__}.{value.__qualname__}:"
                + _shape_of((value.__code__, value.__defaults__, value.__kwdefaults__, cells),
                            depth + 1))
    kind = type(value)
    return f"<{kind.__module__}.{kind.__qualname__}>"


def fingerprint(descriptor: BackendDescriptor) -> dict[str, str]:
    """Each field of ``descriptor`` as ranks compare it (negotiation): plain fields by value,
    callables by a digest of their name, code, defaults and closure. Ranks whose descriptors of
    one name differ in any field would resolve different plans and wait for each other."""
    shown: dict[str, str] = {}
    for f in fields(descriptor):
        value = getattr(descriptor, f.name)
        text = _shape_of(value)
        if callable(value):
            name = getattr(value, "__qualname__", type(value).__qualname__)
            text = f"{name} #{hashlib.blake2b(text.encode(), digest_size=6).hexdigest()}"
        shown[f.name] = text
    return shown


def load(name: str) -> Any:
    """The backend's implementation class (imports it: this may load torch or CUDA)."""
    module_name, _, attribute = get(name).implementation.partition(":")
    return getattr(importlib.import_module(module_name), attribute)
