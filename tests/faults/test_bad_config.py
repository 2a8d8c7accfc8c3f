"""Random bad configs: always one ConfigError naming a real key, before anything heavy starts.

Each example sets one key of the schema (or an unknown one) to a value drawn from every kind a user
can type: negative, zero and huge numbers, NaN and infinities, strings, booleans, null, lists and
dicts, given as a dict layer or as a ``key=value`` override. The config is either refused with a
:class:`ConfigError` whose message names a key of the schema, or accepted; an accepted config must
hold only finite numbers, and everything the trainer builds from the numbers alone (AdamW, the
learning-rate schedule over the whole run, the KL controller) must build, so no run starts and then
dies on a value the validation could have seen.
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tearless.algos import make_kl_controller
from tearless.config import ConfigError, load_config
from tearless.config.derived import critic_enabled
from tearless.config.schema import all_keys
from tearless.config.validate_ranges import _numbers
from tearless.workers.optim import lr_lambda, make_optimizer

KEYS = [k for k, _ in all_keys()]
SECTIONS = sorted({k.rsplit(".", 1)[0] for k in KEYS if "." in k})
_identifier = st.from_regex(r"[a-z][a-z_]{0,12}", fullmatch=True)
_scalar = st.one_of(
    st.integers(min_value=-(2**40), max_value=2**40),
    st.sampled_from([0, 1, -1, 2, 3, 7, 2**31, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.5, 1.0, 1.5, -0.5, 1e-12, 1e300]),
    st.text(max_size=12),
    st.booleans(),
    st.none(),
)
_value = st.one_of(_scalar, st.lists(_scalar, max_size=3), st.dictionaries(_identifier, _scalar, max_size=2))
# A config load costs ~0.1 s (OmegaConf), so CI draws a few dozen; RELIABILITY.md's figures come from
# TEARLESS_FUZZ_EXAMPLES=1000.
EXAMPLES = int(os.environ.get("TEARLESS_FUZZ_EXAMPLES", "40"))
_QUIET = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _nested(key: str, value):
    layer: dict = {}
    here = layer
    *parents, last = key.split(".")
    for part in parents:
        here = here.setdefault(part, {})
    here[last] = value
    return layer


def _override(key: str, value) -> str:
    if isinstance(value, str):
        return f"{key}={value}"
    text = (
        repr(value).replace("'", "").replace("None", "null").replace("True", "true").replace("False", "false")
    )
    return f"{key}={text}"


def _names_a_key(message: str) -> bool:
    return any(key in message for key in KEYS) or bool(re.search(r"unknown config key '[^']+'", message))


def _check_accepted(cfg) -> None:
    for key, value in _numbers(cfg):
        assert math.isfinite(value), key
    actor = cfg.actor_rollout_ref.actor
    total = cfg.trainer.total_training_steps or 100
    for optim in (actor.optim, cfg.critic.optim) if critic_enabled(cfg) else (actor.optim,):
        make_optimizer([torch.nn.Parameter(torch.zeros(2))], optim, total)
        warmup = (
            optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(optim.lr_warmup_steps_ratio * total)
        )
        f = lr_lambda(total, warmup, optim.lr_scheduler_type, optim.min_lr_ratio, optim.num_cycles)
        assert all(math.isfinite(f(s)) and f(s) >= 0 for s in range(0, total + 1, max(1, total // 50)))
    kl = cfg.algorithm.kl_ctrl
    make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon).update(0.1, n_steps=8)


@_QUIET
@given(key=st.sampled_from(KEYS), value=_value, as_override=st.booleans())
def test_any_value_for_any_key_is_accepted_sanely_or_refused_naming_a_key(key, value, as_override):
    try:
        cfg = load_config(None, [_override(key, value)]) if as_override else load_config(_nested(key, value))
    except ConfigError as e:
        message = str(e)
        assert _names_a_key(message) or message.startswith("override "), message
        assert len(message) < 1500 and "Traceback" not in message
        return
    _check_accepted(cfg)


@settings(_QUIET, max_examples=max(10, EXAMPLES // 4))
@given(section=st.sampled_from(["", *SECTIONS]), name=_identifier, value=_scalar)
def test_an_unknown_key_anywhere_is_refused_naming_it(section, name, value):
    key = f"{section}.{name}" if section else name
    if key in KEYS or key in SECTIONS or any(k.startswith(key + ".") for k in KEYS):
        return
    for attempt in (lambda: load_config(_nested(key, value)), lambda: load_config(None, [f"{key}=1"])):
        with pytest.raises(ConfigError, match=rf"unknown config key '{re.escape(key)}'"):
            attempt()


@pytest.mark.parametrize(
    ("config", "key", "words"),
    [
        ({"actor_rollout_ref": {"actor": {"optim": {"lr": float("nan")}}}}, "actor.optim.lr", "finite"),
        ({"reward_model": {"failure_score": float("-inf")}}, "reward_model.failure_score", "finite"),
        ({"actor_rollout_ref": {"actor": {"optim": {"betas": [0.9]}}}}, "actor.optim.betas", "two numbers"),
        (
            {"actor_rollout_ref": {"actor": {"optim": {"betas": [0.9, 1.0]}}}},
            "actor.optim.betas",
            "[0.0, 1.0)",
        ),
        ({"actor_rollout_ref": {"actor": {"optim": {"weight_decay": -0.1}}}}, "weight_decay", ">= 0"),
        ({"actor_rollout_ref": {"actor": {"optim": {"min_lr_ratio": 2.0}}}}, "min_lr_ratio", "[0.0, 1.0]"),
        ({"actor_rollout_ref": {"actor": {"clip_ratio": -0.2}}}, "actor.clip_ratio", ">= 0"),
        ({"algorithm": {"gamma": 1.5}}, "algorithm.gamma", "[0.0, 1.0]"),
        ({"algorithm": {"kl_ctrl": {"type": "adaptive", "horizon": 0}}}, "kl_ctrl.horizon", "> 0"),
        ({"actor_rollout_ref": {"rollout": {"val_kwargs": {"top_p": 0.0}}}}, "val_kwargs.top_p", "(0, 1]"),
        ({"actor_rollout_ref": {"rollout": {"top_k": -5}}}, "rollout.top_k", "-1"),
        ({"trainer": {"logger": {"console": True}}}, "trainer.logger", "must be a list"),
        ({"trainer": [1, 2]}, "'trainer'", "must be a section"),
        ({"custom_reward_function": {"reward_kwargs": [1]}}, "reward_kwargs", "must be a section"),
        ({"trainer": {"max_bad_steps": -1}}, "trainer.max_bad_steps", ">= 0"),
        ({"critic": {"enable": True, "optim": {"betas": [1.5, 0.9]}}}, "critic.optim.betas", "[0.0, 1.0)"),
    ],
)
def test_values_the_trainer_would_trip_over_later_are_refused_now(config, key, words):
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert key in str(info.value) and words in str(info.value), str(info.value)
