"""Rule-based scorers chosen by ``data_source``, and the built-in dispatcher ``compute_score``.

A scorer is ``fn(solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict`` (the
``data_source`` has already been used to pick it). The dispatcher has veRL's reward-function
signature, ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, so it and a
user's custom function are interchangeable.

A source name ending in ``*`` matches every ``data_source`` that starts with the rest of it
(``searchR1_*`` covers ``searchR1_nq``, ``searchR1_hotpotqa``, …); an exact name wins over a
pattern, and a longer pattern over a shorter one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

ScoreFn = Callable[..., Any]

# Built-in scorers are named "module:function" and imported on first use, so importing this module
# costs nothing and a scorer with heavy dependencies is loaded only when a dataset needs it. To add
# one, write its module and add its sources here.
_MATH = "tearless.rewards.math_answer:compute_score"
_CODE = "tearless.rewards.code_reward:compute_score"
_KK = "tearless.tasks.knights_knaves:compute_score"
_BUILTIN: dict[str, str] = {
    "arithmetic": "tearless.tasks.arithmetic:compute_score",
    "word_problems": "tearless.tasks.word_problems:compute_score",
    "gsm8k": "tearless.rewards.gsm8k:compute_score",
    "openai/gsm8k": "tearless.rewards.gsm8k:compute_score",
    "math": _MATH,
    "lighteval/MATH": _MATH,
    "DigitalLearningGmbH/MATH-lighteval": _MATH,
    "HuggingFaceH4/MATH-500": _MATH,
    "multiple_choice": "tearless.rewards.multiple_choice:compute_score",
    "exact_match": "tearless.rewards.qa_em:compute_score",
    "searchR1_*": "tearless.rewards.qa_em:compute_score",
    "countdown": "tearless.tasks.countdown:compute_score",
    "long_addition": "tearless.tasks.long_addition:compute_score",
    "chain_addition": "tearless.tasks.chain_addition:compute_score",
    "vlm_count": "tearless.tasks.vlm_count:compute_score",
    "hiyouga/geometry3k": "tearless.rewards.geo3k:compute_score",  # veRL's multimodal example
    "knights_knaves": _KK,
    "kk_logic": _KK,  # Logic-RL's name
    "code": _CODE,
    # veRL's names for code datasets
    "codecontests": _CODE,
    "apps": _CODE,
    "codeforces": _CODE,
    "taco": _CODE,
    "reasoning_gym/*": "tearless.rewards.reasoning_gym:compute_score",
}
_registered: dict[str, ScoreFn] = {}
_version = 0


def register_scorer(*names: str, override: bool = False) -> Callable[[ScoreFn], ScoreFn]:
    """Decorator that makes the built-in dispatcher score ``names`` with the decorated function.

    >>> @register_scorer("my_task", "my_task_v2_*")
    ... def score_my_task(solution_str, ground_truth, extra_info=None):
    ...     return float(solution_str.strip() == ground_truth)

    A name that already has a scorer is refused unless ``override=True``.
    """
    if not names or not all(isinstance(n, str) and n.strip("*") for n in names):
        raise ValueError(f"register_scorer needs one or more non-empty data_source names, got {names!r}")

    def decorate(fn: ScoreFn) -> ScoreFn:
        global _version
        if not callable(fn):
            raise TypeError(f"register_scorer{names!r} decorates a function, got {type(fn).__name__}")
        taken = [n for n in names if n in _registered or n in _BUILTIN]
        if taken and not override:
            raise ValueError(
                f"data_source {taken[0]!r} already has a scorer; pass override=True to replace it"
            )
        for name in names:
            _registered[name] = fn
        _version += 1
        return fn

    return decorate


def known_sources() -> list[str]:
    """Every data_source name (and ``prefix*`` pattern) the dispatcher can score, sorted."""
    return sorted({*_BUILTIN, *_registered})


def registry_version() -> int:
    """A number that changes whenever a scorer is registered (worker pools fork again after it)."""
    return _version


class UnknownDataSource(ValueError):
    """A ``data_source`` no built-in scorer handles; the message lists the known ones and the fix."""


def get_scorer(data_source: str) -> ScoreFn:
    """The scorer for ``data_source``; an :class:`UnknownDataSource` listing the known sources if there
    is none."""
    name = _match(data_source) if isinstance(data_source, str) else None
    if name is None:
        raise UnknownDataSource(
            f"no built-in reward function for data_source {data_source!r}; known: "
            f"{', '.join(known_sources())}. For another source, write a file with `def compute_score("
            "data_source, solution_str, ground_truth, extra_info=None)` and pass "
            "custom_reward_function.path=<file> (and custom_reward_function.name=<fn> if the function has "
            "another name), or decorate a scorer with @tearless.rewards.register_scorer"
        )
    if name in _registered:
        return _registered[name]
    module, _, attr = _BUILTIN[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def check_data_sources(data: dict[str, tuple[Any, list[dict]]]) -> None:
    """Raise :class:`UnknownDataSource` naming the key, the files and the first row whose
    ``data_source`` no built-in scorer handles: when the data loads, not at the first scoring.

    ``data`` maps a config key to ``(the files it names, their rows)``.
    """
    for key, (files, rows) in data.items():
        seen: set[str] = set()
        for i, row in enumerate(rows):
            source = row["data_source"]
            if source in seen:
                continue
            seen.add(source)
            try:
                get_scorer(source)
            except UnknownDataSource as e:
                raise UnknownDataSource(f"{key}={files}: row {i}: {e}") from None


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> float | dict:
    """The built-in reward function: score ``solution_str`` with the scorer of ``data_source``.

    Extra keyword arguments (``reward_kwargs``) are passed on to the scorer.
    """
    return get_scorer(data_source)(solution_str, ground_truth, extra_info, **kwargs)


def _match(data_source: str) -> str | None:
    names = {*_BUILTIN, *_registered}
    if data_source in names:
        return data_source
    patterns = [n for n in names if n.endswith("*") and data_source.startswith(n[:-1])]
    return max(patterns, key=len, default=None)
