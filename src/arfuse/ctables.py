"""Constants the C++ kernels and Python both need, read from the kernels' own headers.

The call signature, the table of quantised outputs and the fp32 limits are ``constexpr`` lines
in the core's ``arfuse/csrc/*.h`` (a backend passes its own directory: the shm segment layout);
the kernel compiles them and Python reads the same lines here, so there is one copy of each
number (the pure-torch path, the policy and the call checks need them where no compiler
exists). Two forms are read. A constant: ``constexpr <int64_t | int | double> kName =
<expression of numbers and earlier names>;`` with ``+ - * / << |``, parentheses and
``int64_t(...)``. A table: ``constexpr <Type> kName[] = {`` then one row a line, ``{cell,
...},`` (cells: numbers, earlier constants, string literals, ``true``/``false``), then ``};``.
A ``constexpr`` function (``constexpr T name(...)``) is C++'s alone; any other ``constexpr``
line raises, so a constant Python needs is never silently missing.
"""

from __future__ import annotations

import ast
import functools
import operator
import re
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
Cell = int | float | str | bool
_LINE = re.compile(r"^\s*(?:inline\s+)?constexpr\s+(?:u?int64_t|int|double)\s+(k\w+)\s*=\s*"
                   r"([^;]+);", re.MULTILINE)
_CONSTEXPR = re.compile(r"^[^/]*\bconstexpr\b")  # code, not a comment, that says constexpr
_FUNCTION = re.compile(r"^\s*(?:inline\s+)?constexpr\s+[^=;{(]*\b\w+\s*\(")
_TABLE = re.compile(r"^\s*(?:inline\s+)?constexpr\s+(\w+)\s+(k\w+)\[\]\s*=\s*\{\s*$")
_ROW = re.compile(r"^\s*\{(.*)\},\s*(?://.*)?$")
_TABLE_END = re.compile(r"^\s*\};\s*$")
_CELL = re.compile(r'\s*("[^"]*"|[^,"]+)\s*(?:,|$)')
_NAMESPACE = re.compile(r"^\s*namespace\s+(\w+)\s*\{")
_NAMESPACE_END = re.compile(r"^\s*\}\s*//\s*namespace\b")
_STRUCT = re.compile(r"^\s*struct\s+(\w+)\s*\{\s*(?://.*)?$")
_FIELD = re.compile(r"^\s*(?:const\s+char\s*\*|u?int64_t|int|bool|double|float)\s+(\w+);")
_STRUCT_END = re.compile(r"^\s*\};")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.LShift: operator.lshift, ast.BitOr: operator.or_}


def _evaluate(node: ast.AST, known: dict[str, int | float], where: str) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in known:
        return known[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, known, where)
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, known, where), _evaluate(node.right, known, where)
        if isinstance(node.op, ast.Div):  # C++: integer division of integers
            both_ints = isinstance(left, int) and isinstance(right, int)
            return left // right if both_ints else left / right  # type: ignore[operator]
        op = _OPERATORS.get(type(node.op))
        if op is not None:
            return op(left, right)  # type: ignore[no-any-return]
    raise ValueError(f"{where}: cannot read {ast.unparse(node)!r} (only numbers, earlier "
                     "constants and + - * / << | are read)")


def _number(expression: str, known: dict[str, int | float], where: str) -> int | float:
    text = re.sub(r"\bint64_t\s*\(", "(", expression)
    text = re.sub(r"(?<=\d)(?:LL|ULL|ll|u|U)\b", "", text)
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{where}: cannot read {expression.strip()!r}") from None
    return _evaluate(tree.body, known, where)


def _cell(text: str, known: dict[str, int | float], where: str) -> Cell:
    text = text.strip()
    if text.startswith('"'):
        return text[1:-1]
    if text in ("true", "false"):
        return text == "true"
    return _number(text, known, where)


@dataclass(frozen=True)
class _Header:
    constants: dict[str, int | float]
    tables: dict[str, list[tuple[Cell, ...]]]
    qualified: dict[str, str]   # a constant's or table's name -> its C++ name with namespaces
    columns: dict[str, tuple[str, ...]]  # a table's name -> its struct's field names


