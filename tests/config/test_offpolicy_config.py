"""The off-policy keys: nonsensical combinations are refused by name, sensible ones load."""

from __future__ import annotations

import pytest

from tearless.config import ConfigError, describe, load_config

RC = "algorithm.rollout_correction"


@pytest.mark.parametrize(
    "overrides,key,words",
    [
        ([f"{RC}.rollout_is_threshold_lower=0.5"], "rollout_is_threshold_lower", "rollout_is is null"),
        (
            [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold_lower=1.5"],
            "rollout_is_threshold_lower",
            "(0, 1]",
        ),
        ([f"{RC}.rollout_rs=token"], "rollout_rs_threshold", "must be set and > 1"),
        ([f"{RC}.rollout_rs=batch", f"{RC}.rollout_rs_threshold=2"], "rollout_rs", "geometric"),
        ([f"{RC}.rollout_rs_threshold=2"], "rollout_rs_threshold", "rollout_rs is null"),
        (
            [f"{RC}.rollout_rs=token", f"{RC}.rollout_rs_threshold=2", f"{RC}.rollout_rs_threshold_lower=1"],
            "rollout_rs_threshold_lower",
            "[0, 1)",
        ),
        ([f"{RC}.rollout_token_veto_threshold=2"], "rollout_token_veto_threshold", "(0, 1)"),
        ([f"{RC}.bypass_mode=true", f"{RC}.rollout_is=token"], "bypass_mode", "π_old/π_rollout = 1"),
        (["async_training.max_staleness=-1"], "async_training.max_staleness", ">= 0"),
        (
            ["async_training.partial_rollout=true"],
            "async_training.partial_rollout",
            "needs async_training.enable",
        ),
        (
            [
                "async_training.enable=true",
                "async_training.partial_rollout=true",
                "actor_rollout_ref.rollout.multi_turn.enable=true",
            ],
            "partial_rollout",
            "multi-turn",
        ),
    ],
)
def test_nonsensical_offpolicy_settings_are_refused_by_name(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert key in str(err.value) and words in str(err.value)


def test_sensible_offpolicy_settings_load_and_are_described():
    cfg = load_config(
        None,
        [
            "async_training.enable=true",
            "async_training.max_staleness=2",
            "async_training.partial_rollout=true",
            f"{RC}.rollout_is=token",
            f"{RC}.rollout_is_threshold_lower=0.5",
            f"{RC}.rollout_rs=geometric",
            f"{RC}.rollout_rs_threshold=1.001",
            f"{RC}.rollout_token_veto_threshold=1e-4",
        ],
    )
    assert (
        cfg.async_training.max_staleness == 2 and cfg.algorithm.rollout_correction.rollout_rs == "geometric"
    )
    text = describe()
    for key in ("async_training.max_staleness", f"{RC}.rollout_rs_threshold_lower", f"{RC}.bypass_mode"):
        assert key in text


def test_dynamic_sampling_and_remax_load_with_the_asynchronous_loop():
    # One source of batches serves both loops, so neither is refused with async_training any more.
    keys = [
        "async_training.enable=true",
        "algorithm.filter_groups.enable=true",
        "algorithm.adv_estimator=remax",
    ]
    cfg = load_config(None, keys)
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.adv_estimator == "remax"
