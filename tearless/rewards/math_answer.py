"""Competition math (MATH, MATH-500): the last ``\\boxed{…}`` of the response must equal the answer.

As in veRL's MATH scorer, only the last ``\\boxed{…}`` (or ``\\fbox{…}``, or ``\\boxed 5``) counts,
so a response without one scores 0 and the model learns the format. Equivalence is decided by
math-verify (Hugging Face, Apache-2.0: LaTeX parsed into SymPy): ``0.5`` matches ``\\frac{1}{2}``
and ``\\dfrac12``, ``5\\text{ cm}`` matches ``5``, ``90^\\circ`` matches ``90``, ``1,000`` matches
``1000``, ``\\{2,1\\}`` matches ``\\{1,2\\}`` and ``(x+1)^2`` matches ``x^2+2x+1``; ``1/3`` does not
match ``0.333``. A cheap string normalisation (spaces, ``\\left``/``\\right``,
``\\dfrac``, a final period) answers the common case before SymPy is consulted.

The ground truth is the bare answer (``"\\frac{1}{2}"``); a ground truth that itself contains
``\\boxed{…}`` is reduced to its content.
"""

from __future__ import annotations

import re
import threading
from typing import Any

# Seconds math-verify may spend parsing or comparing one answer (it uses SIGALRM, so only the main
# thread can have a limit; the reward manager's per-sample timeout covers the rest).
VERIFY_TIMEOUT_S = 5
_BOX = re.compile(r"\\(?:boxed|fbox)\b")
_NOISE = re.compile(r"\\left\b|\\right\b|\\!|\\,|\\;|\\:|\\ |\s+")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` / ``\\fbox{…}`` (braces balanced), or ``None``.

    ``\\boxed 5`` (no braces) gives ``"5"``: the rest of the line up to a ``$`` or whitespace.
    """
    for match in reversed(list(_BOX.finditer(text))):
        rest = text[match.end() :]
        stripped = rest.lstrip()
        if stripped.startswith("{"):
            start = len(rest) - len(stripped)
            depth = 0
            for i, ch in enumerate(rest[start:], start):
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                    if depth == 0:
                        return rest[start + 1 : i]
            continue  # unbalanced (a truncated response): try an earlier box
        if rest[:1] == " ":
            token = re.match(r"\s*([^\s$]+)", rest)
            if token:
                return token.group(1)
    return None


def normalize(answer: str) -> str:
    """The cheap normal form used before SymPy: no spaces or ``\\left``/``\\right``/thin spaces,
    ``\\dfrac``/``\\tfrac`` as ``\\frac``, no surrounding ``$`` or final period."""
    answer = _NOISE.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return answer.strip("$").rstrip(".")


def is_equivalent(prediction: str, truth: str) -> bool:
    """Whether two LaTeX answers are mathematically the same (see the module docs)."""
    prediction, truth = normalize(prediction), normalize(truth)
    if not prediction:
        return False
    if prediction == truth:
        return True
    from math_verify import parse, verify

    timeout = VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{truth}}}", parsing_timeout=timeout)
    guess = parse(f"\\boxed{{{prediction}}}", parsing_timeout=timeout)
    if not gold or not guess:
        return False
    return bool(verify(gold, guess, timeout_seconds=timeout))


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 if the last boxed answer is equivalent to ``ground_truth``, else 0.0."""
    prediction = last_boxed(solution_str)
    if prediction is None:
        return 0.0
    truth = str(ground_truth)
    boxed_truth = last_boxed(truth)
    return 1.0 if is_equivalent(prediction, truth if boxed_truth is None else boxed_truth) else 0.0
