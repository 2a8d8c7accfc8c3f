"""Stateful environments and agent programs for multi-turn RL (see docs/environments.md).

- :mod:`tearless.envs.base`: the environment protocol (``reset``/``step``), :class:`Step`, the
  registry and loading a user's class by path.
- :mod:`tearless.envs.loop`: :class:`EnvLoop`, episodes as one token sequence each, environment
  tokens masked from the loss.
- :mod:`tearless.envs.render`: token-in, token-out rendering through the chat template.
- :mod:`tearless.envs.endpoint`, :mod:`tearless.envs.agents`: the OpenAI-compatible endpoint and
  training agent programs through it.
- :mod:`tearless.envs.builtin`: the built-in environments (tools inside an environment).
- :mod:`tearless.envs.openenv`: OpenEnv environments (``multi_turn.env=openenv``; openenv-core optional).
"""

from tearless.envs.agents import ProgramLoop, load_agent
from tearless.envs.base import Environment, Step, env_factory, load_object, register_env, registered_envs
from tearless.envs.builtin import ToolEnv
from tearless.envs.endpoint import Endpoint, Session
from tearless.envs.loop import EnvLoop, env_scores
from tearless.envs.openenv import OpenEnvEnvironment

__all__ = [
    "Endpoint",
    "EnvLoop",
    "Environment",
    "OpenEnvEnvironment",
    "ProgramLoop",
    "Session",
    "Step",
    "ToolEnv",
    "env_factory",
    "env_scores",
    "load_agent",
    "load_object",
    "register_env",
    "registered_envs",
]
