"""Reward-function errors: each distinct error's traceback printed once and counted, and a round whose
every sample failed stops the run (issue 25), unless reward_model.tolerate_failed_steps."""

from __future__ import annotations

import pytest

from tearless import train
from tearless.rewards import RewardError, RewardManager
from tearless.rewards.pool import with_source
from tearless.run.tracking import read_metrics
from tearless.trainers.reward_errors import RewardErrors
from tearless.workers.scoring import distinct_errors


def broken(data_source, solution_str, ground_truth, extra_info=None):
    return undefined_name  # noqa: F821  (the NameError a typo gives)


def odd_fails(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["i"] % 2:
        raise ValueError("odd sample")
    return 1.0


def _items(n):
    return [
        {"data_source": "x", "solution_str": "s", "ground_truth": "g", "extra_info": {"i": i}}
        for i in range(n)
    ]


def test_distinct_errors_group_by_message_with_the_functions_traceback():
    with RewardManager(odd_fails, num_workers=0) as manager:
        results = manager.score(_items(5))
    errors = distinct_errors(results)
    # Samples 1 and 3 raise: one message, counted twice; the traceback ends in the function's line.
    assert list(errors) == ["raised: ValueError: odd sample"]
    count, tb = errors["raised: ValueError: odd sample"]
    assert count == 2
    assert "in odd_fails" in tb and tb.endswith("ValueError: odd sample\n")
    # Source lines are added where it is printed (a confined worker may not open files).
    assert 'raise ValueError("odd sample")' in with_source(tb)
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_traceback_comes_back_from_worker_processes_too(workers):
    with RewardManager(odd_fails, num_workers=workers) as manager:
        results = manager.score(_items(2))
    assert results[1].error == "raised: ValueError: odd sample"
    assert "in odd_fails" in results[1].traceback


def test_each_distinct_error_prints_once_and_an_all_failed_round_stops():
    lines: list[str] = []
    tracker = RewardErrors(False, lines.append)
    tracker.report({"raised: A": [2, "TB-A"]}, 8)
    tracker.report({"raised: A": [3, "TB-A"], "raised: B": [1, "TB-B"]}, 8)
    assert tracker.counts == {"raised: A": 5, "raised: B": 1}
    assert len(lines) == 2 and "TB-A" in lines[0] and "2 of 8 samples" in lines[0] and "TB-B" in lines[1]
    with pytest.raises(RewardError, match="failed on all 4 samples") as e:
        tracker.report({"raised: A": [3, "TB-A"], "raised: B": [1, "TB-B"]}, 4)
    assert "TB-A" in str(e.value) and "reward_model.tolerate_failed_steps=true" in str(e.value)
    RewardErrors(True, lines.append).report({"raised: A": [4, "TB-A"]}, 4)  # tolerated: no raise


def test_a_reward_failing_everywhere_stops_the_run_with_its_traceback(overrides, tmp_path):
    lines: list[str] = []
    with pytest.raises(RewardError) as e:
        train(
            None,
            overrides(tmp_path / "run", "trainer.total_training_steps=2", "trainer.val_before_train=false"),
            reward_fn=broken,
            log=lines.append,
        )
    assert "NameError: name 'undefined_name' is not defined" in str(e.value)
    assert "in broken" in str(e.value)
    assert any("reward function error (32 of 32 samples" in line for line in lines)


def test_tolerated_failures_train_and_are_counted(overrides, tmp_path):
    train(
        None,
        overrides(
            tmp_path / "run",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "data.val_max_samples=4",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
            "reward_model.tolerate_failed_steps=true",
        ),
        reward_fn=broken,
        log=lambda _: None,
    )
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward/failures" in r]
    assert steps[0]["reward/failures"] == 32.0  # 8 prompts × 4 responses
