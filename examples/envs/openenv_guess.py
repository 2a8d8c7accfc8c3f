"""An OpenEnv environment (openenv-core 0.3.0) trained through ``multi_turn.env=openenv``.

Guess a digit in two tries: the target is the reset's ``seed`` (the row's ``extra_info.seed``); a
wrong try costs 0.25 and is told ``higher``/``lower``; a right one earns 1 and ends the episode.
In process::

    tearless train actor_rollout_ref.rollout.multi_turn.enable=true \\
        actor_rollout_ref.rollout.multi_turn.env=openenv \\
        actor_rollout_ref.rollout.multi_turn.env_kwargs.env=examples/envs/openenv_guess.py:GuessEnv \\
        data.train_files=guess.parquet data.val_files=guess.parquet

Served by OpenEnv's own server (``python examples/envs/openenv_guess.py 8000``), the same run with
``env_kwargs.base_url=http://127.0.0.1:8000`` and
``env_kwargs.action=examples/envs/openenv_guess.py:GuessAction`` instead of ``env_kwargs.env``.
"""

from __future__ import annotations

import sys

from openenv.core import Environment, create_app
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    guess: int  # the model's whole reply, parsed as an integer by pydantic


class GuessObservation(Observation):
    hint: str


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target, self.tries = seed, 0
        return GuessObservation(hint="Guess my digit (0-9). Reply with the digit only.")

    def step(self, action, timeout_s=None, **kwargs):
        self.tries += 1
        if action.guess == self.target:
            return GuessObservation(hint="yes", reward=1.0, done=True, metadata={"success": True})
        hint = "higher" if action.guess < self.target else "lower"
        return GuessObservation(hint=hint, reward=-0.25, done=self.tries == 2, metadata={"success": False})

    @property
    def state(self):
        return State(step_count=self.tries)


if __name__ == "__main__":
    import uvicorn

    app = create_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=64)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]) if len(sys.argv) > 1 else 8000)
