"""The resume comparison on plain configs: which differences are identity, bookkeeping or
optimisation, and what an allowed change does to a restored optimizer (hand-computed)."""

from __future__ import annotations

import json

import pytest
import torch

from tearless.config import load_config, to_dict
from tearless.config.resume_compat import ResumeMismatch, apply_config, check_resume, config_differences


def saved(*overrides: str) -> dict:
    return json.loads(json.dumps(to_dict(load_config(None, list(overrides))), default=str))


def test_differences_are_sorted_into_identity_and_optimisation():
    old = saved("trainer.experiment_name=x")
    changes = [
        "algorithm.adv_estimator=rloo", "trainer.total_training_steps=9", "trainer.logger=[jsonl]",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.clip_ratio=0.3",
        "task.num_train=10",
    ]  # fmt: skip
    new = load_config(None, ["trainer.experiment_name=x", *changes])
    identity, others = config_differences(old, new)
    assert identity == ["algorithm.adv_estimator", "task.num_train"]
    assert others == [
        "actor_rollout_ref.actor.clip_ratio"
    ]  # steps, micro-batches and loggers are bookkeeping


def test_keys_only_one_side_has_are_skipped_and_a_missing_config_only_warns(tmp_path):
    old = saved("trainer.experiment_name=x")
    del old["actor_rollout_ref"]["actor"]["clip_ratio"]  # as if written by a version without the key
    cfg = load_config(None, ["trainer.experiment_name=x", "actor_rollout_ref.actor.clip_ratio=0.3"])
    assert check_resume(old, cfg, tmp_path / "global_step_1", log=lambda _: None) == []
    logs = []
    assert check_resume(None, cfg, tmp_path / "global_step_1", log=logs.append) == []
    assert "keeps no config" in logs[0]


def test_an_adaptive_kl_coefficient_cannot_change_on_resume_even_when_listed(tmp_path):
    kl = [
        "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.target_kl=0.1", "algorithm.kl_ctrl.horizon=100", "trainer.experiment_name=x",
    ]  # fmt: skip
    cfg = load_config(
        None,
        [*kl, "algorithm.kl_ctrl.kl_coef=0.5", "trainer.resume_allow_changes=[algorithm.kl_ctrl.kl_coef]"],
    )
    with pytest.raises(ResumeMismatch, match="cannot take effect in a resumed run"):
        check_resume(saved(*kl), cfg, tmp_path / "global_step_3", log=lambda _: None)


def test_apply_config_writes_the_new_rate_through_the_schedule():
    # A warm-up of 4 steps restored at step 2: lr = base × 2/4. Base 1e-3 restored, 3e-3 configured:
    # after apply, lr = 3e-3 × 0.5 = 1.5e-3, and the schedule goes on from the new base. Each
    # expected value is the schedule's own product (base × factor), so equality is exact.
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 4))
    for _ in range(2):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 1e-3 * (2 / 4)
    cfg = load_config(
        None, ["actor_rollout_ref.actor.optim.lr=0.003", "actor_rollout_ref.actor.optim.weight_decay=0.1"]
    )
    kl = type("KL", (), {"value": 9.0})()
    apply_config({"actor": (opt, sched, cfg.actor_rollout_ref.actor.optim)}, kl, cfg.algorithm.kl_ctrl)
    group = opt.param_groups[0]
    assert group["lr"] == 0.003 * (2 / 4) and group["weight_decay"] == 0.1
    assert kl.value == cfg.algorithm.kl_ctrl.kl_coef  # a fixed controller takes the configured β
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.003 * (3 / 4)
