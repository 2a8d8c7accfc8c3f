"""Defaults for a user's model: the toy's tuned settings apply to the package's own tiny models only.

The built-in defaults (``optim.lr=1e-4`` full fine-tuning, ``data.max_response_length=16``, DPO
``beta=2.0``, validation sampling 4 answers at T = 1, …) are tuned for the embedded task's tiny model.
A real pretrained model given as ``model.path`` (a Hub ID, or a directory whose ``hidden_size`` is at
least :data:`REAL_HIDDEN_SIZE`) gets instead the defaults a peer would give it (veRL's and TRL's), for
every key the user did not set in a preset, a YAML file or an override; one note line lists what was
applied. The embedded models and their checkpoints (hidden size 128) keep the tuned defaults, so the
default run and every run on the embedded task behave as before.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tearless.config.errors import ConfigError
from tearless.models.hub import is_hub_id
from tearless.userfiles import UserFileError, read_user_file

# The embedded tiny models have hidden size 128; the smallest real instruct models have 576
# (SmolLM2-135M) or more (Qwen2.5-0.5B: 896).
REAL_HIDDEN_SIZE = 512

# RL trainer (veRL's defaults, TRL's GRPOConfig where veRL's suit a cluster rather than a laptop).
RL_DEFAULTS: dict[str, Any] = {
    "actor_rollout_ref.actor.optim.lr": 1e-6,  # veRL and TRL
    "data.max_prompt_length": 512,  # veRL and TRL
    "data.max_response_length": 256,  # TRL's max_completion_length
    "data.train_batch_size": 8,  # TRL: 8 prompts' groups per step on one device
    "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
    "actor_rollout_ref.rollout.val_kwargs.do_sample": False,  # veRL: greedy validation only
    "actor_rollout_ref.rollout.val_kwargs.n": 1,  # veRL
    # Validation generates in batches: bounded memory, and a progress line per batch of a long pass.
    "data.val_batch_size": 32,
    # bf16 where this machine measured it faster on this model, else float32 (workers/calibrate.py).
    "actor_rollout_ref.actor.fsdp_config.param_dtype": "auto",
    "actor_rollout_ref.ref.fsdp_config.param_dtype": "auto",
    "actor_rollout_ref.teacher.fsdp_config.param_dtype": "auto",
}
# LoRA trains a few adapter weights: peers use a 10x larger rate (TRL's LoRA examples use 1e-5 to 1e-4).
RL_LORA_LR = 1e-5
OFFLINE_DEFAULTS: dict[str, dict[str, Any]] = {
    "SFTConfig": {
        "optim.lr": 1e-5,  # veRL's SFT default (TRL: 2e-5)
        "data.max_response_length": 256,
    },
    "DPOConfig": {
        "optim.lr": 1e-6,  # TRL's DPOConfig and KTOConfig
        "algorithm.beta": 0.1,  # TRL
        "trainer.total_epochs": 1,
        "data.max_response_length": 256,
    },
    "RMConfig": {
        "optim.lr": 1e-5,  # TRL's reward-modeling example, full training (RewardConfig's 1e-4: LoRA's)
        "trainer.total_epochs": 1,  # TRL's example
    },
}
# LoRA reward models: TRL's RewardConfig default and its example's LoRA rate.
RM_LORA_LR = 1e-4
MODEL_KEY = {
    "Config": "actor_rollout_ref.model.path",
    "SFTConfig": "model.path",
    "DPOConfig": "model.path",
    "RMConfig": "model.path",
}


def is_user_model(path: Any, key: str = "actor_rollout_ref.model.path") -> bool:
    """Whether ``path`` names a real pretrained model rather than one of the package's tiny ones: a Hub
    ID, a directory whose config's hidden size is >= :data:`REAL_HIDDEN_SIZE`, or one without a
    readable config (not the package's). A ``config.json`` that is not a regular file of sane size (a
    FIFO, a link to a device, a directory, a broken link) raises ``ConfigError`` naming ``key``."""
    if path is None:
        return False
    if is_hub_id(str(path)):
        return True
    config = Path(os.path.expanduser(str(path))) / "config.json"
    if not os.path.lexists(config):
        return True
    try:
        raw = json.loads(read_user_file(config, key=key, kind="config"))
    except UserFileError as e:
        # A FIFO here would block start-up and a link to /dev/zero would read until the OOM killer.
        raise ConfigError(str(e)) from None
    except (OSError, ValueError):
        return True
    raw = raw.get("text_config", raw)
    hidden = raw.get("hidden_size") or raw.get("n_embd") or raw.get("d_model") or 0
    return int(hidden) >= REAL_HIDDEN_SIZE


def dotted_value(tree: dict, key: str) -> Any:
    """The value at dotted ``key`` (``"a.b.c"``) of a merged config tree, None where a part is missing."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def explicit_keys(layers: Iterable[dict]) -> set[str]:
    """Every dotted leaf key (and section) that some config layer sets."""
    found: set[str] = set()

    def walk(tree: dict, prefix: str) -> None:
        for k, v in tree.items():
            found.add(prefix + str(k))
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")

    for layer in layers:
        if isinstance(layer, dict):
            walk(layer, "")
    return found


def user_model_defaults(schema_name: str, merged: dict, explicit: set[str]) -> dict[str, Any]:
    """The peer defaults to apply: ``{key: value}`` for keys no layer set, when the model is a user's."""
    model_key = MODEL_KEY.get(schema_name)
    if model_key is None or not is_user_model(dotted_value(merged, model_key), model_key):
        return {}
    table = dict(RL_DEFAULTS) if schema_name == "Config" else dict(OFFLINE_DEFAULTS[schema_name])
    if schema_name == "Config" and (dotted_value(merged, "actor_rollout_ref.model.lora_rank") or 0) > 0:
        table["actor_rollout_ref.actor.optim.lr"] = RL_LORA_LR
    if schema_name == "RMConfig" and (dotted_value(merged, "model.lora_rank") or 0) > 0:
        table["optim.lr"] = RM_LORA_LR
    return {k: v for k, v in table.items() if k not in explicit and dotted_value(merged, k) != v}


def describe_applied(model_key: str, changes: dict[str, tuple[Any, Any]]) -> str:
    """The one note line listing the applied defaults, ``changes`` = {key: (new, old)}."""
    items = ", ".join(f"{k}={new} (was {old})" for k, (new, old) in changes.items())
    return (
        f"{model_key} is a pretrained model, so the defaults tuned for the embedded tiny model give way "
        f"to peer defaults (veRL/TRL): {items}; set a key to keep your own value"
    )
