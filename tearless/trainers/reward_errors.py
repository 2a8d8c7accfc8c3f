"""Reward-function errors made visible: each distinct error's traceback printed when it first occurs,
and a generation round whose every sample failed stops the run.

A reward function that raises on a sample gives that sample ``reward_model.failure_score`` and the run
goes on (one bad sample should not end a long run); ``reward/failures`` counts them each step. But a
function that fails on every sample (a ``NameError``, a wrong import) would train on a constant reward
and finish with exit 0, so such a round raises :class:`~tearless.rewards.RewardError` with the
traceback, unless ``reward_model.tolerate_failed_steps`` says to go on.
"""

from __future__ import annotations

from collections.abc import Callable

from tearless.envs.loop import EPISODE_FAILED
from tearless.rewards import RewardError
from tearless.rewards.pool import with_source

# Distinct messages whose traceback is printed; later new messages are only counted (a function that
# embeds the sample in its message would otherwise print one traceback per sample).
MAX_PRINTED = 5


def _what_failed(message: str, count: int, num_samples: int) -> str:
    if message.startswith(EPISODE_FAILED):
        return (
            f"{message} ({count} of {num_samples} samples this round; each gets reward 0 and is not "
            "trained on)"
        )
    return (
        f"reward function error ({count} of {num_samples} samples this round; each gets "
        "reward_model.failure_score)"
    )


class RewardErrors:
    """Tracks the reward errors of a run: ``counts`` maps each distinct error message to its count."""

    def __init__(self, tolerate_failed_steps: bool, log: Callable[[str], None]) -> None:
        self.tolerate = tolerate_failed_steps
        self.log = log
        self.counts: dict[str, int] = {}

    def report(self, errors: dict[str, list], num_samples: int) -> None:
        """Count ``errors`` (``{message: [count, traceback]}`` of one generation round of
        ``num_samples`` samples), print the traceback of each message seen for the first time, and
        raise :class:`RewardError` when every sample failed and that is not tolerated."""
        for message, (count, tb) in errors.items():
            first = message not in self.counts
            self.counts[message] = self.counts.get(message, 0) + count
            if first and len(self.counts) <= MAX_PRINTED:
                self.log(f"{_what_failed(message, count, num_samples)}:\n{with_source(tb.rstrip())}")
        failed = sum(count for count, _ in errors.values())
        if num_samples and failed == num_samples and not self.tolerate:
            tb = with_source(max(errors.values(), key=lambda e: e[0])[1].rstrip())
            raise RewardError(
                f"the reward function failed on all {num_samples} samples of a generation round, so "
                f"there is nothing to learn from:\n{tb}\nFix the function, or set "
                "reward_model.tolerate_failed_steps=true to go on with reward_model.failure_score"
            )
