"""``multi_turn.env=openenv`` checks its ``env_kwargs`` when the config is validated, with or without
openenv-core installed (the adapter's own tests, which need it, are tests/envs/test_openenv.py)."""

from __future__ import annotations

import importlib.util

import pytest

from tearless.envs import env_factory


def test_openenv_kwargs_fail_at_config_time(tmp_path):
    missing = f"{tmp_path / 'missing.py'}:GuessEnv"
    if importlib.util.find_spec("openenv") is None:
        with pytest.raises(ValueError, match=r"multi_turn\.env=openenv needs openenv-core"):
            env_factory("openenv", {"env": missing})
        return
    with pytest.raises(ValueError, match=r"set exactly one of env .* and base_url"):
        env_factory("openenv", {})
    with pytest.raises(ValueError, match="set exactly one of env"):
        env_factory("openenv", {"env": "examples/envs/openenv_guess.py:GuessEnv", "base_url": "http://x"})
    with pytest.raises(ValueError, match=r"env_kwargs\.env=.*missing\.py is not a file"):
        env_factory("openenv", {"env": missing})
    with pytest.raises(ValueError, match=r"env_kwargs\.action=.*Nope is not defined"):
        env_factory(
            "openenv", {"base_url": "http://127.0.0.1:9", "action": "examples/envs/openenv_guess.py:Nope"}
        )
    env_factory("openenv", {"env": "examples/envs/openenv_guess.py:GuessEnv"})  # a valid one passes
