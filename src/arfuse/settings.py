"""Settings from the environment and keyword arguments, validated once.

Keyword arguments override the environment. Every bad value is a ``ValueError`` (or ``TypeError``
for a wrong Python type) that names the variable, the value and what is allowed, so that the CLI
can turn it into one clear line.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

BACKENDS: tuple[str, ...] = ("auto", "mnnvl", "trtllm", "shm", "torch")
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning")
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Settings:
    """What the user asked for; the policy decides what it means on a topology."""

    backend: str = "auto"
    strict: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    topology_path: str | None = None
    faults: str | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        _check_backend(self.backend, "backend")
        if not isinstance(self.strict, bool):
            raise TypeError(f"strict must be a bool, got {type(self.strict).__name__}")
        _check_timeout(self.timeout_s, "timeout_s")
        if self.topology_path is not None and not isinstance(self.topology_path, str):
            raise TypeError("topology_path must be a str path or None")
        if self.faults is not None and not isinstance(self.faults, str):
            raise TypeError("faults must be a str or None")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"log_level={self.log_level!r} is not valid; use one of {', '.join(LOG_LEVELS)}"
            )

    @property
    def explicit(self) -> bool:
        return self.backend != "auto"

    def with_overrides(self, **overrides: object) -> Settings:
        """Apply keyword arguments; ``None`` means "not given"."""
        given = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(given) - set(self.__dataclass_fields__)
        if unknown:
            raise TypeError(
                f"unknown setting(s) {sorted(unknown)}; valid: {sorted(self.__dataclass_fields__)}"
            )
        if "backend" in given and isinstance(given["backend"], str):
            given["backend"] = given["backend"].strip().lower()
        return replace(self, **given)  # type: ignore[arg-type]


def _check_backend(value: object, name: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {', '.join(BACKENDS)}")
    if value not in BACKENDS:
        raise ValueError(f"{name}={value!r} is not valid; use one of {', '.join(BACKENDS)}")


def _check_timeout(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds > 0")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} is not valid; use a finite number of seconds > 0")


def from_env(env: Mapping[str, str] | None = None, *, backend_var: str = "ARFUSE_BACKEND",
             backend_values: tuple[str, ...] = BACKENDS) -> Settings:
    """Read the ``ARFUSE_*`` variables (see DESIGN 3.1).

    ``backend_var``/``backend_values`` let an integration read its own variable (the vLLM shim
    reads ``VLLM_FLASHINFER_ALLREDUCE_BACKEND`` with ``auto|trtllm|mnnvl``).
    """
    env = os.environ if env is None else env
    raw_backend = env.get(backend_var, "auto").strip().lower() or "auto"
    if raw_backend not in backend_values:
        raise ValueError(
            f"{backend_var}={raw_backend!r} is not valid; use one of {', '.join(backend_values)}"
        )
    raw_strict = env.get("ARFUSE_STRICT", "0").strip() or "0"
    if raw_strict not in ("0", "1"):
        raise ValueError(f"ARFUSE_STRICT={raw_strict!r} is not valid; use 0 or 1")
    raw_timeout = env.get("ARFUSE_TIMEOUT_S", "").strip()
    timeout = DEFAULT_TIMEOUT_S
    if raw_timeout:
        try:
            timeout = float(raw_timeout)
        except ValueError:
            raise ValueError(
                f"ARFUSE_TIMEOUT_S={raw_timeout!r} is not valid; use a number of seconds > 0"
            ) from None
        if not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(
                f"ARFUSE_TIMEOUT_S={raw_timeout!r} is not valid; use a number of seconds > 0"
            )
    raw_log = env.get("ARFUSE_LOG", "info").strip().lower() or "info"
    if raw_log not in LOG_LEVELS:
        raise ValueError(f"ARFUSE_LOG={raw_log!r} is not valid; use one of {', '.join(LOG_LEVELS)}")
    return Settings(
        backend=raw_backend,
        strict=raw_strict == "1",
        timeout_s=timeout,
        topology_path=env.get("ARFUSE_TOPOLOGY") or None,
        faults=env.get("ARFUSE_FAULTS") or None,
        log_level=raw_log,
    )


def load(env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
    """Environment first, then keyword arguments (``None`` = not given)."""
    return from_env(env).with_overrides(**overrides)
