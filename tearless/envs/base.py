"""What an environment is, and finding one by name, by module path or in a user's file.

An environment owns its state and its reward. One instance plays one episode:

- ``reset(row) -> messages``: the first observation, chat messages (``[{"role": "user", "content":
  …}]``) rendered with the model's chat template as the prompt. ``row`` is the data row
  (``prompt``, ``data_source``, ``ground_truth``, ``extra_info``).
- ``step(turn) -> Step``: ``turn`` is the model's turn as an OpenAI assistant message
  (``{"role": "assistant", "content": text, "tool_calls": [...]}``, ``tool_calls`` parsed from the
  text when the environment has ``tools``); the :class:`Step` holds the next observation (messages,
  usually ``user`` or ``tool``; a string is one ``user`` message), the reward of this step, whether
  the episode is done, and info.

Optional: ``tools`` (a list of OpenAI function schemas, rendered by the chat template's ``tools=``)
and ``close()``. ``reset``, ``step`` and ``close`` may be plain or ``async``. The episode's reward is
the sum of its step rewards, :math:`R = \\sum_t r_t`; ``info["success"]`` (if given at the last step)
is what validation counts as solved, else :math:`R \\ge 1`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tearless.userfiles import check_user_file

Messages = list[dict[str, Any]]


@dataclass
class Step:
    """What an environment answers to a model turn."""

    observation: Messages | str = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """The structural type the environment loop accepts (see the module docstring)."""

    def reset(self, row: dict[str, Any]) -> Messages | Awaitable[Messages]: ...

    def step(self, turn: dict[str, Any]) -> Step | Awaitable[Step]: ...


def as_messages(observation: Messages | str | None, where: str) -> Messages:
    """An observation as a list of chat messages (a string is one ``user`` message)."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if not isinstance(observation, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in observation
    ):
        raise TypeError(f"{where} must return chat messages [{{'role': ..., 'content': ...}}] or a string")
    return observation


_REGISTRY: dict[str, Callable[..., Environment]] = {}


def register_env(name: str) -> Callable[[type], type]:
    """Class decorator: make ``multi_turn.env=<name>`` build this class."""

    def decorate(cls: type) -> type:
        _REGISTRY[name] = cls
        return cls

    return decorate


def registered_envs() -> list[str]:
    return sorted(_REGISTRY)


def env_factory(spec: str, kwargs: dict[str, Any] | None = None) -> Callable[[], Environment]:
    """A function that builds one fresh environment per call, from ``spec``: a registered name, a
    ``pkg.module:Class`` / ``pkg.module.Class`` path or a ``file.py:Class`` (any callable works in
    place of a class). A class with a ``check_kwargs(kwargs)`` classmethod has it called now (it raises
    ValueError). Raises ValueError with one line naming the problem."""
    where = "actor_rollout_ref.rollout.multi_turn.env"
    kwargs = dict(kwargs or {})
    target: Any = _REGISTRY.get(spec)
    if target is None:
        target = load_object(spec, where)
    if not callable(target):
        raise ValueError(f"{where}={spec!r} is not a class or function that builds an environment")
    check = getattr(target, "check_kwargs", None)
    if callable(check):  # an adapter's own argument checks, so a wrong env_kwargs fails at config time
        check(kwargs)

    def make() -> Environment:
        return target(**kwargs)

    return make


def load_object(spec: str, where: str) -> Any:
    """The object ``spec`` names: ``pkg.module:name``, ``pkg.module.name`` or ``file.py:name``."""
    if ":" in spec:
        module_part, _, attr = spec.rpartition(":")
    elif "." in spec:
        module_part, _, attr = spec.rpartition(".")
    else:
        known = ", ".join(registered_envs()) or "none registered"
        raise ValueError(
            f"{where}={spec!r}: unknown name; use a registered one ({known}), 'pkg.module:name' or "
            "'file.py:name'"
        )
    if module_part.endswith(".py"):
        path = Path(module_part)
        if not os.path.lexists(path):
            raise ValueError(f"{where}={spec!r}: {path} is not a file")
        check_user_file(path, key=where, kind="code")
        module_spec = importlib.util.spec_from_file_location(f"tearless_user_env_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as e:
            raise ValueError(f"{where}={spec!r}: cannot import {module_part} ({e})") from None
    if not hasattr(module, attr):
        raise ValueError(f"{where}={spec!r}: {attr} is not defined in {module_part}")
    return getattr(module, attr)
