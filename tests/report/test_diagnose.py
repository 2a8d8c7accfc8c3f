"""Each planted pathology fires its own diagnosis (naming the steps); a healthy run fires none."""

from __future__ import annotations

import math

import pytest

from tearless.report.diagnose import diagnose, step_ranges
from tests.report.histories import STEPS, healthy, planted

LATE = list(range(STEPS // 2 + 1, STEPS + 1))  # the late half of 20 training steps: 11-20


def names(history: list[dict]) -> set[str]:
    return {d.name for d in diagnose(history)}


def test_a_healthy_run_yields_no_diagnosis():
    assert diagnose(healthy()) == []


def test_a_short_run_yields_no_diagnosis_from_trends():
    assert diagnose(planted(lambda s: {"actor/pg_clipfrac": 0.5}, steps=3)) == []


@pytest.mark.parametrize(
    "name, change",
    [
        # entropy × 0.7 per step (1.0 → 0.0008) while the reward stays at 0.5
        ("entropy collapse", lambda s: {"actor/entropy": 0.7**s, "critic/score/mean": 0.5}),
        ("clip fraction persistently high", lambda s: {"actor/pg_clipfrac": 0.35}),
        # KL 0.002 s: early mean 0.011, late mean 0.031 (≥ 2× and ≥ 0.01) with a flat reward
        ("KL rising without reward gain", lambda s: {"actor/kl_loss": 0.002 * s, "critic/score/mean": 0.5}),
        ("responses pinned at the length cap", lambda s: {"response_length/clip_ratio": 0.6}),
        ("no learning signal in most groups", lambda s: {"train/kept_prompt_ratio": 0.2}),
        ("critic lagging", lambda s: {"critic/vf_explained_var": 0.05, "actor/pg_loss": -0.3}),
    ],
)
def test_each_planted_pathology_fires_its_diagnosis_on_the_late_steps(name, change):
    found = diagnose(planted(change))
    assert [d.name for d in found] == [name]
    assert found[0].steps == LATE
    assert found[0].what_was_seen and found[0].what_to_try


def test_all_zero_advantages_mean_no_signal_when_there_is_no_kept_ratio():
    history = [
        {k: v for k, v in r.items() if k != "train/kept_prompt_ratio"}
        | ({"critic/advantages/max": 0.0, "critic/advantages/min": 0.0} if r["step"] > 5 else {})
        for r in healthy()
    ]
    assert names(history) == {"no learning signal in most groups"}


def test_mostly_flat_groups_mean_no_signal_without_dynamic_sampling():
    # The trainer logs the share of groups whose responses all scored the same; 0.8 from step 6 on.
    history = [
        {k: v for k, v in r.items() if k != "train/kept_prompt_ratio"}
        | {"train/zero_variance_group_ratio": 0.8 if r["step"] > 5 else 0.1}
        for r in healthy()
    ]
    assert names(history) == {"no learning signal in most groups"}


def test_entropy_collapse_with_reward_still_rising_is_not_collapse():
    assert diagnose(planted(lambda s: {"actor/entropy": 0.7**s})) == []


def test_reward_failures_name_their_steps():
    found = diagnose(planted(lambda s: {"reward/failures": 3.0 if s in (7, 8) else 0.0}))
    assert [(d.name, d.severity, d.steps) for d in found] == [("reward function failures", "error", [7, 8])]


def test_non_finite_metrics_and_skipped_updates_are_errors():
    history = planted(
        lambda s: {"actor/pg_loss": math.nan if s == 5 else -0.01, "actor/skipped_steps": float(s >= 9)}
    )
    found = diagnose(history)
    assert [(d.name, d.steps) for d in found] == [("non-finite values or skipped updates", [5, 9])]
    assert "actor/pg_loss" in found[0].what_was_seen


def test_step_ranges_are_compact():
    assert step_ranges([7, 1, 2, 3, 10, 11]) == "1-3, 7, 10-11"
    assert step_ranges([]) == ""


def test_most_responses_truncated_fires_even_in_a_short_run():
    # 3 steps (fewer than the trend rules need) with 99% of responses cut: the cap is far too short.
    found = diagnose(planted(lambda s: {"response_length/clip_ratio": 0.99}, steps=3))
    assert [(d.name, d.steps) for d in found] == [("responses pinned at the length cap", [1, 2, 3])]
