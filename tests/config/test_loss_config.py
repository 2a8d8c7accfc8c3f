"""The actor's loss keys: veRL's policy_loss.* knobs are settable by their veRL names, reach the loss,
and every combination that could not apply is refused with the key and the fix."""

from __future__ import annotations

import pytest

from tearless.config import ConfigError, describe, load_config
from tearless.config.derived import loss_scale_factor, policy_loss_knobs
from tests.config.test_config import fails

A = "actor_rollout_ref.actor"


def test_verl_policy_loss_keys_are_settable_and_reach_the_loss():
    cfg = load_config(
        None,
        [
            f"{A}.policy_loss.loss_mode=kl_cov",
            f"{A}.policy_loss.ppo_kl_coef=0.5",
            f"{A}.policy_loss.kl_cov_ratio=0.01",
            f"{A}.policy_loss.clip_cov_ratio=0.001",
            f"{A}.policy_loss.clip_cov_lb=0.5",
            f"{A}.policy_loss.clip_cov_ub=3.0",
            f"{A}.policy_loss.dro_beta=0.2",
            f"{A}.tau_pos=1.5",
            f"{A}.tau_neg=2.0",
        ],
    )
    assert policy_loss_knobs(cfg.actor_rollout_ref.actor) == {
        "ppo_kl_coef": 0.5,
        "kl_cov_ratio": 0.01,
        "clip_cov_ratio": 0.001,
        "clip_cov_lb": 0.5,
        "clip_cov_ub": 3.0,
        "dro_beta": 0.2,
        "tau_pos": 1.5,
        "tau_neg": 2.0,
    }


def test_defaults_are_verls():
    actor = load_config().actor_rollout_ref.actor
    assert (actor.policy_loss.ppo_kl_coef, actor.policy_loss.kl_cov_ratio) == (0.1, 2e-4)
    assert (
        actor.policy_loss.clip_cov_ratio,
        actor.policy_loss.clip_cov_lb,
        actor.policy_loss.clip_cov_ub,
    ) == (
        2e-4,
        1.0,
        5.0,
    )
    assert (actor.tau_pos, actor.tau_neg, actor.policy_loss.dro_beta) == (1.0, 1.05, None)


@pytest.mark.parametrize("mode", ["geo_mean", "gpg", "sapo", "dro", "dppo_tv", "dppo_kl"])
def test_new_modes_are_listed_by_config_show(mode):
    line = next(x for x in describe().splitlines() if x.startswith(f"{A}.policy_loss.loss_mode"))
    help_line = describe().split(line, 1)[1].splitlines()[1]
    assert mode in help_line


def test_the_normaliser_is_the_response_cap_unless_set():
    assert loss_scale_factor(load_config()) == 16.0  # data.max_response_length
    assert loss_scale_factor(load_config(None, ["actor_rollout_ref.rollout.response_length=12"])) == 12.0
    assert loss_scale_factor(load_config(None, [f"{A}.loss_scale_factor=100"])) == 100.0


@pytest.mark.parametrize("mode", ["sapo", "geo_mean"])
def test_a_mode_with_its_own_aggregation_refuses_another_explicit_one(mode):
    msg = fails(f"{A}.policy_loss.loss_mode={mode}", f"{A}.loss_agg_mode=token-mean")
    assert (
        msg.startswith(f"{A}.loss_agg_mode:")
        and "seq-mean-token-mean" in msg
        and "Remove loss_agg_mode" in msg
    )
    # Unset (null) or naming the mode's own is accepted.
    load_config(None, [f"{A}.policy_loss.loss_mode={mode}"])
    load_config(None, [f"{A}.policy_loss.loss_mode={mode}", f"{A}.loss_agg_mode=seq-mean-token-mean"])


@pytest.mark.parametrize(
    "agg", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_gspo_takes_every_loss_agg_mode_as_verl_091(agg):
    cfg = load_config(None, [f"{A}.policy_loss.loss_mode=gspo", f"{A}.loss_agg_mode={agg}"])
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == agg


def test_the_gspo_preset_keeps_the_papers_aggregation():
    actor = load_config(None, preset="gspo").actor_rollout_ref.actor
    assert (actor.policy_loss.loss_mode, actor.loss_agg_mode) == ("gspo", "seq-mean-token-mean")


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        ([f"{A}.policy_loss.loss_mode=dro"], f"{A}.policy_loss.dro_beta", "needs the coefficient"),
        ([f"{A}.policy_loss.dro_beta=0"], f"{A}.policy_loss.dro_beta", "> 0"),
        ([f"{A}.policy_loss.kl_cov_ratio=0"], f"{A}.policy_loss.kl_cov_ratio", "> 0"),
        ([f"{A}.policy_loss.clip_cov_ratio=2"], f"{A}.policy_loss.clip_cov_ratio", "fraction"),
        ([f"{A}.policy_loss.clip_cov_lb=5"], f"{A}.policy_loss.clip_cov_ub", "above clip_cov_lb"),
        ([f"{A}.policy_loss.ppo_kl_coef=-1"], f"{A}.policy_loss.ppo_kl_coef", ">= 0"),
        ([f"{A}.tau_neg=0"], f"{A}.tau_neg", "> 0"),
        ([f"{A}.loss_scale_factor=0"], f"{A}.loss_scale_factor", "> 0"),
        (["critic.loss_scale_factor=-3"], "critic.loss_scale_factor", "> 0"),
        ([f"{A}.loss_agg_mode=mean"], f"{A}.loss_agg_mode", "seq-mean-token-sum-norm"),
    ],
)
def test_bad_loss_keys_name_the_key(overrides, key, words):
    msg = fails(*overrides)
    assert msg.startswith(f"{key}:") and words in msg


def test_sapo_tau_under_policy_loss_points_at_the_actor_key():
    # veRL's SAPO README writes policy_loss.tau_pos; its code (and tearless) read actor.tau_pos.
    with pytest.raises(ConfigError, match=f"Did you mean {A}.tau_pos"):
        load_config(None, [f"+{A}.policy_loss.tau_pos=1.0"])
