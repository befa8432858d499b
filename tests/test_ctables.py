"""The header reader reads every constant line or refuses, naming file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from arfuse import ctables


def _read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> dict[str, int | float]:
    (tmp_path / "t.h").write_text(text)
    monkeypatch.setattr(ctables, "CSRC", tmp_path)
    ctables.header.cache_clear()
    try:
        return ctables.header("t.h")
    finally:
        ctables.header.cache_clear()


def test_simple_constants_and_functions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = ("constexpr int kA = 2;\nconstexpr int64_t kB = (int64_t(1) << kA) - 1;\n"
            "inline constexpr int64_t twice(int64_t v) { return 2 * v; }\n")
    assert _read(tmp_path, monkeypatch, text) == {"kA": 2, "kB": 3}


@pytest.mark.parametrize("line", ["constexpr int kA =\n    2;", "constexpr auto kA = 2;",
                                  "static constexpr int kA = 2;", "constexpr char kA = 'a';"])
def test_unreadable_constexpr_line_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          line: str) -> None:
    with pytest.raises(ValueError, match=r"t\.h:1: cannot read"):
        _read(tmp_path, monkeypatch, line + "\n")


@pytest.mark.parametrize("name", ["signature.h", "layout.h", "call_limits.h", "liveness.h"])
def test_kernel_headers_read(name: str) -> None:
    assert ctables.header(name)
