r"""Chained addition worked one step per line: an embedded task whose every step a verifier can check.

A prompt adds four numbers, ``"23+58+17+40="``; the worked answer keeps a running sum, one line per
addition, and its last line's result is the answer::

    23+58=81
    81+17=98
    98+40=138

**Steps** are the lines (separator ``"\n"``). Step j reads ``x+y=z`` and is *valid* when x is the
running sum so far **as the response itself wrote it** (the first operand for the first step, the
previous line's z after that), y is the next operand and z = x + y: a step is judged on its own, so
one wrong sum does not make every later step wrong (the process reward models of PRM800K and
Math-Shepherd judge steps the same way).

**Reward**: ``score`` (the outcome) is 1.0 when the last line's result is the sum, else 0.0;
``step_scores`` holds 1.0 / 0.0 per line with its ``step_ends``, and ``step_validity`` (logged) is the
share of the three expected steps that are present and valid. With ``reward_model.step_reward`` the
trainer puts each step score on its line's last token (:mod:`tearless.rewards.steps`).

**Warm-up**: the flawed teacher works every step but, when a step's units column carries, drops the
carry with probability ``forget_carry`` (``98+40=128`` is right; ``81+17=88`` drops it); later steps
continue from the wrong sum. The imitating model mostly drops carries under greedy decoding and
samples the carry some of the time: room for RL, where outcome supervision sees one bit per answer
and process supervision sees which step broke.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

DATA_SOURCE = "chain_addition"
NUM_OPERANDS = 3
MAX_OPERAND = 99
SEPARATOR = "\n"
# The longest worked answer, "99+99=198\n198+99=297", is 20 characters; one token each
# with the char tokenizer, plus the end-of-turn token.
RESPONSE_TOKENS = 24
# Supervised warm-up steps the task needs (measured with 4 numbers: 300 steps gave 0.03 greedy
# accuracy; with 3 numbers, 800 steps give 0.27 and a step validity of 0.58).
WARMUP_STEPS = 800
_LINE = re.compile(r"^\s*(\d+)\+(\d+)=(\d+)\s*$")
_FINAL = re.compile(r"=\s*(\d+)\s*$")


def worked_lines(
    operands: Sequence[int], rng: random.Random | None = None, forget_carry: float = 0.0
) -> list[str]:
    """The lines of the worked answer; with ``rng``, a step whose units carry drops the carry with
    probability ``forget_carry`` and the next step starts from that wrong sum (the flawed teacher)."""
    lines, total = [], operands[0]
    for y in operands[1:]:
        z = total + y
        if rng is not None and total % 10 + y % 10 >= 10 and rng.random() < forget_carry:
            z -= 10
        lines.append(f"{total}+{y}={z}")
        total = z
    return lines


def judge_steps(solution_str: str, operands: Sequence[int]) -> tuple[list[float], list[int], float]:
    """``(step_scores, step_ends, step_validity)`` of a response: 1.0 / 0.0 per non-empty line, the
    lines' end offsets, and the share of the ``len(operands) - 1`` expected steps present and valid."""
    # torch: config validation imports this module's constants without it
    from tearless.rewards.steps import split_steps

    ends = split_steps(solution_str, SEPARATOR)
    scores, running, start = [], operands[0], 0
    for j, end in enumerate(ends):
        line = solution_str[start:end]
        start = end
        match = _LINE.match(line.strip("\n"))
        valid = False
        if match and j + 1 < len(operands):
            x, y, z = (int(g) for g in match.groups())
            valid = x == running and y == operands[j + 1] and z == x + y
        if match:
            running = int(match.group(3))
        scores.append(1.0 if valid else 0.0)
    expected = len(operands) - 1
    return scores, ends, sum(scores[:expected]) / expected


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """The outcome (``score``, ``acc``: the last line's result is ``ground_truth``) and, when
    ``extra_info["operands"]`` is given (the rows carry it), ``step_scores``, ``step_ends`` and
    ``step_validity``."""
    match = _FINAL.search(solution_str)
    right = float(match is not None and int(match.group(1)) == int(str(ground_truth).strip()))
    result: dict[str, Any] = {"score": right, "acc": right}
    if extra_info and extra_info.get("operands") is not None:
        operands = [int(x) for x in extra_info["operands"]]
        scores, ends, validity = judge_steps(solution_str, operands)
        result.update(step_validity=validity)
        if scores:
            result.update(step_scores=scores, step_ends=ends)
    return result


def to_row(operands: Sequence[int], split: str, index: int) -> dict:
    """A veRL-schema row for ``operands``."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": "+".join(map(str, operands)) + "="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(sum(operands))},
        "extra_info": {"split": split, "index": index, "operands": list(operands)},
    }


def generate_rows(
    num: int, *, seed: int, split: str, exclude: set[tuple[int, ...]] | None = None
) -> list[dict]:
    """``num`` distinct problems of ``NUM_OPERANDS`` operands in [0, 99], none of them in ``exclude``."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    rows: list[dict] = []
    while len(rows) < num:
        operands = tuple(rng.randint(0, MAX_OPERAND) for _ in range(NUM_OPERANDS))
        if operands in seen:
            continue
        seen.add(operands)
        rows.append(to_row(operands, split, len(rows)))
    return rows


def task_rows(spec: Any) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows of ``spec`` (a :class:`~tearless.tasks.bootstrap.TaskSpec`)."""
    val_rows = generate_rows(spec.num_val, seed=spec.seed * 1000 + 1, split="test")
    held_out = {tuple(r["extra_info"]["operands"]) for r in val_rows}
    train_rows = generate_rows(spec.num_train, seed=spec.seed * 1000 + 2, split="train", exclude=held_out)
    return train_rows, val_rows


def teacher(row: dict, rng: random.Random, forget_carry: float) -> str:
    """The flawed teacher's demonstration for a prompt row (see the module docs)."""
    return SEPARATOR.join(worked_lines(row["extra_info"]["operands"], rng, forget_carry))
