"""The import contract: every tearless module stands on a floor, imports only from its own floor or the
floors below it, never in a circle, and says why when it imports a tearless module inside a function.

The floors are listed once, in :data:`FLOORS` (docs/development.md draws them). The graph is read from
the source with :mod:`ast`, so it sees the imports inside functions too, which a run-time check would
miss until the function runs. Imports under ``if TYPE_CHECKING:`` never execute: they count for the
floor check (a type from above is still an upward dependency) but not for the cycle check.

A new module fails :func:`test_every_module_has_a_floor` until its package (or the module itself) is
added to :data:`FLOORS`: put it on the lowest floor that holds everything it imports.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tearless"

# Lowest first. An entry names a package (it covers every module in it) or one module; ``tearless``
# names only the package's own ``__init__``. A module may import its own floor and the floors below.
FLOORS: tuple[tuple[str, ...], ...] = (
    # pure math, the CPU/thread settings, the fault-injection switches, the parallel toolbox (FSDP2
    # sharding, DTensor helpers, the weight broadcast; no Ray)
    ("tearless.algos", "tearless.cpu", "tearless.faults", "tearless.distributed"),
    # Hugging Face models: loading, log-probs, packing, LoRA, value heads, weights
    ("tearless.models",),
    # scorers, reward managers, the sandbox, process reward models
    ("tearless.rewards",),
    # tools for the agent loop (the python tool runs in the rewards' sandbox)
    ("tearless.tools",),
    # rollout engines and the agent loop
    ("tearless.rollout",),
    # environments and agent programs the rollout drives: the protocol, the OpenAI-compatible endpoint
    ("tearless.envs",),
    # rows, prompt datasets, batching
    ("tearless.data",),
    # embedded tasks: they make data, tokenizers and untrained tiny models (no training)
    ("tearless.tasks",),
    # what a run keeps and checks: checkpoints and their manifest, the loggers, the weight guard, timers
    ("tearless.run",),
    # the schema, loading, validation, resume checks and the facts derived from a resolved config
    ("tearless.config",),
    # ranks, roles, the update schedule and the worker groups (in-process and Ray)
    ("tearless.workers",),
    # the loops: RL, SFT, DPO/KTO, and the warm-ups that train the tasks' tiny models
    ("tearless.trainers",),
    # what sits on a trainer: Flow-GRPO, reports, the samples viewer
    ("tearless.flow", "tearless.report", "tearless.samples"),
    # the Python API
    ("tearless.api",),
    # the command line, the generated reference pages, the package's lazy attributes
    ("tearless.cli", "tearless.__main__", "tearless.main_ppo", "tearless.reference", "tearless"),
)


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    local: bool  # inside a function (or class body), not at module level
    type_only: bool  # under ``if TYPE_CHECKING:``


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _targets(node: ast.Import | ast.ImportFrom, module: str, path: Path, mods: dict[str, Path]) -> list[str]:
    """The tearless modules an import statement loads (``from pkg import name`` loads ``pkg.name``
    when that is a module, else ``pkg``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out = []
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name.startswith("tearless") and name != module:
            out.append(name)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _edges(mods: dict[str, Path]) -> list[Edge]:
    edges = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))

        def visit(node: ast.AST, local: bool, type_only: bool, module=module, path=path) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _targets(child, module, path, mods):
                        edges.append(Edge(module, target, child.lineno, local, type_only))
                elif isinstance(child, ast.If) and _is_type_checking(child.test):
                    for stmt in child.body:
                        visit(ast.Module(body=[stmt], type_ignores=[]), local, True)
                    for stmt in child.orelse:
                        visit(ast.Module(body=[stmt], type_ignores=[]), local, type_only)
                else:
                    inner = isinstance(
                        child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
                    )
                    visit(child, local or inner, type_only)

        visit(tree, False, False)
    return edges


def _floor_of(module: str) -> int | None:
    best, best_len = None, -1
    for level, entries in enumerate(FLOORS):
        for entry in entries:
            covers = module == entry or (entry != "tearless" and module.startswith(entry + "."))
            if covers and len(entry) > best_len:
                best, best_len = level, len(entry)
    return best


