"""Easy one-step word problems (add or subtract two numbers), for small pretrained instruct models.

A prompt is one user message such as ``"Mia has 3 pencils. She buys 5 more. How many pencils does
Mia have now? Answer with a number."``; the ground truth is the integer result (always >= 0). The
reward is 1.0 when the last integer in the response equals it, else 0.0, so a model may reason in
words before the answer. This is the real-model recipe's task (docs/real-model.md): SmolLM2-135M-
Instruct answers about a third of these correctly before training, so its groups carry signal.
"""

from __future__ import annotations

import random
import re
from typing import Any

DATA_SOURCE = "word_problems"
_NUMBER = re.compile(r"-?\d[\d,]*")
_NAMES = [
    ("Mia", "She"), ("Tom", "He"), ("Ava", "She"), ("Leo", "He"), ("Zoe", "She"), ("Sam", "He"),
    ("Lily", "She"), ("Ben", "He"), ("Emma", "She"), ("Noah", "He"), ("Ruby", "She"), ("Jack", "He"),
]  # fmt: skip
_ITEMS = [
    "apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "cards", "shells",
    "balloons", "coins", "eggs",
]  # fmt: skip
# (template, operation): {n} name, {p} pronoun, {m} a second name, {i} item, {a} {b} the numbers.
_TEMPLATES = [
    ("{n} has {a} {i}. {p} buys {b} more. How many {i} does {n} have now?", "+"),
    ("There are {a} {i} in a box. {n} puts in {b} more. How many {i} are in the box now?", "+"),
    ("{n} has {a} {i} and {m} has {b} {i}. How many {i} do they have together?", "+"),
    ("{n} found {a} {i} on Monday and {b} {i} on Tuesday. How many {i} did {n} find in all?", "+"),
    ("{n} has {a} {i}. {p} gives {b} to {m}. How many {i} does {n} have left?", "-"),
    ("There are {a} {i} in a basket. {n} takes out {b}. How many {i} are left in the basket?", "-"),
    ("{n} had {a} {i} and lost {b} of them. How many {i} does {n} have now?", "-"),
    ("{n} has {a} {i}. {m} has {b} fewer {i} than {n}. How many {i} does {m} have?", "-"),
]
SUFFIX = " Answer with a number."
# Operands up to 5 (differences up to 10): SmolLM2-135M-Instruct (Q4_1) answers 35% of such stories
# greedily; with operands up to 10, 22%; up to 60, 14% (too few right samples for GRPO to learn from).
MAX_NUMBER = 5


def extract_answer(solution_str: str) -> int | None:
    """The last integer in the response (thousands commas allowed), or None."""
    found = _NUMBER.findall(solution_str)
    return int(found[-1].replace(",", "")) if found else None


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 when the response's last integer equals ``ground_truth``, else 0.0 (also when it has none)."""
    answer = extract_answer(solution_str)
    return 1.0 if answer is not None and answer == int(str(ground_truth).strip()) else 0.0


def make_problem(rng: random.Random, max_number: int = MAX_NUMBER) -> tuple[int, int, int, int, int]:
    """(template, name, item, a, b) drawn with ``rng``: a sum of a in [1, max_number] and b in
    [1, max_number], or a difference a - b with b in [1, max_number] and a in [b + 1, b + max_number]
    (never negative)."""
    t = rng.randrange(len(_TEMPLATES))
    b = rng.randint(1, max_number)
    a = rng.randint(1, max_number) if _TEMPLATES[t][1] == "+" else rng.randint(b + 1, b + max_number)
    return t, rng.randrange(len(_NAMES)), rng.randrange(len(_ITEMS)), a, b


def to_row(problem: tuple[int, int, int, int, int], split: str, index: int) -> dict:
    """A veRL-schema row for one problem."""
    t, who, item, a, b = problem
    template, op = _TEMPLATES[t]
    name, pronoun = _NAMES[who]
    other = _NAMES[(who + 1) % len(_NAMES)][0]
    text = template.format(n=name, p=pronoun, m=other, i=_ITEMS[item], a=a, b=b) + SUFFIX
    answer = a + b if op == "+" else a - b
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": text}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b, "op": op},
    }


def generate_rows(
    num: int, *, seed: int, split: str, exclude: set | None = None, max_number: int = MAX_NUMBER
) -> list[dict]:
    """``num`` distinct problems none of which is in ``exclude``; each drawn one is added to it."""
    rng = random.Random(seed)
    seen = exclude if exclude is not None else set()
    rows: list[dict] = []
    limit = len(_TEMPLATES) * len(_NAMES) * len(_ITEMS) * max_number**2
    if num + len(seen) > limit // 2:
        raise ValueError(f"cannot draw {num} distinct word problems (about {limit // 2} exist)")
    while len(rows) < num:
        problem = make_problem(rng, max_number)
        if problem in seen:
            continue
        seen.add(problem)
        rows.append(to_row(problem, split, len(rows)))
    return rows
