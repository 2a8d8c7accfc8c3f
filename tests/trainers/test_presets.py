"""Every algorithm preset trains on the embedded task: its own metrics are logged and finite, and the
training reward does not collapse. Plus the adaptive KL controller inside a real run."""

from __future__ import annotations

import itertools
import math

import pytest

from tearless import train
from tearless.config import load_config, presets
from tearless.run.tracking import read_metrics

pytestmark = pytest.mark.slow  # each test trains a few steps

QUICK = (
    "trainer.val_before_train=false",
    "data.val_max_samples=8",
    "actor_rollout_ref.rollout.val_kwargs.n=2",
)

# The metrics that show each preset's own mechanism at work.
OWN_METRICS = {
    "ppo": ["critic/vf_loss", "critic/vf_explained_var", "critic/values/mean", "actor/reward_kl_penalty"],
    "grpo": ["actor/kl_loss", "actor/pg_clipfrac"],
    "dr_grpo": ["actor/pg_loss"],
    "dapo": ["train/num_gen_batches", "train/kept_prompt_ratio"],
    "rloo": ["actor/pg_loss"],
    "reinforce_pp": ["actor/kl_loss"],
    "remax": ["actor/pg_loss"],
    "gspo": ["actor/pg_clipfrac"],
}


# Presets that bring their own task (data, tools) are trained in their own tests:
# search_r1 in tests/rollout/test_search_r1_train.py; countdown and knights_knaves need a real
# instruct model and are checked against their data in tests/data/test_make.py; word_problems (and
# knights_knaves) train SmolLM2-135M-Instruct in tests/test_real_model.py; word_problems_rm is that
# recipe with a reward model as its only reward (below, and the reward model's runs in test_rm.py);
# vlm_count's task trains in tests/trainers/test_vlm.py.
TASK_PRESETS = (
    "countdown",
    "knights_knaves",
    "search_r1",
    "vlm_count",
    "word_problems",
    "word_problems_rm",
)


def test_every_shipped_preset_is_covered_and_loads():
    assert sorted(OWN_METRICS) == [p for p in presets() if p not in TASK_PRESETS]
    assert (
        load_config(None, preset="dr_grpo").actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    )
    assert load_config(
        None, ["algorithm.norm_adv_by_std_in_grpo=true"], preset="dr_grpo"
    ).algorithm.norm_adv_by_std_in_grpo


def test_the_reward_model_recipe_is_the_word_problems_recipe_with_the_model_as_its_only_reward(tmp_path):
    from tearless.config import ConfigError, to_dict

    needs_a_model = r"^reward_model.model.path: reward_model.enable=true needs a model"
    with pytest.raises(ConfigError, match=needs_a_model):
        load_config(None, preset="word_problems_rm")
    rm = ["reward_model.model.path=" + str(tmp_path)]
    mine = to_dict(load_config(None, rm, preset="word_problems_rm"))
    by_hand = ["reward_model.enable=true", "reward_model.rule_weight=0", *rm]
    assert mine == to_dict(load_config(None, by_hand, preset="word_problems"))
    assert mine["reward_model"]["rule_weight"] == 0.0 and mine["algorithm"]["adv_estimator"] == "grpo"


@pytest.mark.parametrize("name", sorted(OWN_METRICS))
def test_preset_trains_with_its_metrics_and_no_collapse(overrides, tmp_path, name):
    train(
        None, overrides(tmp_path, "trainer.total_training_steps=4", *QUICK), preset=name, log=lambda _: None
    )
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "critic/score/mean" in r]
    assert len(records) == 4
    for r in records:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
        for key in OWN_METRICS[name]:
            assert key in r, f"{name}: {key} missing"
    scores = [r["critic/score/mean"] for r in records]
    # The warm-up model answers about 40% right when sampling; a broken update would drive it to 0.
    assert min(scores[-2:]) > 0.2, scores


@pytest.mark.parametrize(("target", "direction"), [(1e-6, 1), (10.0, -1)])
def test_adaptive_kl_coefficient_moves_towards_the_target(overrides, tmp_path, target, direction):
    # KL far above the target raises β; far below lowers it (the PPO-paper proportional controller).
    train(
        None,
        overrides(
            tmp_path,
            "trainer.total_training_steps=4",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_penalty=low_var_kl",  # k3 >= 0 on every batch, so the direction is certain
            f"algorithm.kl_ctrl.target_kl={target}",
            "algorithm.kl_ctrl.horizon=64",
            "algorithm.kl_ctrl.kl_coef=0.1",
            *QUICK,
        ),
        log=lambda _: None,
    )
    coeffs = [
        r["actor/reward_kl_penalty_coeff"]
        for r in read_metrics(tmp_path / "metrics.jsonl")
        if "actor/reward_kl_penalty_coeff" in r
    ]
    assert coeffs[0] == pytest.approx(0.1)
    steps = [b - a for a, b in itertools.pairwise(coeffs)]
    if direction > 0:
        # Step 1 has KL 0 to rounding (policy = reference), so β first falls, then rises as KL grows
        # (the checks compare the later coefficients only: they do not rely on step 1's rounding).
        assert coeffs[-1] > coeffs[1] and steps[-1] > 0
    else:
        assert all(s < 0 for s in steps)
