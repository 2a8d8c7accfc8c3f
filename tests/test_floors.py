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
    # pure math, the CPU/thread settings, the per-device defaults, the fault-injection switches, the
    # parallel toolbox (FSDP2 sharding, DTensor helpers, the weight broadcast; no Ray), user-given files,
    # the reaper (a plain script the processes of every floor tell what they start), cached builds
    (
        "tearless.algos",
        "tearless.cpu",
        "tearless.devices",
        "tearless.faults",
        "tearless.distributed",
        "tearless.userfiles",
        "tearless.reaper",
        "tearless.cachedir",
    ),
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
    # the Python API and the list of its names
    ("tearless.api", "tearless.api_names"),
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


# The plan rule (tearless.config.plan): the facts the plan derives from the config have one home. The
# ranks, groups and trainers above it read them from the plan, never from the config or a helper again.
PLAN_READERS = ("tearless.workers", "tearless.trainers")
# Helpers whose result the plan holds: response_length, critic, distills, roles, loss_scale_factor,
# capabilities, critic_section (config.derived's on_policy went into RunPlan.on_policy).
PLAN_HELPERS = frozenset(
    {"response_length", "critic_enabled", "distills", "roles", "loss_scale_factor", "engine_capabilities"}
    | {"critic_section", "uses_ray"}
)
# Where a reader may still build a plan: a RankSpec given none builds the config's own; the two drivers
# (the RL trainer, tearless eval's trainers.validation.evaluate) build the run's, once.
PLAN_BUILDERS = {"tearless.workers.spec", "tearless.trainers.rl", "tearless.trainers.validation"}


def _plan_rereads(module: str, tree: ast.AST) -> list[str]:
    """Where ``module`` derives a planned fact itself: a call to (or an import of) a helper in
    :data:`PLAN_HELPERS`, ``build_plan`` outside :data:`PLAN_BUILDERS`, ``<...>.response_length or
    ...`` (the response cap worked out by hand), a read of ``fsdp_config.param_dtype`` (the plan
    holds it with ``auto`` resolved) or ``SourceSettings.from_config`` (the plan holds the source's
    settings)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = {a.name for a in node.names} & (PLAN_HELPERS | {"build_plan"})
            if module in PLAN_BUILDERS:
                names -= {"build_plan"}
            found += [f"{module}:{node.lineno} imports {name}" for name in sorted(names)]
        elif isinstance(node, ast.Call):
            func = node.func
            name = getattr(func, "id", None) or getattr(func, "attr", "")
            owner = getattr(getattr(func, "value", None), "id", None)
            if name in PLAN_HELPERS:
                found.append(f"{module}:{node.lineno} calls {name}()")
            elif name == "from_config" and owner == "SourceSettings":
                found.append(f"{module}:{node.lineno} builds the source's settings")
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            first = node.values[0]
            if isinstance(first, ast.Attribute) and first.attr == "response_length":
                found.append(f"{module}:{node.lineno} works out the response cap")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "param_dtype"
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "fsdp_config"
        ):
            found.append(f"{module}:{node.lineno} reads fsdp_config.param_dtype")
    return found


def test_planned_facts_are_read_from_the_plan() -> None:
    """Above the config floor the workers and trainers read each derived fact from the plan."""
    readers = [m for m in MODULES if any(m == r or m.startswith(r + ".") for r in PLAN_READERS)]
    found = [hit for m in readers for hit in _plan_rereads(m, ast.parse(MODULES[m].read_text()))]
    assert found == [], "facts the plan holds, derived again (read them from RunPlan):\n" + "\n".join(found)


# The sections rule: the worker groups and their ranks receive the plan (RankSpec.plan: the derived facts
# and the config's sections, each reader its own), never the config. calibrate measures param_dtype=auto
# in the driver, before the plan it completes reaches a rank, so it reads the config it is given.
CONFIG_FREE = "tearless.workers"
CONFIG_READERS = {"tearless.workers.calibrate"}
# attributes only a whole config (or a spec carrying one) has: Sections names the rest
CONFIG_ONLY = frozenset({"cfg", "actor_rollout_ref", "algorithm", "task"})


def _config_reads(module: str, tree: ast.AST) -> list[str]:
    """Where ``module`` reads the whole config: ``<...>.cfg`` (a spec or group carrying one) or a section
    only the config's root has (``actor_rollout_ref``, ``algorithm``, ``task``)."""
    return [
        f"{module}:{node.lineno} reads .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in CONFIG_ONLY
    ]


def test_the_ranks_read_the_plan_not_the_config() -> None:
    """Below the trainers, the groups and ranks read the config's sections from the plan."""
    readers = [m for m in MODULES if m.startswith(CONFIG_FREE + ".") and m not in CONFIG_READERS]
    found = [hit for m in readers for hit in _config_reads(m, ast.parse(MODULES[m].read_text()))]
    assert found == [], "the config read below the plan (read RankSpec.sections):\n" + "\n".join(found)


def test_the_sections_rule_catches_each_config_read() -> None:
    source = "\n".join(
        [
            "t = self.spec.cfg.trainer",
            "n = cfg.actor_rollout_ref.rollout.n",
            "b = cfg.algorithm.rollout_correction.bypass_mode",
            "n = self.spec.sections.rollout.n",
        ]
    )
    assert _config_reads("tearless.workers.x", ast.parse(source)) == [
        "tearless.workers.x:1 reads .cfg",
        "tearless.workers.x:2 reads .actor_rollout_ref",
        "tearless.workers.x:3 reads .algorithm",
    ]


def test_the_plan_rule_catches_each_reread() -> None:
    """Each kind of re-derivation the rule guards against is found in a module that does it."""
    source = "\n".join(
        [
            "from tearless.config.derived import roles",
            "n = cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length",
            "c = engine_capabilities(name)",
            "d = cfg.actor_rollout_ref.actor.fsdp_config.param_dtype",
            "p = build_plan(cfg)",
            "q = plan.response_length",
            "s = SourceSettings.from_config(cfg, total_steps=3, max_new_tokens=8)",
            "a = AgentSettings.from_config(mt)",
        ]
    )
    found = _plan_rereads("tearless.workers.x", ast.parse(source))
    assert found == [
        "tearless.workers.x:1 imports roles",
        "tearless.workers.x:2 works out the response cap",
        "tearless.workers.x:3 calls engine_capabilities()",
        "tearless.workers.x:4 reads fsdp_config.param_dtype",
        "tearless.workers.x:7 builds the source's settings",
    ]
    builder = ast.parse("from tearless.config.plan import build_plan")
    assert _plan_rereads("tearless.workers.spec", builder) == []
    assert _plan_rereads("tearless.workers.x", builder) == ["tearless.workers.x:1 imports build_plan"]
