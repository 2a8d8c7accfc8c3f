"""The scorer of ``reasoning_gym/<task>`` rows: reasoning-gym's own ``score_answer``.

The answer is the text inside the last ``<answer>…</answer>`` of the response if it has one, else
the whole response, stripped. The score is what the task's ``score_answer(answer, entry)`` gives
(1.0 for a correct answer; some tasks give partial credit), with ``entry`` the row's own
(``extra_info["reasoning_gym_entry"]``, written by :mod:`tearless.data.reasoning_gym`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@functools.cache
def _score_fn(task: str) -> Any:
    try:
        import reasoning_gym  # optional dependency, imported only to score these rows
    except ImportError:
        raise ImportError(
            "data_source reasoning_gym/* needs the reasoning-gym package: pip install 'tearless[agents]'"
        ) from None
    return reasoning_gym.get_score_answer_fn(task)


def extract_answer(solution_str: str) -> str:
    found = _ANSWER.findall(solution_str)
    return (found[-1] if found else solution_str).strip()


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """reasoning-gym's score of the response's answer (see the module docstring)."""
    info = extra_info or {}
    if "reasoning_gym_entry" not in info or "reasoning_gym_task" not in info:
        raise ValueError(
            "a reasoning_gym/* row needs extra_info.reasoning_gym_task and .reasoning_gym_entry; "
            "write the rows with `tearless data make reasoning_gym:<task>`"
        )
    entry = json.loads(info["reasoning_gym_entry"])
    entry["answer"] = str(ground_truth)
    return float(_score_fn(info["reasoning_gym_task"])(extract_answer(solution_str), entry))
