"""Column-by-column addition of two five-digit numbers: a task whose answers are 32–64 tokens long.

It is the embedded stand-in for "longer reasoning" in the medium benchmarks: the response works
each column from the units up, then gives the sum. For ``47391+25868=`` the worked answer is
``1+8=9;9+6=15;3+8+1=12;7+5+1=13;4+2+1=7;=73259``: a column reads ``x+y=s`` or, when the column
to its right carried, ``x+y+1=s``. With the character tokenizer that is 36–52 tokens (plus the
end-of-turn token).

**Reward**: ``0.5 · similarity + 0.5 · [final sum right]``, where ``similarity`` is difflib's
ratio 2·M / (|response| + |reference|) between the response and the reference worked answer (M =
characters in matching blocks), so a model that has only half learned the format and the column
sums still gets a graded signal; ``acc`` is 1.0 exactly when the final sum is right.
"""

from __future__ import annotations

import difflib
import random
import re
from typing import Any

from tearless.tasks.arithmetic import to_row

DATA_SOURCE = "long_addition"
DIGITS = 5
_FINAL = re.compile(r"=\s*(\d+)\s*$")


def worked_answer(a: int, b: int) -> str:
    """The full response for ``a+b``: every column from the units up, then ``=`` and the sum."""
    parts, carry = [], 0
    for i in range(DIGITS):
        x, y = a // 10**i % 10, b // 10**i % 10
        s = x + y + carry
        parts.append(f"{x}+{y}{'+1' if carry else ''}={s}")
        carry = s // 10
    return ";".join(parts) + f";={a + b}"


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """``score`` = 0.5 · similarity to the reference worked answer + 0.5 · [final sum right].

    ``ground_truth`` is the sum; the reference worked answer comes from ``extra_info["a"]``/``["b"]``
    when given (the rows carry them), else only the final sum is scored.
    """
    match = _FINAL.search(solution_str)
    right = match is not None and int(match.group(1)) == int(str(ground_truth).strip())
    similarity = 0.0
    if extra_info and "a" in extra_info and "b" in extra_info:
        reference = worked_answer(int(extra_info["a"]), int(extra_info["b"]))
        similarity = difflib.SequenceMatcher(None, solution_str.strip(), reference, autojunk=False).ratio()
    return {"score": 0.5 * similarity + 0.5 * float(right), "acc": float(right), "similarity": similarity}


def generate_rows(
    num: int, *, seed: int, split: str, exclude: set[tuple[int, int]] | None = None
) -> list[dict]:
    """``num`` distinct problems with five-digit operands, none of them in ``exclude``."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    rows: list[dict] = []
    low, high = 10 ** (DIGITS - 1), 10**DIGITS - 1
    while len(rows) < num:
        a, b = rng.randint(low, high), rng.randint(low, high)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append(to_row(a, b, split, len(rows), data_source=DATA_SOURCE))
    return rows
