"""Countdown (the TinyZero task): combine the given numbers with + − × ÷ to reach the target.

A prompt gives 3 or 4 numbers and a target; the response reasons in ``<think>…</think>`` and puts
an equation in ``<answer>…</answer>``, e.g. ``<answer>(95 - 43) * 2</answer>`` for numbers
``[43, 2, 95]`` and target 104. The ground truth is ``{"target": 104, "numbers": [43, 2, 95]}``.

Reward (TinyZero's values): 1.0 when the equation uses every given number exactly once, only
``+ - * /`` and parentheses, and equals the target exactly; ``format_score`` (0.1) when an equation
was given but breaks a rule or misses the target; 0.0 when there is no ``<answer>``. The equation is
parsed with :mod:`ast` and evaluated by walking the tree with exact fractions: nothing is ``eval``'d,
and anything but integer literals, the four operators and parentheses (a name, a call, ``**``, a
unary minus, a float) makes the equation invalid. ``×``, ``÷`` and ``−`` are read as ``*``, ``/`` and
``-``; a trailing ``= <target>`` is allowed (``= <anything else>`` is wrong).
"""

from __future__ import annotations

import ast
import json
import operator
import random
from fractions import Fraction
from typing import Any

from tearless.rewards.format import extract_answer

DATA_SOURCE = "countdown"
MAX_EQUATION_CHARS = 300
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_UNICODE = str.maketrans({"×": "*", "·": "*", "÷": "/", "−": "-", "–": "-"})


class InvalidEquation(ValueError):
    """The equation is not an arithmetic expression over integer literals."""


def parse_equation(text: str) -> ast.expr:
    """Parse ``text`` into an expression tree of integer literals and ``+ - * /``."""
    text = text.translate(_UNICODE).strip()
    if not text or len(text) > MAX_EQUATION_CHARS:
        raise InvalidEquation(f"the equation is empty or longer than {MAX_EQUATION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise InvalidEquation(f"not an arithmetic expression: {text!r}") from exc
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            continue
        if isinstance(node, ast.Constant) and type(node.value) is int:
            continue
        if isinstance(node, ast.operator) and type(node) in _OPS:
            continue
        raise InvalidEquation(f"{type(node).__name__} is not allowed in {text!r}")
    return tree


def literals(tree: ast.expr) -> list[int]:
    """The integer literals of the expression, in order."""
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)]


def evaluate(tree: ast.expr) -> Fraction:
    """The exact value of a tree from :func:`parse_equation`; division by zero raises ``InvalidEquation``."""
    if isinstance(tree, ast.Constant):
        return Fraction(tree.value)
    left, right = evaluate(tree.left), evaluate(tree.right)
    if isinstance(tree.op, ast.Div) and right == 0:
        raise InvalidEquation("division by zero")
    return _OPS[type(tree.op)](left, right)


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    format_score: float = 0.1,
    score: float = 1.0,
) -> dict[str, float]:
    """``score`` for a correct equation, ``format_score`` for a wrong one, 0.0 without an answer."""
    truth = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    target, numbers = Fraction(truth["target"]), sorted(int(n) for n in truth["numbers"])
    answer = extract_answer(solution_str)
    if answer is None:
        return {"score": 0.0, "acc": 0.0}
    equation, _, claimed = answer.partition("=")
    try:
        tree = parse_equation(equation)
        correct = (
            sorted(literals(tree)) == numbers
            and evaluate(tree) == target
            and claimed.strip() in ("", str(truth["target"]))
        )
    except InvalidEquation:
        correct = False
    return {"score": score if correct else format_score, "acc": float(correct)}


def make_problem(rng: random.Random, num_numbers: int, max_number: int = 99, max_target: int = 100) -> dict:
    """A solvable problem: draw numbers, combine them at random into a target in [1, max_target].

    Intermediate results stay positive integers (subtract the smaller from the larger, divide only
    when exact), so the witness ``solution`` is an equation a person would write.
    """
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        pool = [(n, str(n)) for n in numbers]
        while len(pool) > 1:
            (a, ea), (b, eb) = (pool.pop(rng.randrange(len(pool))) for _ in range(2))
            if a < b:
                (a, ea), (b, eb) = (b, eb), (a, ea)
            choices = [ast.Add, ast.Mult] + ([ast.Sub] if a > b else []) + ([ast.Div] if a % b == 0 else [])
            op = rng.choice(choices)
            value = int(_OPS[op](a, b))
            pool.append((value, f"({ea} {_SYMBOLS[op]} {eb})"))
        target, expression = pool[0]
        if 1 <= target <= max_target:
            return {"numbers": numbers, "target": target, "solution": expression[1:-1]}


def prompt_text(numbers: list[int], target: int) -> str:
    """The instruction for one problem."""
    return (
        f"Using the numbers {numbers}, write an equation that equals {target}. You may use +, -, * and / "
        "and parentheses, and must use each number exactly once. Reason inside <think> </think>, then "
        "give only the equation inside <answer> </answer>, for example <answer>(1 + 2) / 3</answer>."
    )


def to_row(problem: dict, split: str, index: int) -> dict:
    """A veRL-schema row for one problem."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": prompt_text(problem["numbers"], problem["target"])}],
        "ability": "math",
        "reward_model": {
            "style": "rule",
            "ground_truth": {"target": problem["target"], "numbers": problem["numbers"]},
        },
        "extra_info": {"split": split, "index": index, "solution": problem["solution"]},
    }


def generate_rows(
    num: int,
    *,
    seed: int,
    split: str,
    num_numbers: tuple[int, ...] = (3, 4),
    max_number: int = 99,
    exclude: set[tuple] | None = None,
) -> list[dict]:
    """``num`` distinct problems (by sorted numbers and target), none in ``exclude``, which grows."""
    rng = random.Random(seed)
    seen = exclude if exclude is not None else set()
    rows: list[dict] = []
    for _ in range(100 * num + 100):
        problem = make_problem(rng, rng.choice(num_numbers), max_number)
        key = (tuple(sorted(problem["numbers"])), problem["target"])
        if key not in seen:
            seen.add(key)
            rows.append(to_row(problem, split, len(rows)))
            if len(rows) == num:
                return rows
    raise ValueError(f"could not draw {num} distinct countdown problems; allow more or larger numbers")
