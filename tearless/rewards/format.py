"""R1-style output format: reasoning in ``<think>…</think>``, then the answer in ``<answer>…</answer>``.

Two checks:

- ``strict=False`` (Logic-RL's rule): each of ``<think>``, ``</think>``, ``<answer>``, ``</answer>``
  occurs exactly once, in that order; text may surround them.
- ``strict=True`` (DeepSeek-R1 / open-r1 style): additionally nothing but whitespace before
  ``<think>``, between ``</think>`` and ``<answer>``, and after ``</answer>``.

A response whose prompt pre-filled ``<think>`` lacks the opening tag: prepend it before checking.
"""

from __future__ import annotations

import re

TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_STRICT = re.compile(r"\s*<think>.*</think>\s*<answer>.*</answer>\s*", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def check_r1_format(text: str, *, strict: bool = True) -> bool:
    """Whether ``text`` has the think-then-answer format (see the module docs for ``strict``)."""
    positions = []
    for tag in TAGS:
        if text.count(tag) != 1:
            return False
        positions.append(text.index(tag))
    if positions != sorted(positions):
        return False
    return not strict or _STRICT.fullmatch(text) is not None


def r1_format_reward(text: str, *, strict: bool = True, reward: float = 1.0, penalty: float = 0.0) -> float:
    """``reward`` when :func:`check_r1_format` passes, else ``penalty``."""
    return reward if check_r1_format(text, strict=strict) else penalty


def extract_answer(text: str) -> str | None:
    """The content of the last ``<answer>…</answer>``, stripped, or ``None`` if there is none."""
    matches = _ANSWER.findall(text)
    return matches[-1].strip() if matches else None