def _cycles(edges: list[Edge], mods: dict[str, Path]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for e in edges:
        if not e.type_only:
            graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


MODULES = _modules()
EDGES = _edges(MODULES)
# a comment on the import's line, or on the line(s) right above it or above its run of imports
_REASON = re.compile(r"#\s*\S")
_MODULE_REASON = re.compile(r"# local imports: \S")


def test_every_module_has_a_floor() -> None:
    unplaced = [m for m in MODULES if _floor_of(m) is None]
    assert not unplaced, f"modules on no floor (add them to FLOORS in {__file__}): {unplaced}"


def test_no_import_cycle() -> None:
    cycles = _cycles(EDGES, MODULES)
    assert cycles == [], f"{len(cycles)} import cycle(s), function-local imports included: {cycles}"


def test_no_upward_import() -> None:
    upward = [
        f"{e.source}:{e.line} (floor {_floor_of(e.source)}) imports {e.target} (floor {_floor_of(e.target)})"
        for e in EDGES
        if (_floor_of(e.source) or 0) < (_floor_of(e.target) or 0)
    ]
    assert upward == [], "upward imports:\n" + "\n".join(upward)


def _has_reason(lines: list[str], line: int) -> bool:
    """Whether the import at 1-based ``line`` carries a comment: on its own line(s), or on the comment
    line(s) right above it, or right above the run of import lines it belongs to."""
    if _REASON.search(lines[line - 1]):
        return True
    i = line - 2
    while (
        i >= 0
        and re.match(r"\s*(from \S+ import |import |\)|[\w, ]+,?\s*$)", lines[i])
        and "#" not in lines[i]
    ):
        i -= 1
    return i >= 0 and lines[i].lstrip().startswith("#")


def test_function_local_imports_say_why() -> None:
    """A tearless module imported inside a function instead of at the top carries a comment saying why
    (an optional heavy dependency behind it, ``--help`` speed): a cycle is never the reason. A module
    whose every local import has one reason says it once, in a top-level ``# local imports: <why>``."""
    silent = []
    for e in EDGES:
        if e.local and not e.type_only:
            lines = MODULES[e.source].read_text().splitlines()
            if not any(_MODULE_REASON.match(line) for line in lines) and not _has_reason(lines, e.line):
                silent.append(f"{e.source}:{e.line} imports {e.target}")
    assert sorted(set(silent)) == [], "function-local imports without a comment saying why:\n" + "\n".join(
        sorted(set(silent))
    )


def test_the_checks_catch_what_they_guard() -> None:
    """The graph reader sees a function-local import, a relative import and a TYPE_CHECKING import, and
    the cycle finder finds a three-module ring (the contract would otherwise pass by seeing nothing)."""
    assert any(e.local for e in EDGES) and any(not e.local for e in EDGES)
    mods = {"tearless.a": PACKAGE, "tearless.b": PACKAGE, "tearless.c": PACKAGE, "tearless.d": PACKAGE}
    ring = [
        Edge("tearless.a", "tearless.b", 1, False, False),
        Edge("tearless.b", "tearless.c", 1, True, False),
    ]
    assert _cycles([*ring, Edge("tearless.c", "tearless.a", 1, True, False)], mods) == [
        ["tearless.a", "tearless.b", "tearless.c"]
    ]
    assert _cycles([*ring, Edge("tearless.c", "tearless.a", 1, True, True)], mods) == []
    assert _floor_of("tearless.algos.losses") == 0 and _floor_of("tearless") == len(FLOORS) - 1
    assert _floor_of("tearless.not_a_package_yet") is None
    assert _has_reason(["    # vllm is optional", "    from tearless.rollout import vllm"], 2)
    assert not _has_reason(["    x = 1", "    from tearless.rollout import vllm"], 2)


@pytest.mark.parametrize("floor", range(len(FLOORS)))
def test_floors_name_real_packages(floor: int) -> None:
    for entry in FLOORS[floor]:
        real = entry in MODULES or any(m.startswith(entry + ".") for m in MODULES)
        assert real, f"FLOORS names {entry}, which is not a tearless module or package"
