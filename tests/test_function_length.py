"""Issue 42's bound: no function over 80 lines in the packages that turn the config into objects
(``config/``, ``workers/``, ``trainers/``). A function that long mixes several jobs; split it by
meaning, each part with its docstring. Lines are counted from ``def`` to the last line of the body,
docstring and comments included, as :mod:`ast` gives them."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tearless"
BOUNDED = ("config", "workers", "trainers")
MAX_LINES = 80


def long_functions(source: str, where: str) -> list[str]:
    """``where:line name (n lines)`` for each function or method of ``source`` longer than the bound."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_LINES:
                found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_over_80_lines_where_the_config_becomes_objects() -> None:
    found = [
        hit
        for package in BOUNDED
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for hit in long_functions(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert found == [], f"functions over {MAX_LINES} lines (split them by meaning):\n" + "\n".join(found)


def test_the_bound_counts_the_whole_function() -> None:
    # def line + 80 body lines = 81 lines: over; one line less is within
    over = "def f():\n" + "    x = 1\n" * 80
    assert long_functions(over, "m.py") == ["m.py:1 f (81 lines)"]
    assert long_functions("def f():\n" + "    x = 1\n" * 79, "m.py") == []
    method = "class C:\n    def g(self):\n" + "        y = 2\n" * 80
    assert long_functions(method, "m.py") == ["m.py:2 g (81 lines)"]
