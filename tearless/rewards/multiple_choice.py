"""Multiple choice: the chosen option letter must equal the answer's.

The choice is read from, in this order: the last ``\\boxed{…}``, the last ``<answer>…</answer>``,
the last "answer is (X)" / "Answer: X" phrase, or a response that is only a letter ("B", "(B)",
"B."). Inside a box or an answer tag the content must be just one option ("B", "(b)", "B) 42",
"Option B", ``\\text{(B)}``); in running text only a capital letter counts, so the article in "A
good guess is…" is never read as option A. Options are A to J (MMLU-Pro has ten).

The ground truth is a letter (``"C"``, ``"(C)"``) or a 0-based option index (``2``).
"""

from __future__ import annotations

import re
from typing import Any

from tearless.rewards.format import extract_answer
from tearless.rewards.math_answer import last_boxed

LETTERS = "ABCDEFGHIJ"
# One option, then the end or a closing bracket, period or colon: "B", "(B) 42", "B. 42"; not "A or B".
_OPTION = re.compile(
    r"\s*(?:\\text\{)?\s*(?:option|choice)?\s*[\(\[]?([A-J])(?:[\)\].:}]|\s*$)", re.IGNORECASE
)
_PHRASE = re.compile(r"answer\s*(?:is)?\s*:?\s*(?:option|choice)?[*\s]*[\(\[]?([A-J])\b", re.IGNORECASE)
_BARE = re.compile(r"\s*[\(\[]?([A-J])[\)\]]?\.?\s*")


def option_letter(content: str) -> str | None:
    """The option named by ``content`` when it names just one ("B", "(b)", "B) 42"), else ``None``."""
    match = _OPTION.match(content)
    return match.group(1).upper() if match else None


def extract_choice(solution_str: str) -> str | None:
    """The option letter the response chose, or ``None`` (see the module docs for the order)."""
    for content in (last_boxed(solution_str), extract_answer(solution_str)):
        if content is not None:
            return option_letter(content)
    phrases = [m for m in _PHRASE.finditer(solution_str) if m.group(1).isupper()]
    if phrases:
        return phrases[-1].group(1)
    bare = _BARE.fullmatch(solution_str)
    return bare.group(1) if bare else None


def answer_letter(ground_truth: Any) -> str:
    """The correct letter from a letter or a 0-based index; ``ValueError`` otherwise."""
    if isinstance(ground_truth, int) and not isinstance(ground_truth, bool):
        if 0 <= ground_truth < len(LETTERS):
            return LETTERS[ground_truth]
    elif isinstance(ground_truth, str) and (letter := option_letter(ground_truth)) is not None:
        return letter
    raise ValueError(f"a multiple-choice ground truth is a letter A-J or an index 0-9, got {ground_truth!r}")


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 if the chosen option is the correct one, else 0.0."""
    return 1.0 if extract_choice(solution_str) == answer_letter(ground_truth) else 0.0
