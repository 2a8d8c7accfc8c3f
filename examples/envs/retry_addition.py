"""A custom multi-turn environment: addition with a second try.

The model answers the row's question (the embedded task's ``47+38=``); a right first answer earns
1 and ends the episode; a wrong one is told ``no`` and gets one more try, worth 0.5 if right. The
environment owns its state (the answer, the tries) and its reward; ``success`` (solved in two tries)
is what validation counts.

    tearless train actor_rollout_ref.rollout.multi_turn.enable=true \
        actor_rollout_ref.rollout.multi_turn.env=examples/envs/retry_addition.py:RetryAddition
"""

from __future__ import annotations

from tearless.envs import Step


class RetryAddition:
    def reset(self, row: dict) -> list[dict]:
        self.answer, self.tries = str(row["ground_truth"]).strip(), 0
        return row["prompt"]

    def step(self, turn: dict) -> Step:
        self.tries += 1
        if turn["content"].strip() == self.answer:
            return Step(reward=1.0 if self.tries == 1 else 0.5, done=True, info={"success": True})
        if self.tries == 2:
            return Step(reward=0.0, done=True, info={"success": False})
        return Step("no")
