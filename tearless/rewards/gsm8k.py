"""GSM8K: the number after ``####`` must equal the gold answer.

``strict`` (the default, as in veRL) reads the answer only from the ``#### <number>`` format the
prompt asks for, so a model that skips the format gets 0 and learns it; ``flexible`` takes the last
number anywhere in the response. ``$`` and thousands separators are ignored, and numbers compare by
value, so ``#### $1,000.00`` matches ``1000``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

METHODS = ("strict", "flexible")

_NUMBER = r"-?\$?-?\d[\d,]*(?:\.\d+)?"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY = re.compile(_NUMBER)


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The last answer in ``solution_str`` with ``$`` and ``,`` removed, or ``None`` if there is none."""
    if method not in METHODS:
        raise ValueError(f"gsm8k method {method!r} is not one of {', '.join(METHODS)}")
    pattern = _STRICT if method == "strict" else _ANY
    matches = pattern.findall(solution_str)
    if not matches:
        return None
    return _clean(matches[-1])


def compute_score(
    solution_str: str, ground_truth: Any, extra_info: dict | None = None, method: str = "strict"
) -> float:
    """1.0 if the extracted answer equals ``ground_truth`` by value, else 0.0.

    ``extra_info["method"]`` (per row) takes precedence over ``method`` (from ``reward_kwargs``).
    """
    if isinstance(extra_info, dict) and extra_info.get("method"):
        method = extra_info["method"]
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return 1.0 if _same_number(answer, _clean(str(ground_truth))) else 0.0


def _clean(text: str) -> str:
    return text.replace("$", "").replace(",", "").strip()


def _same_number(a: str, b: str) -> bool:
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b
