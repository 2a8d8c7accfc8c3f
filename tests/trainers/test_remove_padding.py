"""``use_remove_padding=True`` end to end: a 4-step PPO run (actor, reference KL and critic, all
packed, in token-budget micro-batches) lands on the weights of the padded run."""

from __future__ import annotations

import importlib

import pytest

from tearless import train
from tests.distributed.test_ray_fsdp import PPO, assert_same_steps, common

PACKED = (
    "actor_rollout_ref.model.use_remove_padding=true",
    "critic.model.use_remove_padding=true",
)
# 80 tokens (the least the validator allows: max_prompt_length + max_response_length) hold a few of
# the run's sequences of ~15-30 tokens: uneven micro-batches, each packed into one row.
DYNAMIC = (
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=80",
)


@pytest.fixture(scope="module")
def ppo_runs(overrides, tmp_path_factory):
    padded = tmp_path_factory.mktemp("ppo-padded")
    train(None, common(overrides, padded, *PPO), log=lambda _: None)
    packed = tmp_path_factory.mktemp("ppo-packed")
    calls = {"logprobs": 0, "value": 0}
    with pytest.MonkeyPatch.context() as mp:
        for name in calls:  # count the packed forwards, so that a silent fallback to padding shows
            module = importlib.import_module(f"tearless.models.{name}")

            def counting(*args, _name=name, _pack=module.pack_rows, **kwargs):
                calls[_name] += 1
                return _pack(*args, **kwargs)

            mp.setattr(module, "pack_rows", counting)
        train(None, common(overrides, packed, *PPO, *PACKED, *DYNAMIC), log=lambda _: None)
    return padded, packed, calls


def test_a_packed_ppo_run_with_dynamic_batches_matches_the_padded_run(ppo_runs, task):
    # Same rollouts (the sampler does not pack), losses and metrics to the update's rounding, and the
    # actor's and critic's weights after 4 steps × 2 mini-batches × 2 epochs within tolerance.
    padded, packed, calls = ppo_runs
    assert calls["logprobs"] > 0 and calls["value"] > 0, calls
    assert_same_steps(
        padded, packed, range(1, 5), task.model_dir, optimizer_steps_per_step=4, roles=("actor", "critic")
    )
