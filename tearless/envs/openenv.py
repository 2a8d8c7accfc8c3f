"""OpenEnv environments (``openenv-core``, BSD-3-Clause) as tearless environments.

``multi_turn.env=openenv`` plays one OpenEnv episode per tearless episode, either in process
(``env=pkg.module:MyEnvironment``, an ``openenv.core.Environment`` subclass built per episode with
``env_args``) or against a running OpenEnv server (``base_url=http://host:port``, through its
WebSocket session with ``client=pkg.module:MyEnvClient``, or OpenEnv's ``GenericEnvClient`` of plain
dicts when ``client`` is unset).

The mapping, both ways:

- **model text -> Action**: the assistant turn's text fills one field of the action, ``action_field``,
  or the action's only field besides ``metadata``; with neither, the text must be a JSON object of
  the action's fields. The action type is ``action=pkg.module:MyAction``, else the type parameter of
  the environment's or client's class (``Environment[MyAction, ...]``); a generic client sends the
  dict. A text that does not validate is no exception: the step answers the validation error as the
  next observation with reward 0, the episode goes on (the turn budget bounds it).
- **Observation -> messages**: ``observation_field`` of the observation, or its only field besides
  ``done``, ``reward`` and ``metadata``, or else those fields as JSON, as one ``user`` message. The
  reset observation follows the data row's prompt messages (appended to the last ``user`` message).
- **reward, done, info**: the step's ``reward`` (``None`` is 0) and ``done``; info is the
  observation's ``metadata``, whose ``success`` (if any) validation counts as solved.
- **reset**: ``seed`` and ``episode_id`` from the row's ``extra_info`` when present, plus
  ``extra_info["openenv_reset"]`` (a dict of further keyword arguments).
"""

from __future__ import annotations

import asyncio
import json
import typing
from typing import Any

from tearless.envs.base import Messages, Step, load_object, register_env
from tearless.tools.execute import in_daemon_thread

WHERE = "actor_rollout_ref.rollout.multi_turn.env_kwargs"
BASE_OBSERVATION_FIELDS = ("done", "reward", "metadata")


def _openenv() -> Any:
    # optional dependency: only this environment needs openenv-core (see docs/environments.md)
    try:
        import openenv.core as core
    except ImportError as e:
        raise ValueError(
            f"multi_turn.env=openenv needs openenv-core ({e}); install it as docs/environments.md says"
        ) from None
    return core


def _resolve(value: Any, key: str) -> Any:
    """A class given as itself or as a ``pkg.module:Name`` / ``file.py:Name`` string."""
    return load_object(value, f"{WHERE}.{key}") if isinstance(value, str) else value


def _type_parameter(cls: type, base: type) -> type | None:
    """The first type argument of ``base`` in ``cls``'s bases, e.g. ``A`` of ``Environment[A, O, S]``."""
    for klass in cls.__mro__:
        for orig in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(orig)
            if isinstance(origin, type) and issubclass(origin, base):
                args = typing.get_args(orig)
                if args and isinstance(args[0], type) and args[0] is not dict:
                    return args[0]
    return None


