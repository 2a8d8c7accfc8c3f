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

Paths alone do not make a run: a model's weights or a data file rewritten in place keep their path.
:func:`fingerprints` records, for every file of the :data:`PATH_KEYS` (a directory's files, not its
subdirectories), its size, modification time and a SHA-256 of its content (of all of it up to
:data:`FULL_HASH_BYTES`, else of :data:`_SAMPLES` evenly spaced 1 MiB blocks with the first and the
last: a safetensors file's header and its first and last tensors among them), so hashing a 15 GB
model costs milliseconds. A checkpoint keeps them; :func:`fingerprint_changes` says what changed on
resume. A file whose modification time moved but whose size and hash did not (a copy, a ``touch``) is
the same file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

# Keys whose difference makes another run: never resumed across (config/resume_compat.py).
IDENTITY_KEYS = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.tokenizer_path",
    "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.model.target_modules",
    "critic.model.path",
    "critic.enable",
    "actor_rollout_ref.teacher.model.path",
    "data.train_files",
    "algorithm.adv_estimator",
)
# The embedded task's keys that decide its data and model, compared when no paths are given.
TASK_KEYS = ("task.name", "task.num_train", "task.num_val", "task.warmup_steps", "task.forget_carry")
PATH_KEYS = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.tokenizer_path",
    "critic.model.path",
    "actor_rollout_ref.teacher.model.path",
    "data.train_files",
)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
FULL_HASH_BYTES = 64 << 20
_BLOCK = 1 << 20
_SAMPLES = 16


def file_fingerprint(path: str) -> dict[str, Any]:
    """``{"size", "mtime_ns", "sha256"}`` of one file (see the module docs for what is hashed)."""
    st = os.stat(path)
    digest = hashlib.sha256(str(st.st_size).encode())
    with open(path, "rb") as f:
        if st.st_size <= FULL_HASH_BYTES:
            while chunk := f.read(_BLOCK):
                digest.update(chunk)
        else:
            last = st.st_size - _BLOCK
            for i in range(_SAMPLES):
                f.seek(last * i // (_SAMPLES - 1))
                digest.update(f.read(_BLOCK))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest.hexdigest()}


def fingerprints(paths: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{key: {file: file_fingerprint(file)}}`` for each key's path or paths (a directory: the
    regular files directly in it, hidden ones aside). A path that is not on this machine (a hub id)
    has none."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for key, value in paths.items():
        if value is None:
            continue
        files: dict[str, dict[str, Any]] = {}
        for path in value if isinstance(value, (list, tuple)) else [value]:
            path = os.path.realpath(os.path.expanduser(str(path)))
            if os.path.isdir(path):
                names = sorted(n for n in os.listdir(path) if not n.startswith("."))
                inside = [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]
            else:
                inside = [path] if os.path.isfile(path) else []
            for file in inside:
                files[file] = file_fingerprint(file)
        out[key] = files
    return out


def fingerprint_changes(saved: Any, current: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """What differs between a checkpoint's :func:`fingerprints` and the current ones: a file whose size
    or content hash changed, that is gone, or that is new, per key both sides have. ``saved`` from a
    checkpoint without fingerprints (an older tearless), or not of their form, compares as nothing."""
    if not isinstance(saved, dict):
        return []
    changes = []
    for key in sorted(set(saved) & set(current)):
        old, new = saved[key], current[key]
        if not isinstance(old, dict):
            continue
        for file in sorted(set(old) | set(new)):
            before, now = old.get(file), new.get(file)
            if not isinstance(before, dict):
                changes.append(f"{key}: {file} is new")
            elif now is None:
                changes.append(f"{key}: {file} is gone")
            elif before.get("size") != now["size"]:
                changes.append(f"{key}: {file} changed ({before.get('size')} bytes then, {now['size']} now)")
            elif before.get("sha256") != now["sha256"]:
                changes.append(f"{key}: {file} changed (same size, different content)")
    return changes


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
