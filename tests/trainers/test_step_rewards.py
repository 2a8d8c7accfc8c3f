"""Step rewards through the RL trainer: a scorer's step scores reach token_level_rewards with their
weights, grpo_process trains on them, and a process reward model scores steps behind the manager."""

from __future__ import annotations

import math

import pytest
import torch

from tearless import train
from tearless.run.tracking import read_metrics


@pytest.fixture(scope="module")
def chain_task(tmp_path_factory):
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.warmup import prepare_task

    spec = TaskSpec(
        name="chain_addition", num_train=40, num_val=8, warmup_steps=3, hidden_size=32, num_layers=1
    )
    return prepare_task(spec, tmp_path_factory.mktemp("chain"), log=lambda _: None)


def overrides(task, run_dir, *extra):
    return [
        f"actor_rollout_ref.model.path={task.model_dir}",
        f"data.train_files={task.train_file}",
        f"data.val_files={task.val_file}",
        f"trainer.default_local_dir={run_dir}",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_response_length=24",
        "data.val_max_samples=4",
        "trainer.total_training_steps=2",
        "trainer.logger=[jsonl]",
        "reward_model.num_workers=0",
        "algorithm.adv_estimator=grpo_process",
        *extra,
    ]


def test_step_scores_reach_the_token_rewards_with_their_weights(chain_task, tmp_path):
    seen: list[tuple[float, list[float]]] = []

    def every_third_character(data_source, solution_str, ground_truth, extra_info=None):
        # A step every 3 characters, worth 1 when it ends on a digit: plenty of steps even in the
        # untrained model's noise.
        ends = list(range(3, len(solution_str) + 1, 3))
        scores = [float(solution_str[e - 1].isdigit()) for e in ends]
        score = float(len(solution_str) % 2)
        seen.append((score, scores))
        return {"score": score, "step_scores": scores, "step_ends": ends} if ends else score

    weights = ("reward_model.step_reward.outcome_weight=0.5", "reward_model.step_reward.step_weight=2.0")
    summary = train(
        None,
        overrides(chain_task, tmp_path / "run", "trainer.val_before_train=false", *weights),
        reward_fn=every_third_character,
        log=lambda _: None,
    )
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "critic/rewards/mean" in r]
    assert len(steps) == 2 and summary["after"]
    # The first 16 calls are step 1's samples: their token rewards sum to 0.5·outcome + 2·Σ steps.
    want = sum(0.5 * s + 2.0 * sum(parts) for s, parts in seen[:16]) / 16
    assert steps[0]["critic/rewards/mean"] == pytest.approx(want, rel=1e-5)
    assert steps[0]["critic/score/mean"] == pytest.approx(sum(s for s, _ in seen[:16]) / 16)
    assert all(math.isfinite(r["actor/pg_loss"]) for r in steps)


def test_a_process_reward_model_scores_the_steps(chain_task, tmp_path):
    from transformers import AutoModelForTokenClassification, LlamaConfig

    from tearless.models.loading import load_tokenizer

    tok = load_tokenizer(chain_task.model_dir)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, pad_token_id=tok.pad_token_id, num_labels=2,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForTokenClassification.from_config(config).save_pretrained(tmp_path / "prm")
    tok.save_pretrained(tmp_path / "prm")
    prm = (
        "reward_model.step_reward.prm.enable=true",
        f"reward_model.step_reward.prm.path={tmp_path / 'prm'}",
        "reward_model.step_reward.separator_regex=true",
        r"reward_model.step_reward.separator=\W",  # many steps in the untrained model's noise
    )
    train(None, overrides(chain_task, tmp_path / "run", *prm), log=lambda _: None)
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "critic/rewards/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert 0.0 < r["reward_extra/prm_step_mean/mean"] < 1.0  # a probability per step
        assert math.isfinite(r["actor/pg_loss"])