def _fields(obj: Any) -> dict[str, Any]:
    """An observation as a dict (OpenEnv observations are pydantic models; generic ones are dicts)."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    if isinstance(obj, dict):
        return dict(obj)
    raise TypeError(f"an OpenEnv observation is a pydantic model or a dict, got {type(obj).__name__}")


@register_env("openenv")
class OpenEnvEnvironment:
    """One OpenEnv episode (see the module docstring); the constructor's arguments are
    ``multi_turn.env_kwargs``."""

    def __init__(
        self,
        env: Any = None,
        base_url: str | None = None,
        client: Any = None,
        action: Any = None,
        action_field: str | None = None,
        observation_field: str | None = None,
        env_args: dict[str, Any] | None = None,
    ) -> None:
        core = _openenv()
        self.check_kwargs({"env": env, "base_url": base_url})
        self.action_field, self.observation_field = action_field, observation_field
        if env is not None:
            env_cls = _resolve(env, "env")
            self.env, self.client = env_cls(**(env_args or {})), None
            owner, base = env_cls, core.Environment
        else:
            client_cls = _resolve(client, "client") if client is not None else core.GenericEnvClient
            self.env, self.client = None, client_cls(base_url=base_url)
            owner, base = client_cls, core.EnvClient
        self.action_cls = _resolve(action, "action") if action is not None else _type_parameter(owner, base)
        if self.action_cls is not None and not hasattr(self.action_cls, "model_validate"):
            raise ValueError(f"{WHERE}.action={action!r} is not a pydantic model class (an OpenEnv Action)")
        self.prompt: Messages = []

    @classmethod
    def check_kwargs(cls, kwargs: dict[str, Any]) -> None:
        """At config time: openenv-core importable, exactly one of ``env`` and ``base_url``, and the
        named classes loadable (ValueError with one line otherwise)."""
        _openenv()
        if (kwargs.get("env") is None) == (kwargs.get("base_url") is None):
            raise ValueError(f"{WHERE}: set exactly one of env (an OpenEnv Environment class) and base_url")
        for key in ("env", "client", "action"):
            if kwargs.get(key) is not None:
                _resolve(kwargs[key], key)

    def action(self, text: str) -> Any:
        """The model's text as the environment's action (see the module docstring); raises
        ValueError with one line when it does not fit."""
        field = self.action_field
        if field is None and self.action_cls is not None:
            names = [f for f in self.action_cls.model_fields if f != "metadata"]
            field = names[0] if len(names) == 1 else None
        if field is not None:
            payload: Any = {field: text}
        else:
            try:
                payload = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"the action must be a JSON object of its fields ({e})") from None
            if not isinstance(payload, dict):
                raise ValueError("the action must be a JSON object of its fields")
        if self.action_cls is None:
            return payload
        try:
            return self.action_cls.model_validate(payload)
        except Exception as e:  # pydantic's ValidationError: the model's mistake, told to it
            raise ValueError(f"invalid {self.action_cls.__name__}: {' '.join(str(e).split())}") from None

    def text(self, observation: Any) -> str:
        fields = {k: v for k, v in _fields(observation).items() if k not in BASE_OBSERVATION_FIELDS}
        name = self.observation_field
        if name is None and len(fields) == 1:
            name = next(iter(fields))
        if name is not None:
            if name not in fields:
                raise ValueError(f"{WHERE}.observation_field={name!r} is not a field of the observation")
            value = fields[name]
            return value if isinstance(value, str) else json.dumps(value, default=str)
        return json.dumps(fields, sort_keys=True, default=str)

    def _result(self, result: Any) -> tuple[Any, float, bool, dict[str, Any]]:
        """(observation, reward, done, metadata) of an in-process observation or a client's StepResult."""
        if self.client is not None:
            observation, reward, done = result.observation, result.reward, result.done
        else:
            observation, reward, done = result, result.reward, result.done
        metadata = _fields(observation).get("metadata") or {}
        return observation, float(reward or 0.0), bool(done), dict(metadata)

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """An in-process environment's (sync) method in a daemon thread, so that a hang is abandoned
        by the loop's timeout instead of blocking the event loop; a client's coroutine awaited."""
        if self.client is not None:
            return await fn(*args, **kwargs)
        return await in_daemon_thread(asyncio.get_running_loop(), lambda: fn(*args, **kwargs))

    async def reset(self, row: dict[str, Any]) -> Messages:
        extra = row.get("extra_info") or {}
        kwargs = {k: extra[k] for k in ("seed", "episode_id") if k in extra}
        kwargs.update(extra.get("openenv_reset") or {})
        target = self.client if self.client is not None else self.env
        first = await self._call(target.reset, **kwargs)
        text = self.text(self._result(first)[0])
        messages = [dict(m) for m in row.get("prompt") or []]
        if messages and messages[-1].get("role") == "user":
            messages[-1]["content"] = f"{messages[-1]['content']}\n\n{text}"
        else:
            messages.append({"role": "user", "content": text})
        return messages

    async def step(self, turn: dict[str, Any]) -> Step:
        try:
            action = self.action(turn.get("content") or "")
        except ValueError as e:
            return Step(str(e), reward=0.0, done=False, info={"invalid_action": True})
        target = self.client if self.client is not None else self.env
        observation, reward, done, metadata = self._result(await self._call(target.step, action))
        return Step(self.text(observation), reward=reward, done=done, info=metadata)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        else:
            await self._call(self.env.close)
