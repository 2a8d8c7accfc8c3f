"""Real training runs (one process) with an environment from a user's file and with an agent program
through the endpoint: the RL step and validation run the loops, the environment's reward is the
score, a failing environment costs its episodes (counted) and the run goes on; bad keys fail early.
(Learning is measured in BENCHMARKS.md: the commands in docs/environments.md.)"""

from __future__ import annotations

import pytest

from tearless import train
from tearless.config.load import ConfigError
from tearless.run.tracking import read_metrics

pytestmark = pytest.mark.slow

ENV = """
from tearless.envs import Step

class Flaky:
    built = 0

    def __init__(self):
        Flaky.built += 1
        self.number = Flaky.built

    def reset(self, row):
        self.answer = row["ground_truth"]
        if self.number % 4 == 0:  # every fourth episode: 4 of each step's 16
            raise RuntimeError("cannot load this level")
        return row["prompt"]

    def step(self, turn):
        right = turn["content"].strip() == self.answer
        return Step("no", reward=float(right), done=right, info={"success": right})
"""


@pytest.fixture
def env_overrides(overrides, tmp_path):
    """``env_overrides(*extra)``: the suite's small config on the session task, run in
    ``tmp_path / "run"``, with 4 prompts × 4 episodes of at most 2 turns and 8 held-out prompts."""

    def make(*extra):
        return overrides(
            tmp_path / "run",
            "trainer.total_training_steps=2",
            "data.train_batch_size=4",
            "data.max_response_length=40",
            "data.val_max_samples=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.val_kwargs.n=2",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
            *extra,
        )

    return make


def test_a_user_environment_trains_and_its_failures_are_counted(env_overrides, tmp_path):
    (tmp_path / "flaky.py").write_text(ENV)
    summary = train(
        None,
        env_overrides(f"actor_rollout_ref.rollout.multi_turn.env={tmp_path / 'flaky.py'}:Flaky"),
        log=lambda _: None,
    )
    assert "val-core/arithmetic/acc/greedy" in summary["after"]
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "critic/score/mean" in r]
    assert len(records) == 2
    for r in records:
        assert r["reward_extra/env_failed/mean"] == 0.25 and r["reward/failures"] == 4.0
        # The 12 live episodes take 1 or 2 turns, the 4 failed ones none.
        assert 12 / 16 <= r["multi_turn/num_turns/mean"] <= 24 / 16
        assert 0.0 <= r["critic/score/mean"] <= 0.75


def test_an_agent_program_trains_through_the_endpoint(env_overrides, tmp_path):
    pytest.importorskip("openai")
    summary = train(
        None,
        env_overrides("actor_rollout_ref.rollout.multi_turn.agent=examples/envs/check_agent.py:agent"),
        log=lambda _: None,
    )
    assert "val-core/arithmetic/acc/greedy" in summary["after"]
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "critic/score/mean" in r]
    assert len(records) == 2
    for r in records:
        assert r["multi_turn/num_turns/mean"] == 2.0  # two calls per episode
        assert r["reward_extra/env_failed/mean"] == 0.0
        assert r["reward_extra/agent_unmerged_calls/mean"] == 0.0  # both calls in one trajectory


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["actor_rollout_ref.rollout.multi_turn.env=nope"], "multi_turn.env='nope': unknown name"),
        (["actor_rollout_ref.rollout.multi_turn.agent=missing.py:agent"], "missing.py is not a file"),
        (["actor_rollout_ref.rollout.multi_turn.tool_family=gpt"], "tool_family: 'gpt' is not one of"),
        (
            [
                "actor_rollout_ref.rollout.multi_turn.env=tools",
                "actor_rollout_ref.rollout.multi_turn.agent=a:b",
            ],
            "multi_turn.agent: is set together with multi_turn.env",
        ),
    ],
)
def test_bad_keys_fail_before_anything_loads(env_overrides, extra, message):
    with pytest.raises(ConfigError, match=message):
        train(None, env_overrides(*extra), log=lambda _: None)


def test_an_environment_runs_one_step_off(env_overrides, tmp_path):
    """The environment loop generates inside the asynchronous generation calls: the second step
    trains on first-version episodes with their behaviour log-probs."""
    (tmp_path / "flaky.py").write_text(ENV)
    train(
        None,
        env_overrides(
            f"actor_rollout_ref.rollout.multi_turn.env={tmp_path / 'flaky.py'}:Flaky",
            "async_training.enable=true",
            "async_training.max_staleness=1",
            "algorithm.rollout_correction.rollout_is=token",
            "trainer.val_before_train=false",
        ),
        log=lambda _: None,
    )
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    records = [r for r in records if "async/staleness_max" in r]
    assert [r["async/staleness_max"] for r in records] == [0, 1]
    assert all("rollout_corr/is_weight_mean" in r and "reward_extra/env_failed/mean" in r for r in records)
