"""Calls into transformers whose names moved between releases, spelled once.

transformers 5.24 renamed the forward's KV-cache argument ``past_key_values`` to ``cache`` (the old
name warns and goes in 5.40) and ``is_gradient_checkpointing`` to ``is_activation_checkpointing``.
tearless reads the model class's own signature instead of a version number, so it passes the name
that the installed release (and a custom model class) declares, on either side of the rename.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


@functools.cache
def _cache_argument(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model under a peft wrapper (whose forward takes ``**kwargs`` only)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def cache_kwargs(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """Forward keyword arguments that read and extend ``cache``, under the name ``model`` declares."""
    return {_cache_argument(type(base_model(model))): cache, "use_cache": True}


def activation_checkpointing(model: torch.nn.Module) -> bool:
    """Whether ``model`` recomputes activations in backward (either name of the switch)."""
    model = base_model(model)
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))
