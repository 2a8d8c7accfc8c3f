"""Reward functions that return garbage, print megabytes or lose their worker process: every case is
handled per sample (a failure with a reason, or a rescoring) and counted, and training goes on."""

from __future__ import annotations

import math
import os
import signal

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tearless import train
from tearless.rewards import RewardManager
from tearless.rewards.managers import BatchRewardManager
from tearless.rewards.pool import check_value
from tearless.run.tracking import read_metrics
from tearless.tasks import arithmetic

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**308, max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=50),
    st.binary(max_size=20),
    st.complex_numbers(),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=4),
        st.dictionaries(st.just("score"), inner, min_size=1).flatmap(
            lambda d: st.dictionaries(st.text(max_size=8), inner, max_size=3).map(lambda e: {**e, **d})
        ),
    ),
    max_leaves=8,
)


@settings(max_examples=int(os.environ.get("TEARLESS_FUZZ_EXAMPLES", "150")), deadline=None)
@given(_values)
def test_any_return_value_becomes_a_finite_score_or_a_reason(value):
    outcome = check_value(value)
    if outcome[0] == "ok":
        _, score, extras, steps = outcome
        assert isinstance(score, float) and math.isfinite(score)
        assert all(isinstance(v, float) and math.isfinite(v) for v in extras.values())
        assert steps is None or all(isinstance(v, float) and math.isfinite(v) for v in steps[0])
    else:
        assert outcome[0] == "err" and isinstance(outcome[1], str) and len(outcome[1]) < 400


BAD = [float("nan"), float("inf"), -float("inf"), None, "1.0", {"acc": 1.0}, {"score": None},
       {"score": "0.5"}, 10**400, [1.0], torch.tensor([1.0, 2.0]), object()]  # fmt: skip
GOOD = [1.0, 0, True, {"score": 0.25, "acc": 1, "note": "x", "nan": float("nan")}, np.float32(0.5),
        torch.tensor(0.75), np.array([2.0])]  # fmt: skip


def _item(i):
    return {"data_source": "x", "solution_str": str(i), "ground_truth": None, "extra_info": {"i": i}}


@pytest.mark.parametrize("workers", [0, 2])
def test_bad_values_fail_only_their_samples_and_are_counted(workers):
    values = GOOD + BAD

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return values[extra_info["i"]]

    with RewardManager(fn, num_workers=workers, failure_score=-1.0) as manager:
        results = manager.score([_item(i) for i in range(len(values))])
    assert [r.score for r in results[: len(GOOD)]] == [1.0, 0.0, 1.0, 0.25, 0.5, 0.75, 2.0]
    assert results[3].extra == {"acc": 1.0}  # the string and the NaN extra are dropped
    assert all(r.error is None for r in results[: len(GOOD)])
    failed = results[len(GOOD) :]
    assert all(r.score == -1.0 and r.error for r in failed)
    assert "non-finite" in failed[0].error and "without a 'score' key" in failed[5].error
    assert "type NoneType" in failed[6].error and "non-finite score (inf)" in failed[8].error


def test_a_batch_function_returning_garbage_is_a_clear_error_or_per_sample_failures():
    items = [_item(i) for i in range(3)]
    manager = BatchRewardManager(
        lambda data_sources, solution_strs, ground_truths, extra_infos: [1, None, "x"]
    )
    assert [(r.score, r.error is None) for r in manager.score(items)] == [
        (1.0, True),
        (0.0, False),
        (0.0, False),
    ]
    for garbage in (None, 3.0, "abc", {"score": 1}):
        manager = BatchRewardManager(
            lambda data_sources, solution_strs, ground_truths, extra_infos, g=garbage: g
        )
        with pytest.raises(TypeError, match="must return a list with one score"):
            manager.score(items)


def test_a_scorer_printing_megabytes_is_scored_normally(capfd):
    def loud(data_source, solution_str, ground_truth, extra_info=None):
        print("x" * 2_000_000)
        return float(solution_str)

    with RewardManager(loud, num_workers=2, timeout_s=20) as manager:
        results = manager.score([_item(i) for i in range(4)])
    assert [(r.score, r.error) for r in results] == [(float(i), None) for i in range(4)]
    assert len(capfd.readouterr().out) >= 8_000_000


def test_a_worker_killed_mid_sample_is_counted_and_its_sample_rescored_once(tmp_path):
    log, marker = tmp_path / "calls.log", tmp_path / "killed"

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        with open(log, "a") as f:
            f.write(solution_str + "\n")
        if solution_str == "3" and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return float(solution_str)

    manager = RewardManager(fn, num_workers=2)
    results = manager.score([_item(i) for i in range(6)])
    assert [(r.score, r.error) for r in results] == [(float(i), None) for i in range(6)]
    calls = log.read_text().split()
    assert sorted(calls) == ["0", "1", "2", "3", "3", "4", "5"]  # sample 3 twice, every other once
    assert manager.lost_workers == 1 and len(manager.worker_pids) == 2
    manager.close()
    assert manager.lost_workers == 1  # the count survives the pool


@pytest.mark.slow
def test_the_trainer_logs_lost_reward_workers(overrides, tmp_path):
    marker = tmp_path / "killed"

    def reward_fn(data_source, solution_str, ground_truth, extra_info=None):
        if not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)  # the first sample of step 1 loses its worker
        return arithmetic.compute_score(solution_str, ground_truth)

    train(
        None,
        overrides(
            tmp_path / "run",
            "reward_model.num_workers=2",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
            "data.val_max_samples=4",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
        ),
        reward_fn=reward_fn,
        log=lambda _: None,
    )
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["reward/lost_workers"], r["reward/failures"]) for r in records] == [(1.0, 0.0), (0.0, 0.0)]
