"""The header reader reads every constant line or refuses, naming file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from arfuse import ctables


def _read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> dict[str, int | float]:
    (tmp_path / "t.h").write_text(text)
    monkeypatch.setattr(ctables, "CSRC", tmp_path)
    return ctables.header("t.h")


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


def test_a_table_reads_one_row_a_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = ("constexpr int kA = 2;\nstruct Row { const char* n; int v; bool b; };\n"
            "inline constexpr Row kRows[] = {\n"
            '    {"one", kA, true},  // a comment\n    {"", 3 << 1, false},\n};\n'
            "inline constexpr const Row* row(int v) { return nullptr; }\n")
    assert _read(tmp_path, monkeypatch, text) == {"kA": 2}
    assert ctables.table("t.h", "kRows") == [("one", 2, True), ("", 6, False)]
    with pytest.raises(ValueError, match="no table kOther"):
        ctables.table("t.h", "kOther")


@pytest.mark.parametrize("text", ["constexpr Row kRows[] = {\n    {1, 2}, {3, 4},\n};\n",
                                  "constexpr Row kRows[] = {\n    {1, 2},\n"])
def test_an_unreadable_table_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    text: str) -> None:
    with pytest.raises(ValueError, match=r"t\.h"):
        _read(tmp_path, monkeypatch, text)


@pytest.mark.parametrize("name", ["signature.h", "call_limits.h"])
def test_core_headers_read(name: str) -> None:
    assert ctables.header(name)


@pytest.mark.parametrize("name", ["layout.h", "liveness.h"])
def test_backend_header_read_from_its_directory(name: str) -> None:
    from arfuse.backends.shm import build

    assert ctables.header(name, build.CSRC)
