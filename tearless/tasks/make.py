"""Write the embedded tasks as train/test parquet files (``tearless data make``).

Tasks: ``arithmetic`` (the default run's addition), ``countdown`` (TinyZero),
``knights_knaves`` (Logic-RL, ``num_people`` inhabitants, unique solutions) and ``word_problems``
(one-step add/subtract stories, the real-model recipe's task), and any reasoning-gym task as
``reasoning_gym:<task>`` (:mod:`tearless.data.reasoning_gym`, its dataset config as ``config``).
The test split is drawn first from ``seed`` and the training split from ``seed + 1`` with every
test problem excluded, so the two never share a problem and the same seed always gives the same files.
"""

from __future__ import annotations

import os
from pathlib import Path

from tearless.data.reasoning_gym import reasoning_gym_rows
from tearless.data.rows import DataError, write_parquet
from tearless.tasks import arithmetic, countdown, knights_knaves, word_problems

TASKS = ("arithmetic", "countdown", "knights_knaves", "word_problems")
# The real model the commands name: small enough to train on a laptop CPU (docs/real-model.md).
REAL_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def make_rows(
    task: str,
    *,
    num_train: int,
    num_test: int,
    seed: int,
    num_people: int | None = None,
    config: dict | None = None,
) -> dict[str, list[dict]]:
    """``{"train": rows, "test": rows}`` for ``task`` (``num_people`` only for knights_knaves,
    ``config`` only for ``reasoning_gym:<task>``)."""
    if config and not task.startswith("reasoning_gym:"):
        raise DataError(f"--config applies to reasoning_gym:<task>, not {task}")
    if task.startswith("reasoning_gym:"):
        if num_train < 1 or num_test < 1:
            raise DataError(f"need at least one train and one test row, got {num_train} and {num_test}")
        name = task.partition(":")[2]
        return reasoning_gym_rows(name, num_train=num_train, num_test=num_test, seed=seed, config=config)
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}; known: {', '.join(TASKS)}, reasoning_gym:<task>")
    if num_people is not None and task != "knights_knaves":
        raise DataError(f"--num-people applies to knights_knaves, not {task}")
    if num_train < 1 or num_test < 1:
        raise DataError(f"need at least one train and one test row, got {num_train} and {num_test}")
    if task == "arithmetic":
        test = arithmetic.generate_rows(num_test, seed=seed, split="test")
        held_out = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in test}
        train = arithmetic.generate_rows(num_train, seed=seed + 1, split="train", exclude=held_out)
        return {"train": train, "test": test}
    module = {"countdown": countdown, "word_problems": word_problems, "knights_knaves": knights_knaves}[task]
    extra = {"num_people": num_people or 3} if task == "knights_knaves" else {}
    seen: set = set()
    try:
        test = module.generate_rows(num_test, seed=seed, split="test", exclude=seen, **extra)
        train = module.generate_rows(num_train, seed=seed + 1, split="train", exclude=seen, **extra)
    except ValueError as exc:
        raise DataError(str(exc)) from exc
    return {"train": train, "test": test}


def make_task(
    task: str,
    output: str | os.PathLike,
    *,
    num_train: int = 1000,
    num_test: int = 100,
    seed: int = 0,
    num_people: int | None = None,
    config: dict | None = None,
) -> dict[str, str]:
    """Write ``<output>/train.parquet`` and ``<output>/test.parquet``; return their paths by split."""
    splits = make_rows(
        task, num_train=num_train, num_test=num_test, seed=seed, num_people=num_people, config=config
    )
    paths = {}
    for split, rows in splits.items():
        path = Path(output) / f"{split}.parquet"
        write_parquet(rows, path)
        paths[split] = str(path)
    return paths


def train_command(task: str, paths: dict[str, str]) -> str:
    """The ``tearless train`` command for the files :func:`make_task` wrote.

    Arithmetic fits the defaults and the embedded model. The other tasks need a real instruct model
    (countdown and knights_knaves prompts are hundreds of tokens, past the embedded model's 128
    positions): their presets set the lengths, and the command names SmolLM2-135M-Instruct by its Hub
    ID (the word_problems preset names it itself), which runs on a laptop CPU; any instruct model's
    directory or Hub ID works in its place.
    """
    files = f"data.train_files={paths['train']} data.val_files={paths['test']}"
    if task.startswith("reasoning_gym:"):
        return f"tearless train {files} actor_rollout_ref.model.path={REAL_MODEL}"
    if task == "arithmetic":
        return f"tearless train {files}"
    if task == "word_problems":
        return f"tearless train --preset {task} {files}"
    return f"tearless train --preset {task} {files} actor_rollout_ref.model.path={REAL_MODEL}"
