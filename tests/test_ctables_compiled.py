"""The constants and tables Python reads from the kernels' headers (``arfuse.ctables``) are the
ones C++ compiles: a file of ``static_assert``s, one per constant and table cell read, compiles
against the headers; with one value changed it does not."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from arfuse import ctables

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler")

CORE = ctables.CSRC
SHM = Path(ctables.__file__).resolve().parent / "backends" / "shm" / "csrc"


def read_by_arfuse() -> list[Path]:
    """Every header of arfuse's that its modules read (importing them reads them; other tests
    in this process may have read headers of their own)."""
    import arfuse
    import arfuse.backends.shm.layout
    import arfuse.backends.shm.segment
    import arfuse.call_checks
    import arfuse.epilogue
    import arfuse.quant
    import arfuse.signature  # noqa: F401

    package = Path(ctables.__file__).resolve().parent
    return [path for path in ctables.headers_read() if path.is_relative_to(package)]


def compiles(source: str, tmp_path: Path) -> tuple[bool, str]:
    path = tmp_path / "checks.cpp"
    path.write_text(source)
    done = subprocess.run([shutil.which("c++") or "g++", "-std=c++17", "-fsyntax-only",
                           f"-I{CORE}", f"-I{SHM}", str(path)], capture_output=True, text=True,
                          timeout=120)
    return done.returncode == 0, done.stderr


def test_every_header_python_reads_compiles_to_the_values_it_read(tmp_path: Path) -> None:
    headers = read_by_arfuse()
    names = {path.name for path in headers}
    assert {"signature.h", "quant_outputs.h", "call_limits.h", "numerics.h", "layout.h",
            "liveness.h"} <= names, names
    source = ctables.static_checks(headers)
    assert source.count("static_assert(") >= 200  # every constant and every table cell
    assert 'arfuse::kQuantOutputs[7].layout, "ue8m0_packed"' in source
    ok, errors = compiles(source, tmp_path)
    assert ok, errors


@pytest.mark.parametrize(("old", "new"), [
    ("arfuse::kE4m3Max == 448.0", "arfuse::kE4m3Max == 447.0"),
    ("arfuse::signature::kPatternBits == 9", "arfuse::signature::kPatternBits == 8"),
    ('same(arfuse::kQuantOutputs[3].layout, "swizzled_128x4")',
     'same(arfuse::kQuantOutputs[3].layout, "swizzled_128x")'),
    ("arfuse::kQuantOutputs[2].floor == 4.359654017857143e-06",
     "arfuse::kQuantOutputs[2].floor == 4.359654017857144e-06"),
])
def test_a_value_read_wrong_fails_the_compile(tmp_path: Path, old: str, new: str) -> None:
    source = ctables.static_checks(read_by_arfuse())
    assert old in source
    ok, errors = compiles(source.replace(old, new), tmp_path)
    assert not ok and "static assertion failed" in errors
