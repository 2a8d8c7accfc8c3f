"""The RL run's watch over its steps (tearless/trainers/health.py): bad steps counted from the roles'
skipped-step counters, the stop at ``trainer.max_bad_steps``, and each warning printed once."""

from __future__ import annotations

from tearless.config import load_config
from tearless.trainers.health import StepHealth


def health(*overrides: str) -> tuple[StepHealth, list[str]]:
    lines: list[str] = []
    cfg = load_config(None, list(overrides), notify=lambda _: None)
    return StepHealth(cfg, response_length=16, total_steps=6, log=lines.append), lines


def test_bad_steps_in_a_row_stop_at_the_limit():
    watch, _ = health("trainer.max_bad_steps=2")
    # cumulative skipped optimizer steps per role, as the workers report them after each RL step
    reports = [{}, {"actor/skipped_steps": 1.0}, {"actor/skipped_steps": 1.0}, {"actor/skipped_steps": 2.0},
               {"actor/skipped_steps": 2.0, "critic/skipped_steps": 1.0}]  # fmt: skip
    stops, runs = [], []
    for metrics in reports:
        stops.append(watch.count_bad_step(metrics))
        runs.append(metrics["training/bad_steps_in_a_row"])
        assert metrics["training/total_steps"] == 6.0
    assert runs == [0.0, 1.0, 0.0, 1.0, 2.0] and stops == [False, False, False, False, True]
    assert watch.skipped == {"actor": 2.0, "critic": 1.0}
    assert "steps 4..5 in a row had a non-finite loss" in watch.stop_message(5, "global_step_5")


def test_zero_max_bad_steps_never_stops():
    watch, _ = health("trainer.max_bad_steps=0")
    assert not any(watch.count_bad_step({"actor/skipped_steps": float(i)}) for i in range(1, 6))
    assert watch.bad_steps == 5


def test_each_warning_once():
    watch, lines = health("actor_rollout_ref.rollout.n=4")
    cut = {"response_length/clip_ratio": 0.75}
    # 3 of 4 groups flat while the mean score sits at the bottom of its range: no signal, twice in a row
    flat = {"train/zero_variance_group_ratio": 0.75, "critic/score/min": 0.0, "critic/score/max": 1.0,
            "critic/score/mean": 0.25}  # fmt: skip
    for metrics in (cut, cut, flat, flat, flat):
        watch.warn(metrics)
    assert len(lines) == 2
    assert lines[0].startswith("warning: 75% of this step's responses reached the cap of 16 tokens")
    assert lines[1].startswith("warning: 75% of this step's prompt groups (and most of the last step's)")
    # groups flat because every answer is right (mean at the top) are no cause for a warning
    solved, solved_lines = health("actor_rollout_ref.rollout.n=4")
    for _ in range(3):
        solved.warn({**flat, "critic/score/mean": 1.0})
    assert solved_lines == []
