"""Exact match for short-answer QA, with Search-R1's normalisation.

Both sides are lower-cased and stripped of punctuation, of the articles a/an/the and of extra
whitespace, so ``"<answer>The Eiffel Tower.</answer>"`` matches ``"eiffel tower"``. The answer is the
content of the last ``<answer>…</answer>`` in the response, or the whole response if it has none.
"""

from __future__ import annotations

import re
import string
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and articles, collapse whitespace (SQuAD / Search-R1 style)."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def extract_answer(solution_str: str) -> str:
    """The content of the last ``<answer>…</answer>``, or the whole text if there is none."""
    matches = _ANSWER.findall(solution_str)
    return matches[-1] if matches else solution_str


def targets(ground_truth: Any) -> list[str]:
    """The accepted answers: a string, a list of strings, or Search-R1's ``{"target": [...]}``."""
    if isinstance(ground_truth, dict):
        if "target" not in ground_truth:
            raise ValueError(
                f"an exact-match ground truth dict needs a 'target' key holding the accepted answers; "
                f"it has keys {sorted(ground_truth)}"
            )
        ground_truth = ground_truth["target"]
    if isinstance(ground_truth, str):
        return [ground_truth]
    if isinstance(ground_truth, (list, tuple)) or hasattr(ground_truth, "tolist"):
        return [str(t) for t in list(ground_truth)]
    return [str(ground_truth)]


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 if the normalised answer equals any normalised target, else 0.0."""
    answer = normalize_answer(extract_answer(solution_str))
    return 1.0 if any(answer == normalize_answer(t) for t in targets(ground_truth)) else 0.0
