"""The same config gives the same run: every random choice comes from trainer.seed."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tearless import train
from tearless.run.tracking import read_metrics

pytestmark = pytest.mark.slow

SETTINGS = (
    "trainer.total_training_steps=3",
    "actor_rollout_ref.actor.ppo_epochs=2",  # PPO epochs with shuffling draw from the update generator
    "actor_rollout_ref.actor.shuffle=true",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "data.val_max_samples=16",
)


def comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in records]


def test_the_same_config_twice_gives_identical_metrics_samples_and_weights(overrides, tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    train(None, overrides(a, *SETTINGS), log=lambda _: None)
    train(None, overrides(b, *SETTINGS), log=lambda _: None)
    ma, mb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert [r["step"] for r in ma] == [0, 1, 2, 3]
    assert comparable(ma) == comparable(mb)
    assert (a / "rollouts.jsonl.gz").read_bytes() == (b / "rollouts.jsonl.gz").read_bytes()
    wa = load_file(a / "global_step_3" / "actor" / "model.safetensors")
    wb = load_file(b / "global_step_3" / "actor" / "model.safetensors")
    assert all(wa[k].equal(wb[k]) for k in wa)
    # The off-policy epochs really ran (4 optimizer steps: 2 mini-batches × 2 epochs) and clipped.
    assert all(r["actor/num_optimizer_steps"] == 4 for r in ma[1:])
    assert any(r["actor/ppo_kl"] != 0 for r in ma[1:])

    # Another seed is another run.
    train(None, overrides(c, *SETTINGS, "trainer.seed=2"), log=lambda _: None)
    mc = read_metrics(c / "metrics.jsonl")
    assert comparable(mc)[1:] != comparable(ma)[1:]
