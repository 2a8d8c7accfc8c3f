"""reasoning-gym's procedural tasks as veRL-schema rows (``tearless data make reasoning_gym:<task>``).

Each row's prompt is the task's question as one user message, its ground truth the task's answer,
and ``extra_info`` keeps the task name and the whole entry (JSON, metadata included), which the
scorer (:mod:`tearless.rewards.reasoning_gym`, ``data_source`` ``reasoning_gym/<task>``) hands back
to reasoning-gym's own ``score_answer``. ``config`` is the task's dataset config (e.g. for
``basic_arithmetic``: ``{"operators": ["+"], "max_terms": 2}``). The test split is drawn from
``seed``, the training split from ``seed + 1`` with every test question excluded.

reasoning-gym (Apache-2.0) is an optional dependency: ``pip install 'tearless[agents]'``.
"""

from __future__ import annotations

import json
from typing import Any

from tearless.data.rows import DataError


def _dataset(task: str, size: int, seed: int, config: dict[str, Any]) -> Any:
    try:
        import reasoning_gym  # optional dependency, imported only for these tasks
    except ImportError:
        raise DataError(
            f"reasoning_gym:{task} needs the reasoning-gym package: pip install 'tearless[agents]'"
        ) from None
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    except (KeyError, ValueError, TypeError, AssertionError) as e:
        raise DataError(f"reasoning_gym:{task} with config {config}: {e}") from None


def reasoning_gym_rows(
    task: str, *, num_train: int, num_test: int, seed: int, config: dict[str, Any] | None = None
) -> dict[str, list[dict]]:
    """``{"train": rows, "test": rows}`` of reasoning-gym task ``task`` (see the module docstring)."""
    config = dict(config or {})
    test = [_row(task, e, "test", i) for i, e in enumerate(_dataset(task, num_test, seed, config))]
    held_out = {r["prompt"][0]["content"] for r in test}
    # Draw extra training entries so that dropping the held-out questions leaves num_train.
    pool = _dataset(task, 2 * (num_train + num_test), seed + 1, config)
    train = [e for e in pool if e["question"] not in held_out][:num_train]
    if len(train) < num_train:
        raise DataError(
            f"reasoning_gym:{task}: only {len(train)} training questions differ from the test split; "
            "ask for fewer (--num-train) or widen the task's config"
        )
    return {"train": [_row(task, e, "train", i) for i, e in enumerate(train)], "test": test}


def _row(task: str, entry: dict, split: str, index: int) -> dict:
    return {
        "data_source": f"reasoning_gym/{task}",
        "prompt": [{"role": "user", "content": entry["question"]}],
        "ability": "reasoning",
        "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
        "extra_info": {
            "split": split,
            "index": index,
            "reasoning_gym_task": task,
            "reasoning_gym_entry": json.dumps(entry, default=str),
        },
    }
