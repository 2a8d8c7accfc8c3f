"""Geometry3K (``hiyouga/geometry3k``, veRL's multimodal example): veRL's ``geo3k`` score.

0.9 × accuracy + 0.1 × format, as veRL's ``reward_score/geo3k.py``: the format is ``<think>…</think>``
followed by a ``\\boxed{…}`` answer (the whole response, across lines); the accuracy is the last
``\\boxed{…}``'s content equal to the ground truth (:func:`tearless.rewards.math_answer.is_equivalent`;
veRL grades with mathruler's ``grade_answer``).
"""

from __future__ import annotations

import re
from typing import Any

from tearless.rewards.math_answer import is_equivalent, last_boxed

_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """0.9 · [the last boxed answer equals ``ground_truth``] + 0.1 · [the response has veRL's format]."""
    answer = last_boxed(solution_str)
    correct = answer is not None and is_equivalent(answer, str(ground_truth))
    formatted = _FORMAT.fullmatch(solution_str) is not None
    return 0.9 * correct + 0.1 * formatted