def _read(path: Path) -> _Header:
    """The constants and the tables of ``path``; a constexpr line of another form raises."""
    known: dict[str, int | float] = {}
    tables: dict[str, list[tuple[Cell, ...]]] = {}
    qualified: dict[str, str] = {}
    structs: dict[str, list[str]] = {}
    columns: dict[str, tuple[str, ...]] = {}
    namespaces: list[str] = []
    struct: list[str] | None = None
    table: list[tuple[Cell, ...]] | None = None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        where = f"{path}:{number}"
        if table is not None:
            if _TABLE_END.match(line):
                table = None
                continue
            row = _ROW.match(line)
            if row is None or "{" in row.group(1) or "}" in row.group(1):
                raise ValueError(f"{where}: cannot read this table line (one row a line, "
                                 f"'{{cell, ...}},', then '}};'): {line.strip()!r}")
            table.append(tuple(_cell(cell, known, where)
                               for cell in _CELL.findall(row.group(1))))
            continue
        if struct is not None:
            if _STRUCT_END.match(line):
                struct = None
            elif (field := _FIELD.match(line)) is not None:
                struct.append(field.group(1))
            continue
        if (opened := _NAMESPACE.match(line)) is not None:
            namespaces.append(opened.group(1))
            continue
        if _NAMESPACE_END.match(line) and namespaces:
            namespaces.pop()
            continue
        if (declared := _STRUCT.match(line)) is not None:
            struct = structs[declared.group(1)] = []
            continue
        if not _CONSTEXPR.match(line) or _FUNCTION.match(line):
            continue
        start = _TABLE.match(line)
        if start is not None:
            name = start.group(2)
            table = tables[name] = []
            qualified[name] = "::".join((*namespaces, name))
            columns[name] = tuple(structs.get(start.group(1), ()))
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"{where}: cannot read this constexpr line (only "
                             "'constexpr <int64_t | uint64_t | int | double> kName = <expression>;'"
                             " on one line, or a table 'constexpr <Type> kName[] = {', is read): "
                             f"{line.strip()!r}")
        known[match.group(1)] = _number(match.group(2), known, f"{path.name}: {match.group(1)}")
        qualified[match.group(1)] = "::".join((*namespaces, match.group(1)))
    if table is not None:
        raise ValueError(f"{path}: a table does not end with '}};'")
    return _Header(known, tables, qualified, columns)


_read_paths: set[Path] = set()


@functools.cache
def _header(path: Path) -> _Header:
    _read_paths.add(path)
    return _read(path)


def _path(name: str, directory: Path | None) -> Path:
    return (CSRC if directory is None else directory) / name


def header(name: str, directory: Path | None = None) -> dict[str, int | float]:
    """Every ``constexpr`` constant of ``<directory>/<name>`` (the core's ``arfuse/csrc`` by
    default) by its C++ name (``kCacheLine``...)."""
    return dict(_header(_path(name, directory)).constants)


def table(name: str, constant: str, directory: Path | None = None) -> list[tuple[Cell, ...]]:
    """The rows of the table ``constant`` of ``<directory>/<name>``, each a tuple of cells."""
    tables = _header(_path(name, directory)).tables
    if constant not in tables:
        raise ValueError(f"{name}: no table {constant} (tables: {', '.join(tables) or 'none'})")
    return list(tables[constant])


def cache_clear() -> None:
    """Forget what was read (a test that edits a header)."""
    _header.cache_clear()


def int_constant(name: str, constant: str, directory: Path | None = None) -> int:
    value = header(name, directory)[constant]
    if not isinstance(value, int):
        raise TypeError(f"{name}: {constant} is not an integer constant")
    return value


def float_constant(name: str, constant: str, directory: Path | None = None) -> float:
    return float(header(name, directory)[constant])


def headers_read() -> list[Path]:
    """Every header read so far in this process."""
    return sorted(path for path in _read_paths)


def static_checks(paths: list[Path]) -> str:
    """C++ (C++17) that compiles only where every constant and table cell read from ``paths``
    has, as compiled, the value read here: each one a ``static_assert``. Compiling it checks the
    one thing that could make the two languages differ, this module's reading of the headers."""
    lines = ["#include <cstddef>", *(f'#include "{path.name}"' for path in paths), "",
             "namespace ctables_check {",
             "constexpr bool same(const char* a, const char* b) {",
             "  return *a == *b && (*a == '\\0' || same(a + 1, b + 1));",
             "}",
             "}  // namespace ctables_check", ""]

    def literal(value: Cell) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, float):
            return repr(value)
        return f"{value}ULL" if isinstance(value, int) and value >= 2**63 else str(value)

    for path in paths:
        header = _header(path)
        for name, number in header.constants.items():
            cpp = header.qualified[name]
            lines.append(f'static_assert({cpp} == {literal(number)}, "{path.name}: {name}");')
        for name, rows in header.tables.items():
            cpp, fields = header.qualified[name], header.columns[name]
            lines.append(f"static_assert(sizeof({cpp}) / sizeof({cpp}[0]) == {len(rows)}, "
                         f'"{path.name}: the rows of {name}");')
            for i, row in enumerate(rows):
                if len(row) != len(fields):
                    raise ValueError(f"{path}: row {i} of {name} has {len(row)} cells, its "
                                     f"struct {len(fields)} fields")
                for field, value in zip(fields, row, strict=True):
                    cell = f"{cpp}[{i}].{field}"
                    check = (f'ctables_check::same({cell}, "{value}")' if isinstance(value, str)
                             else f"{cell} == {literal(value)}")
                    lines.append(f'static_assert({check}, "{path.name}: {name}[{i}].{field}");')
    return "\n".join(lines) + "\n"
