"""What makes two RL runs the same run: the keys that define it, and the default experiment name.

A run is defined by its model, its data and its algorithm (:data:`IDENTITY_KEYS`; for the embedded
task, the task's generator settings too). The default ``trainer.experiment_name`` is derived from
them, so that two different runs get two run directories by default (the quick start and a
bring-your-own-model run no longer share ``runs/tearless/default``):

- the embedded task (no model or data path given): ``<task.name>-<adv_estimator>``, e.g.
  ``arithmetic-grpo``;
- otherwise ``<model>-<data>-<adv_estimator>-<hash>``: the model directory's name, the first
  training file's stem, and six hex digits of a hash of every identity value (absolute paths), so
  two models that share a directory name still differ, e.g. ``Qwen2.5-0.5B-train-grpo-3f9a1c``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

# Keys whose difference makes another run: never resumed across (trainers/resume_compat.py).
IDENTITY_KEYS = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.tokenizer_path",
    "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.model.target_modules",
    "critic.model.path",
    "critic.enable",
    "data.train_files",
    "algorithm.adv_estimator",
)
# The embedded task's keys that decide its data and model, compared when no paths are given.
TASK_KEYS = ("task.name", "task.num_train", "task.num_val", "task.warmup_steps", "task.forget_carry")
PATH_KEYS = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.tokenizer_path",
    "critic.model.path",
    "data.train_files",
)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (lists and empty dicts stay values)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def normalise(key: str, value: Any) -> Any:
    """A path key's value as absolute, resolved paths (a list stays a list), so ``./m`` and ``m``
    name the same model; other values as JSON would carry them."""
    if key in PATH_KEYS and value is not None:
        paths = value if isinstance(value, (list, tuple)) else [value]
        resolved = [os.path.realpath(os.path.expanduser(str(p))) for p in paths]
        return resolved if isinstance(value, (list, tuple)) else resolved[0]
    return json.loads(json.dumps(value, default=str))


def uses_embedded_task(flat: dict[str, Any]) -> bool:
    return flat.get("actor_rollout_ref.model.path") is None or flat.get("data.train_files") is None


def identity(flat: dict[str, Any]) -> dict[str, Any]:
    """The identity values of a flattened config (task keys only when the embedded task is used)."""
    keys = IDENTITY_KEYS + (TASK_KEYS if uses_embedded_task(flat) else ())
    return {key: normalise(key, flat.get(key)) for key in keys}


def default_experiment_name(config: dict[str, Any]) -> str:
    """The experiment name derived from a config (as a nested dict); see the module docs."""
    flat = flatten(config)
    estimator = str(flat.get("algorithm.adv_estimator"))
    model, train = flat.get("actor_rollout_ref.model.path"), flat.get("data.train_files")
    if model is None and train is None:
        return _safe(f"{flat.get('task.name')}-{estimator}")
    model_part = (
        os.path.basename(os.path.normpath(str(model))) if model is not None else flat.get("task.name")
    )
    first = train[0] if isinstance(train, (list, tuple)) and train else train
    data_part = (
        os.path.splitext(os.path.basename(str(first)))[0] if first is not None else flat.get("task.name")
    )
    digest = hashlib.sha256(json.dumps(identity(flat), sort_keys=True).encode()).hexdigest()[:6]
    return _safe(f"{model_part}-{data_part}-{estimator}")[:72] + f"-{digest}"


def _safe(name: str) -> str:
    return _UNSAFE.sub("_", name).strip("._-") or "run"
