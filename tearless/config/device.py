"""The RL config keys whose default depends on the device (:mod:`tearless.devices`), filled at load.

A key the user set (in a preset, a YAML file, a dict or an override) is never touched. On a CPU the
table's values are the schema's own defaults, so nothing changes and nothing is printed; on CUDA one
note line lists what was applied.
"""

from __future__ import annotations

from typing import Any

from tearless.config.user_model import dotted_value
from tearless.devices import device_defaults

ARR = "actor_rollout_ref"
DYNAMIC = f"{ARR}.actor.use_dynamic_bsz"
BUDGET = f"{ARR}.actor.ppo_max_token_len_per_gpu"
MICRO = f"{ARR}.actor.ppo_micro_batch_size_per_gpu"


def device_config_defaults(device_type: str, merged: dict, explicit: set[str]) -> dict[str, Any]:
    """``{key: value}`` of the device's defaults (:func:`tearless.devices.device_defaults`) for the
    keys no layer set and whose value differs: ``model.use_remove_padding``,
    ``actor.calculate_entropy`` and ``actor.use_dynamic_bsz``. Dynamic batching is left alone when
    the user sized micro-batches by count (``ppo_micro_batch_size_per_gpu``); when it is turned on and
    ``ppo_max_token_len_per_gpu`` was not set, the budget is raised to one whole sequence
    (``data.max_prompt_length + data.max_response_length``) if it is smaller."""
    d = device_defaults(device_type)
    table: dict[str, Any] = {
        f"{ARR}.model.use_remove_padding": d.remove_padding,
        f"{ARR}.actor.calculate_entropy": d.calculate_entropy,
    }
    if MICRO not in explicit:
        table[DYNAMIC] = d.dynamic_bsz
    out = {k: v for k, v in table.items() if k not in explicit and dotted_value(merged, k) != v}
    if out.get(DYNAMIC) and BUDGET not in explicit:
        data = merged.get("data", {})
        needed = int(data.get("max_prompt_length", 0)) + int(data.get("max_response_length", 0))
        if int(dotted_value(merged, BUDGET)) < needed:
            out[BUDGET] = needed
    return out


def describe_device_defaults(device_type: str, changes: dict[str, tuple[Any, Any]]) -> str:
    """The one note line listing the applied defaults, ``changes`` = {key: (new, old)}."""
    items = ", ".join(f"{k}={new} (was {old})" for k, (new, old) in changes.items())
    return f"training on {device_type}: its defaults apply: {items}; set a key to keep your own value"


def run_device(name: str) -> str:
    """``trainer.device`` as this process sees it: ``auto`` is ``cuda`` where a GPU is visible.

    Limitation: the device defaults are taken here, on the driver that loads the config, not on the
    Ray workers: under ``auto`` a CPU head node whose workers have GPUs gets the CPU defaults (set
    the keys of :data:`tearless.devices.DEVICE_DEFAULTS` yourself there; docs/speed.md)."""
    if name != "auto":
        return name
    import torch  # heavy: only a config that asks for auto needs it, and only here

    return "cuda" if torch.cuda.is_available() else "cpu"
