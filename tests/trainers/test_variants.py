"""Other estimators, KL in the reward, and the validation/checkpoint schedule, one short run each."""

from __future__ import annotations

import math

import pytest

from tearless import train
from tearless.run.tracking import read_metrics
from tests.tolerances import kl_of_equal_policies, logprob_tol, sum_tol

pytestmark = pytest.mark.slow  # every test here trains (about a second each)

QUICK = (
    "trainer.val_before_train=false",
    "data.val_max_samples=8",
    "actor_rollout_ref.rollout.val_kwargs.n=2",
)


@pytest.mark.parametrize(
    "estimator",
    ["gae", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "grpo_passk"],
)
def test_every_estimator_trains_a_step(overrides, tmp_path, estimator):
    train(
        None,
        overrides(tmp_path, f"algorithm.adv_estimator={estimator}", "trainer.total_training_steps=1", *QUICK),
        log=lambda _: None,
    )
    (r,) = read_metrics(tmp_path / "metrics.jsonl")
    assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
    assert r["actor/grad_norm"] > 0 or r["critic/advantages/max"] == r["critic/advantages/min"] == 0
    if estimator == "gae":
        # PPO's critic starts with a zeroed value head: values 0, then one update on the returns.
        assert r["critic/values/mean"] == 0.0 and r["critic/vf_loss"] > 0
    if estimator in ("rloo", "opo", "grpo_passk"):
        # Group-relative estimators leave the rewards as they are and return the advantages.
        assert r["critic/returns/mean"] == pytest.approx(r["critic/advantages/mean"])


def test_kl_in_reward_is_zero_at_the_start_and_then_lowers_the_rewards(overrides, task, tmp_path):
    from transformers import AutoConfig

    train(
        None,
        overrides(
            tmp_path,
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_penalty=abs",  # |log π - log π_ref| >= 0, so the penalty only lowers rewards
            "algorithm.kl_ctrl.kl_coef=0.5",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "trainer.total_training_steps=3",
            *QUICK,
        ),
        log=lambda _: None,
    )
    records = read_metrics(tmp_path / "metrics.jsonl")
    first, last = records[0], records[-1]
    # Step 1: the actor is the reference, so KL is 0 and the rewards are the scores, up to rounding:
    # old and reference log-probs come from two forwards of two model instances (other micro-batches),
    # which agree to logprob_tol (|log p| up to ~10, float32), so |old − ref| averages no more.
    zero_kl = kl_of_equal_policies("abs", logprob_tol(AutoConfig.from_pretrained(task.model_dir)))
    assert 0.0 <= first["actor/reward_kl_penalty"] <= zero_kl
    # rewards = scores − 0.5·Σ_t kl_t: the mean over rows moves by at most 0.5 · 16 tokens · the mean
    # KL, plus the float32 rounding of rows of ≤ 16 tokens and a mean over 32 rows, all of size ≤ 1.
    shift = 0.5 * 16 * first["actor/reward_kl_penalty"] + sum_tol(16 + 32, 1.0)
    assert first["critic/rewards/mean"] == pytest.approx(first["critic/score/mean"], abs=shift)
    assert last["actor/reward_kl_penalty"] > zero_kl  # a real KL, beyond what rounding could make
    assert last["actor/reward_kl_penalty_coeff"] == 0.5  # fixed controller
    assert last["critic/rewards/mean"] < last["critic/score/mean"]
    assert "timing_s/old_log_prob" in last and "timing_s/ref" in last


def test_validation_and_checkpoint_frequencies(overrides, tmp_path):
    train(
        None,
        overrides(
            tmp_path,
            "trainer.total_training_steps=4",
            "trainer.test_freq=2",
            "trainer.save_freq=3",
            *QUICK,
        ),
        log=lambda _: None,
    )
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "val-core/arithmetic/acc/greedy" in r] == [2, 4]
    assert [r["step"] for r in records if "timing_s/save_checkpoint" in r] == [3, 4]
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_3", "global_step_4"]
    assert (
        "val-core/arithmetic/acc/pass@2" in records[-1]
        and "val-core/arithmetic/acc/pass@4" not in records[-1]
    )


def test_logged_lr_is_the_lr_the_step_used(overrides, tmp_path):
    # Linear warm-up over 2 steps from lr 1e-4: step 1 updates with 0.5e-4, step 2 with 1e-4 (the
    # multiplier is (s + 1) / 2 at scheduler step s = 0, 1). veRL logs actor/lr before stepping the
    # scheduler, i.e. the rate of the update it reports on.
    train(
        None,
        overrides(
            tmp_path,
            "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
            "trainer.total_training_steps=3",
            *QUICK,
        ),
        log=lambda _: None,
    )
    lrs = [r["actor/lr"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert lrs == pytest.approx([0.5e-4, 1e-4, 1e-4])
