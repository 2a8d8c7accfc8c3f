"""veRL 0.9's further policy-loss modes train on the embedded task (4 steps each), logging the same
metrics as the others; and the trainer hands the actor and critic the constant Dr. GRPO normaliser."""

from __future__ import annotations

import math

import pytest

from tearless import train
from tearless.config import load_config
from tearless.run.tracking import read_metrics
from tearless.trainers.rl import RLTrainer

pytestmark = pytest.mark.slow  # each test trains a few steps

A = "actor_rollout_ref.actor"
QUICK = (
    "trainer.val_before_train=false",
    "data.val_max_samples=8",
    "actor_rollout_ref.rollout.val_kwargs.n=2",
    # Two mini-batches: the second is off-policy, so ratios, clipping and trust regions are exercised.
    f"{A}.ppo_mini_batch_size=4",
)
# Each mode with the settings its veRL example uses.
MODES = {
    "geo_mean": [f"{A}.clip_ratio=0.4"],
    "gpg": ["algorithm.adv_estimator=gpg"],
    "sapo": [],
    "dro": [f"{A}.policy_loss.dro_beta=0.1"],
    "dppo_tv": [f"{A}.clip_ratio=0.15"],
    "dppo_kl": [f"{A}.clip_ratio=0.05"],
}
METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/grad_norm")


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mode_trains_with_the_common_metrics_and_no_collapse(overrides, tmp_path, mode):
    settings = [f"{A}.policy_loss.loss_mode={mode}", *MODES[mode]]
    train(None, overrides(tmp_path, "trainer.total_training_steps=4", *QUICK, *settings), log=lambda _: None)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "critic/score/mean" in r]
    assert len(records) == 4
    for r in records:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
        assert all(key in r for key in METRICS), mode
        assert r["actor/num_optimizer_steps"] == 2.0
    # The off-policy mini-batch moved the policy: its log-ratios are not all zero.
    assert any(r["actor/ppo_kl"] != 0.0 for r in records)
    scores = [r["critic/score/mean"] for r in records]
    # The warm-up model answers about 40% right when sampling; a broken update would drive it to 0.
    assert min(scores[-2:]) > 0.2, scores


def test_actor_and_critic_get_the_response_cap_as_the_dr_grpo_normaliser(overrides, tmp_path):
    # data.max_response_length = 16 in the test config; the critic inherits the actor's S.
    cfg = load_config(None, overrides(tmp_path, "algorithm.adv_estimator=gae"), preset="dr_grpo")
    # The settings the group plans with, and those the roles of its one rank (single process) run with.
    workers = RLTrainer(cfg, log=lambda _: None).workers
    for settings in (workers.settings, {r: workers.rank.roles[r].settings for r in ("actor", "critic")}):
        assert settings["actor"].loss_scale_factor == 16.0 and settings["critic"].loss_scale_factor == 16.0
    cfg = load_config(
        None, overrides(tmp_path, f"{A}.loss_scale_factor=64", "critic.enable=true"), preset="dr_grpo"
    )
    workers = RLTrainer(cfg, log=lambda _: None).workers
    for settings in (workers.settings, {r: workers.rank.roles[r].settings for r in ("actor", "critic")}):
        assert settings["actor"].loss_scale_factor == 64.0 and settings["critic"].loss_scale_factor == 64.0
