"""A custom multi-turn environment: a question with a second try.

The model answers the row's question (the embedded task's ``47+38=``); the answer is scored by the
built-in scorer of the row's ``data_source`` (:func:`tearless.rewards.compute_score`). A right first
answer earns 1 and ends the episode; a wrong one is told ``no`` and gets one more try, worth 0.5 if
right. The environment owns its state (the row, the tries) and its reward; ``success`` (solved in
two tries) is what validation counts.

    tearless train actor_rollout_ref.rollout.multi_turn.enable=true data.max_response_length=40 \
        actor_rollout_ref.rollout.multi_turn.env=examples/envs/retry_addition.py:RetryAddition
"""

from __future__ import annotations

from tearless.envs import Step
from tearless.rewards import compute_score


class RetryAddition:
    def reset(self, row: dict) -> list[dict]:
        self.row, self.tries = row, 0
        return row["prompt"]

    def step(self, turn: dict) -> Step:
        self.tries += 1
        r = self.row
        if compute_score(r["data_source"], turn["content"], r["ground_truth"], r["extra_info"]) >= 1.0:
            return Step(reward=1.0 if self.tries == 1 else 0.5, done=True, info={"success": True})
        if self.tries == 2:
            return Step(reward=0.0, done=True, info={"success": False})
        return Step("no")
