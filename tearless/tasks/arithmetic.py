"""The embedded default task: integer addition, answered with the digits of the sum.

A prompt is one user message such as ``"47+38="`` and the correct response is ``"85"`` followed by
the end-of-turn token. The reward is 1.0 for the exact sum and 0.0 otherwise (also for anything
that is not an integer), so accuracy and mean reward are the same number.
"""

from __future__ import annotations

import re
from typing import Any

DATA_SOURCE = "arithmetic"

_FINAL = re.compile(r"(?:^|,)\s*([+-]?\d+)\s*$")


def extract_answer(solution_str: str) -> int | None:
    """The final answer: the integer after the last comma (or the whole response if it is one)."""
    match = _FINAL.search(solution_str)
    return int(match.group(1)) if match else None


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 when the final answer equals ``ground_truth``, else 0.0 (also when there is none)."""
    answer = extract_answer(solution_str)
    return 1.0 if answer is not None and answer == int(str(ground_truth).strip()) else 0.0


def make_problem(rng, max_operand: int = 99) -> tuple[int, int]:
    """Draw two operands uniformly from [0, max_operand] with a ``random.Random``."""
    return rng.randint(0, max_operand), rng.randint(0, max_operand)


def to_row(a: int, b: int, split: str, index: int, *, data_source: str = DATA_SOURCE) -> dict:
    """A veRL-schema row for ``a+b`` (also the long_addition task's, under its ``data_source``)."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{a}+{b}="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def generate_rows(
    num: int, *, seed: int, split: str, max_operand: int = 99, exclude: set[tuple[int, int]] | None = None
) -> list[dict]:
    """``num`` distinct problems, none of them in ``exclude`` (used to keep test apart from train)."""
    import random

    rng = random.Random(seed)
    seen = set(exclude or ())
    rows: list[dict] = []
    if num > (max_operand + 1) ** 2 - len(seen):
        raise ValueError(f"cannot draw {num} distinct problems with operands up to {max_operand}")
    while len(rows) < num:
        a, b = make_problem(rng, max_operand)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append(to_row(a, b, split, len(rows)))
    return rows


def worked_answer(a: int, b: int, answer: int) -> str:
    """The response format: the units column worked out, then the final answer (``7+8=15, 85``)."""
    return f"{a % 10}+{b % 10}={a % 10 + b % 10}, {answer}"


def flawed_teacher(a: int, b: int, rng, forget_carry: float) -> str:
    """The demonstration the warm-up imitates: the units column is always worked out right, but
    when it carries, the carry is dropped from the answer with probability ``forget_carry``
    (``7+8=15, 75`` for ``47+38``).

    This is the embedded stand-in for imperfect supervised data: a model that imitates it answers
    carry problems wrongly under greedy decoding while still sampling the right answer some of the
    time, which is exactly the room that RL on a verifiable reward exploits.
    """
    if has_units_carry(a, b) and rng.random() < forget_carry:
        return worked_answer(a, b, a + b - 10)
    return worked_answer(a, b, a + b)


def has_units_carry(a: int, b: int) -> bool:
    """True when the units digits of ``a`` and ``b`` sum to 10 or more."""
    return a % 10 + b % 10 >= 10
