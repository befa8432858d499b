"""Settings from the environment and keyword arguments, validated once.

Keyword arguments override the environment. Every bad value is a ``ValueError`` (or ``TypeError``
for a wrong Python type) that names the variable or argument, the value and what is allowed, so
that the CLI can turn it into one clear line.
"""

from __future__ import annotations

import enum
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from . import catalog

LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning")
DEFAULT_TIMEOUT_S = 60.0
# Keyword (dataclass field) -> environment variable, for error messages and ``from_env``.
ENV_VARS: dict[str, str] = {
    "backend": "ARFUSE_BACKEND",
    "strict": "ARFUSE_STRICT",
    "timeout_s": "ARFUSE_TIMEOUT_S",
    "topology_path": "ARFUSE_TOPOLOGY",
    "faults": "ARFUSE_FAULTS",
    "log_level": "ARFUSE_LOG",
    "replicated_residual": "ARFUSE_REPLICATED_RESIDUAL",
}


class ResidualPromise(str, enum.Enum):
    """What the caller promises of the residual it passes: nothing (``none``); that it is the
    same on every rank (``same``: as in tensor parallelism, where it is the previous layer's
    replicated output; backends may then finish a row another rank reduced from that rank's
    residual_out instead of reading their own); or the same, verified across ranks before
    every call (``checked``: for tests). The keyword takes ``False``, ``True``, ``"check"``
    or a member; ``ARFUSE_REPLICATED_RESIDUAL`` takes 0, 1 or check."""

    NONE = "none"
    SAME = "same"
    CHECKED = "checked"

    @property
    def promised(self) -> bool:
        return self is not ResidualPromise.NONE

    @classmethod
    def of(cls, value: object, label: str) -> ResidualPromise:
        if isinstance(value, ResidualPromise):
            return value
        if isinstance(value, bool):
            return cls.SAME if value else cls.NONE
        if isinstance(value, str):
            if value == "check":
                return cls.CHECKED
            raise ValueError(f"{label}={value!r} is not valid; use True, False or 'check'")
        raise TypeError(f"{label} must be a bool or 'check', got {type(value).__name__}")


def backend_choices() -> tuple[str, ...]:
    """``auto`` and every registered backend."""
    return ("auto", *catalog.names())


@dataclass(frozen=True)
class Settings:
    """What the user asked for; the policy decides what it means on a topology."""

    backend: str = "auto"
    strict: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    topology_path: str | None = None
    faults: str | None = None
    log_level: str = "info"
    replicated_residual: ResidualPromise = ResidualPromise.NONE

    def __post_init__(self) -> None:
        for f in fields(self):
            check(f.name, getattr(self, f.name), f.name)

    @property
    def explicit(self) -> bool:
        return self.backend != "auto"

    def with_overrides(self, **overrides: object) -> Settings:
        """Apply keyword arguments; ``None`` means "not given"."""
        given = {k: v for k, v in overrides.items() if v is not None}
        valid = {f.name for f in fields(self)}
        unknown = set(given) - valid
        if unknown:
            raise TypeError(f"unknown setting(s) {sorted(unknown)}; valid: {sorted(valid)}")
        if "backend" in given and isinstance(given["backend"], str):
            given["backend"] = given["backend"].strip().lower()
        if "replicated_residual" in given:
            given["replicated_residual"] = ResidualPromise.of(given["replicated_residual"],
                                                              "replicated_residual")
        return replace(self, **given)  # type: ignore[arg-type]


def check(key: str, value: object, label: str) -> None:
    """The one rule per setting; ``label`` is how the error names it (keyword or variable)."""
    if key == "backend":
        choices = backend_choices()
        if not isinstance(value, str):
            raise TypeError(f"{label} must be a str, one of {', '.join(choices)}")
        if value not in choices:
            raise ValueError(f"{label}={value!r} is not valid; use one of {', '.join(choices)}")
    elif key == "strict":
        if not isinstance(value, bool):
            raise TypeError(f"{label} must be a bool, got {type(value).__name__}")
    elif key == "replicated_residual":
        if not isinstance(value, ResidualPromise):
            ResidualPromise.of(value, label)  # the error that names what is allowed
            raise TypeError(f"{label} must be a ResidualPromise")
    elif key == "timeout_s":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{label} must be a number of seconds > 0")
        if abs(value) > sys.float_info.max or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{label}={value!r} is not valid; use a finite number of "
                             "seconds > 0")
    elif key == "log_level":
        if value not in LOG_LEVELS:
            raise ValueError(f"{label}={value!r} is not valid; use one of "
                             f"{', '.join(LOG_LEVELS)}")
    elif value is not None and not isinstance(value, str):  # topology_path, faults
        raise TypeError(f"{label} must be a str or None")


def fallback_timeout(value: object) -> float:
    """``value`` when it is a valid timeout, else ``ARFUSE_TIMEOUT_S`` when that is, else the
    default: for a wait that must happen even when the settings are what failed."""
    try:
        check("timeout_s", value, "timeout_s")
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        pass
    try:
        return from_env().timeout_s
    except (TypeError, ValueError):
        return DEFAULT_TIMEOUT_S


def from_env(env: Mapping[str, str] | None = None) -> Settings:
    """Read the ``ARFUSE_*`` variables; a bad value is an error naming its variable."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for key, var in ENV_VARS.items():
        text = env.get(var, "").strip()
        if not text:
            continue
        value: object = text
        if key in ("backend", "log_level"):
            value = text.lower()
        elif key == "strict":
            if text not in ("0", "1"):
                raise ValueError(f"{var}={text!r} is not valid; use 0 or 1")
            value = text == "1"
        elif key == "replicated_residual":
            if text not in ("0", "1", "check"):
                raise ValueError(f"{var}={text!r} is not valid; use 0, 1 or check")
            value = ResidualPromise.of("check" if text == "check" else text == "1", var)
        elif key == "timeout_s":
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"{var}={text!r} is not valid; use a number of seconds "
                                 "> 0") from None
        check(key, value, var)
        values[key] = value
    return Settings(**values)  # type: ignore[arg-type]


def load(env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
    """Environment first, then keyword arguments (``None`` = not given)."""
    return from_env(env).with_overrides(**overrides)
