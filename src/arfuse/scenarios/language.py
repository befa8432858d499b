"""The scenario language: a TOML file of ranks, topology, settings, faults, spec, steps and the
expected outcome (the schema is ``scenarios/README.md``), loaded and checked."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import read_regular_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

LEVELS = ("decision", "ranks")
_STEP_KINDS = ("create", "call", "close", "destroy_all", "sleep", "kill", "exit")
_TOP_KEYS = {"name", "summary", "cases", "rows", "requirements", "level", "limit_s", "note",
             "decide", "reuse", "ranks", "groups", "settings", "faults", "env_by_rank",
             "topology", "topology_file", "shm_tmpfs", "spec", "steps", "expect"}
MAX_SCENARIO_BYTES = 1 << 20      # a scenario is a few dozen lines; bounds what is read


# --- loading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One TOML file, checked for shape (what it means is checked when it runs)."""

    path: Path
    data: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.data.get("name") or self.path.stem)

    @property
    def level(self) -> str:
        return str(self.data.get("level", "ranks"))

    @property
    def limit_s(self) -> float:
        return float(self.data.get("limit_s", 60.0))

    @property
    def rows(self) -> list[int]:
        return [int(r) for r in self.data.get("rows", [])]

    @property
    def cases(self) -> list[str]:
        return [str(c) for c in self.data.get("cases", [])]

    @property
    def requirements(self) -> list[str]:
        return [str(r) for r in self.data.get("requirements", [])]

    @property
    def needs_tmpfs(self) -> bool:
        return bool(self.data.get("shm_tmpfs"))

    def scaled(self, scale: float) -> Scenario:
        """The same scenario with ``limit_s`` times ``scale`` (``--limit-scale``): the runner and
        the job both apply it, so every limit derived from ``limit_s`` moves together."""
        if scale == 1.0:
            return self
        return Scenario(self.path, {**self.data, "limit_s": self.limit_s * scale})


def load_scenario(path: str | os.PathLike[str]) -> Scenario:
    """Parse and check one scenario file; a bad file is a ``ValueError`` naming it."""
    path = Path(path)
    raw = read_regular_file(path, MAX_SCENARIO_BYTES, f"scenario {str(path)!r}")
    if len(raw) > MAX_SCENARIO_BYTES:
        raise ValueError(f"scenario {str(path)!r} is larger than {MAX_SCENARIO_BYTES >> 10} KiB; "
                         "a scenario is a few steps")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"scenario {str(path)!r} is not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"scenario {str(path)!r} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ValueError(f"scenario {str(path)!r}: unknown key(s) {unknown}")
    level = data.get("level", "ranks")
    if level not in LEVELS:
        raise ValueError(f"scenario {str(path)!r}: level={level!r}; use one of {LEVELS}")
    limit = data.get("limit_s", 60.0)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit <= 600:
        raise ValueError(f"scenario {str(path)!r}: limit_s must be a number in (0, 600]")
    if level == "decision" and not (data.get("decide") or data.get("reuse")):
        raise ValueError(f"scenario {str(path)!r}: a decision scenario needs [[decide]] or "
                         "[[reuse]] entries")
    if level == "ranks":
        ranks = data.get("ranks")
        if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 16:
            raise ValueError(f"scenario {str(path)!r}: ranks must be an int in 1..16")
        for i, step in enumerate(data.get("steps", [])):
            if step.get("do") not in _STEP_KINDS:
                raise ValueError(f"scenario {str(path)!r}: step {i}: do={step.get('do')!r}; "
                                 f"use one of {_STEP_KINDS}")
    return Scenario(path, data)


def scenario_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Files as given, directories as their ``*.toml`` files in name order."""
    found: list[Path] = []
    for item in paths:
        p = Path(item)
        if p.is_dir():
            found.extend(sorted(p.glob("*.toml")))
        elif p.is_file():
            found.append(p)
        else:
            raise ValueError(f"scenario path {str(p)!r} is neither a file nor a directory")
    return found

def step_expect(step: dict[str, Any], rank: int) -> dict[str, Any]:
    """What a step expects on ``rank``: ``expect``, with that rank's ``expect_by_rank`` keys
    over it."""
    return {**step.get("expect", {}), **step.get("expect_by_rank", {}).get(str(rank), {})}


def as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]

def resolve_path(scn: Scenario, text: str) -> Path:
    p = Path(text)
    if p.is_absolute():
        return p
    for base in (scn.path.parent, Path.cwd()):
        if (base / p).exists():
            return base / p
    return scn.path.parent / p

def mentions(text: str, fragment: str | list[str]) -> bool:
    """A message fragment, or a list of alternatives (any one will do)."""
    return any(f in text for f in as_list(fragment))
