"""Checks of the actor's LoRA keys: the rank, alpha and target modules, a given adapter (read before
any model loads), and peft being installed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tearless.config.errors import ConfigError, count, fail, positive
from tearless.config.schema import Config
from tearless.models.hub import local_model_path
from tearless.userfiles import UserFileError, read_user_file


def validate_lora(cfg: Config) -> None:
    """Raise ``ConfigError`` for a LoRA key that is out of range or cannot apply with the rank given."""
    m = cfg.actor_rollout_ref.model
    count(
        "actor_rollout_ref.model.lora_rank",
        m.lora_rank,
        "Use 0 for full fine-tuning or a rank such as 8, 16 or 32.",
    )
    if m.lora_adapter_path is not None:
        _validate_adapter(m.lora_adapter_path, m.lora_rank)
    if m.lora_rank == 0:
        if m.lora_save_merged:
            fail(
                "actor_rollout_ref.model.lora_save_merged",
                "there is no adapter to merge with lora_rank=0",
                "Set actor_rollout_ref.model.lora_rank > 0 or drop lora_save_merged.",
            )
        return
    positive("actor_rollout_ref.model.lora_alpha", m.lora_alpha)
    targets = m.target_modules
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets or [])
    if not names or not all(isinstance(t, str) and t for t in names):
        fail(
            "actor_rollout_ref.model.target_modules",
            f"needs all-linear or module names, got {targets!r}",
            "Use all-linear or names such as q_proj,v_proj.",
        )
    if importlib.util.find_spec("peft") is None:
        fail(
            "actor_rollout_ref.model.lora_rank",
            f"lora_rank={m.lora_rank} needs the peft package, which is not installed",
            "pip install 'tearless[lora]' (or peft), or set lora_rank=0.",
        )


def _validate_adapter(path: str, rank: int) -> None:
    """``lora_adapter_path`` holds a peft LoRA adapter whose rank is ``lora_rank`` (read before any model
    loads; a Hub ID is resolved, and downloaded unless offline, here)."""
    key = "actor_rollout_ref.model.lora_adapter_path"
    try:
        local = local_model_path(path, key)
    except UserFileError as err:
        raise ConfigError(str(err)) from None
    except FileNotFoundError as err:
        fail(key, str(err).removeprefix(f"{key}={path}: "), "Fix the path or the Hub ID.")
    try:
        adapter = json.loads(read_user_file(Path(local) / "adapter_config.json", key=key, kind="config"))
    except UserFileError as err:
        raise ConfigError(str(err)) from None
    except (OSError, ValueError):
        fail(
            key,
            f"{path!r} has no readable adapter_config.json",
            "Point it at a directory peft's save_pretrained wrote.",
        )
    if adapter.get("peft_type", "LORA") != "LORA" or adapter.get("r") != rank:
        fail(
            key,
            f"the adapter is {adapter.get('peft_type')} with rank r={adapter.get('r')}, not LoRA with "
            f"actor_rollout_ref.model.lora_rank={rank}",
            f"Set actor_rollout_ref.model.lora_rank={adapter.get('r')}.",
        )
