"""The RL run's watch over its steps: the optimizer steps skipped (non-finite loss or gradient norm)
per role, the run of bad steps that stops the run at ``trainer.max_bad_steps``, and the two warnings
a user should see once: most responses cut at the response cap, and prompt groups that carry no
learning signal."""

from __future__ import annotations

from collections.abc import Callable

from tearless.config import Config


class StepHealth:
    """Counts and warnings over the steps of one run; ``bad_steps`` and ``skipped`` are checkpointed."""

    def __init__(
        self, cfg: Config, response_length: int, total_steps: int, log: Callable[[str], None]
    ) -> None:
        self.cfg, self.response_length, self.total_steps, self.log = cfg, response_length, total_steps, log
        self.bad_steps = 0  # RL steps in a row with a skipped (non-finite) optimizer step
        self.flat_steps, self.warned_no_signal = 0, False  # steps in a row with mostly flat groups
        self.warned_truncation = False
        self.skipped = {"actor": 0.0, "critic": 0.0}  # optimizer steps skipped so far, per role

    def count_bad_step(self, metrics: dict[str, float]) -> bool:
        """Track optimizer steps skipped this step (from the roles' counters) and the run of bad steps;
        whether the run must stop (``0 < trainer.max_bad_steps <= bad steps in a row``)."""
        before = sum(self.skipped.values())
        for role in self.skipped:
            self.skipped[role] = metrics.get(f"{role}/skipped_steps", self.skipped[role])
        self.bad_steps = self.bad_steps + 1 if sum(self.skipped.values()) > before else 0
        metrics["training/bad_steps_in_a_row"] = float(self.bad_steps)
        metrics["training/total_steps"] = float(self.total_steps)  # the report tells finished from stopped
        return 0 < self.cfg.trainer.max_bad_steps <= self.bad_steps

    def stop_message(self, step: int, checkpoint: str) -> str:
        """Why the run stops after ``step``, and how to go on from ``checkpoint``."""
        first = step - self.bad_steps + 1
        return (
            f"trainer.max_bad_steps={self.cfg.trainer.max_bad_steps}: steps {first}..{step} in a row had a "
            "non-finite loss or gradient norm, so their optimizer steps were skipped; stopping. "
            f"{checkpoint} holds the weights and optimizer state with none of the skipped updates in "
            "them. Lower actor_rollout_ref.actor.optim.lr, check the rewards and "
            "data for NaN/inf, or raise trainer.max_bad_steps (0 = never stop), then resume with "
            "trainer.resume_mode=auto"
        )

    def warn(self, metrics: dict[str, float]) -> None:
        """The step's warnings, each once a run: truncation, then no signal."""
        self.warn_truncation(metrics)
        self.warn_no_signal(metrics)

    def warn_truncation(self, metrics: dict[str, float]) -> None:
        """Warn once when most of a step's responses hit the response cap (answers cut before they end)."""
        share = metrics.get("response_length/clip_ratio", 0.0)
        if share > 0.5 and not self.warned_truncation:
            self.warned_truncation = True
            self.log(
                f"warning: {share:.0%} of this step's responses reached the cap of "
                f"{self.response_length} tokens and were cut before they ended; raise "
                "data.max_response_length"
            )

    def warn_no_signal(self, metrics: dict[str, float]) -> None:
        """Warn once when most prompt groups of two steps in a row got equal rewards for every response
        while the step's mean score sat in the lower half of its range (the flat groups are mostly
        failures): group-relative advantages are then zero and those groups teach nothing. Groups flat
        because every answer is right (a run that has learned its task) are no cause for a warning."""
        ratio = metrics.get("train/zero_variance_group_ratio", 0.0)
        low, high = metrics.get("critic/score/min", 0.0), metrics.get("critic/score/max", 0.0)
        failing = metrics.get("critic/score/mean", 0.0) <= (low + high) / 2
        rollout = self.cfg.actor_rollout_ref.rollout
        flat = ratio > 0.5 and failing and rollout.n > 1
        self.flat_steps = self.flat_steps + 1 if flat else 0
        if self.flat_steps == 2 and not self.warned_no_signal:
            self.warned_no_signal = True
            self.log(
                f"warning: {ratio:.0%} of this step's prompt groups (and most of the last step's) got the "
                "same reward for every response, so they carry no learning signal "
                "(train/zero_variance_group_ratio); raise actor_rollout_ref.rollout.temperature (now "
                f"{rollout.temperature}) or actor_rollout_ref.rollout.n (now {rollout.n}), or use prompts "
                "the model solves sometimes"
            )
