"""Constants the C++ kernel and Python both need, read from the kernel's own headers.

The segment layout, the call signature and the fp32 limits are ``constexpr`` lines in
``backends/shm/csrc/*.h``; the kernel compiles them and Python reads the same lines here, so
there is one copy of each number (the pure-torch path, the policy and the call checks need
them where no compiler exists). Only the simple form is read: ``constexpr <int64_t | int |
double> kName = <expression of numbers and earlier names>;`` with ``+ - * / << |``,
parentheses and ``int64_t(...)``. A ``constexpr`` function (``constexpr T name(...)``) is C++'s
alone; any other ``constexpr`` line not of the simple form raises, so a constant Python needs is
never silently missing.
"""

from __future__ import annotations

import ast
import functools
import operator
import re
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "backends" / "shm" / "csrc"
_LINE = re.compile(r"^\s*(?:inline\s+)?constexpr\s+(?:u?int64_t|int|double)\s+(k\w+)\s*=\s*"
                   r"([^;]+);", re.MULTILINE)
_CONSTEXPR = re.compile(r"^[^/]*\bconstexpr\b")  # code, not a comment, that says constexpr
_FUNCTION = re.compile(r"^\s*(?:inline\s+)?constexpr\s+[\w:<>]+\s+\w+\s*\(")
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


def _constants(path: Path) -> list[tuple[str, str]]:
    """(name, expression) of each constant line; a constexpr line of another form raises."""
    found: list[tuple[str, str]] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not _CONSTEXPR.match(line) or _FUNCTION.match(line):
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"{path}:{number}: cannot read this constexpr line (only "
                             "'constexpr <int64_t | uint64_t | int | double> kName = <expression>;'"
                             f" on one line is read): {line.strip()!r}")
        found.append((match.group(1), match.group(2)))
    return found


@functools.cache
def header(name: str) -> dict[str, int | float]:
    """Every ``constexpr`` constant of ``csrc/<name>`` by its C++ name (``kCacheLine``...)."""
    path = CSRC / name
    known: dict[str, int | float] = {}
    for constant, expression in _constants(path):
        text = re.sub(r"\bint64_t\s*\(", "(", expression)
        text = re.sub(r"(?<=\d)(?:LL|ULL|ll|u|U)\b", "", text)
        tree = ast.parse(text.strip(), mode="eval")
        known[constant] = _evaluate(tree.body, known, f"{path.name}: {constant}")
    return known


def int_constant(name: str, constant: str) -> int:
    value = header(name)[constant]
    if not isinstance(value, int):
        raise TypeError(f"{name}: {constant} is not an integer constant")
    return value


def float_constant(name: str, constant: str) -> float:
    return float(header(name)[constant])
