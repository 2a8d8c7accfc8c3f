"""Reward managers by name: naive, batch, prime, dapo, and reward-model scoring with rule scores."""

from __future__ import annotations

import pytest

from tearless.config.schema import OverlongBufferConfig, RewardModelConfig, RewardModelPathConfig
from tearless.rewards import ScoreResult
from tearless.rewards.manager import RewardManager
from tearless.rewards.managers import (
    BatchRewardManager,
    ModelRewardManager,
    OverlongPenaltyManager,
    make_reward_manager,
    reward_config_problems,
)

from .test_model import PROMPTS, save_tiny_reward_model, score_tol


def rm_config(*overrides: str) -> RewardModelConfig:
    """A ``reward_model`` section with dotted ``key=value`` overrides, as on the command line."""
    cfg = RewardModelConfig(model=RewardModelPathConfig(), overlong_buffer=OverlongBufferConfig())
    for override in overrides:
        key, value = override.removeprefix("reward_model.").split("=", 1)
        *parents, name = key.split(".")
        target = cfg
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, name, parse(value))
    return cfg


def parse(value: str):
    if value in ("true", "false"):
        return value == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def items(*answers, lengths=None):
    return [
        {
            "data_source": "arithmetic",
            "solution_str": a,
            "ground_truth": "85",
            "extra_info": {},
            "response_length": (lengths or [4] * len(answers))[i],
            "prompt": PROMPTS[i % len(PROMPTS)],
        }
        for i, a in enumerate(answers)
    ]


@pytest.mark.parametrize(
    ("name", "kind", "workers"), [("naive", RewardManager, 0), ("prime", RewardManager, 2)]
)
def test_naive_and_prime(name, kind, workers):
    with make_reward_manager(rm_config(f"reward_model.reward_manager={name}"), max_response_length=16) as m:
        assert isinstance(m, kind) and m.num_workers == workers
        assert [r.score for r in m.score(items("85", "84"))] == [1.0, 0.0]


def test_batch_calls_once_with_lists_and_defaults_to_the_builtin_scorers():
    calls = []

    def batch_fn(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
        calls.append(len(solution_strs))
        return [
            {"score": float(s == g) + bonus, "acc": s == g}
            for s, g in zip(solution_strs, ground_truths, strict=True)
        ]

    cfg = rm_config("reward_model.reward_manager=batch")
    with make_reward_manager(cfg, batch_fn, {"bonus": 0.5}, max_response_length=16) as m:
        assert m.score(items("85", "84", "85")) == [
            ScoreResult(1.5, {"acc": 1.0}),
            ScoreResult(0.5, {"acc": 0.0}),
            ScoreResult(1.5, {"acc": 1.0}),
        ]
    assert calls == [3]
    builtin = make_reward_manager(cfg, max_response_length=16)
    assert [r.score for r in builtin.score(items("85", "7"))] == [1.0, 0.0]


def test_batch_failures_and_signature_errors():
    def broken(data_sources, solution_strs, ground_truths, extra_infos):
        raise RuntimeError("scorer down")

    results = BatchRewardManager(broken, failure_score=-1.0).score(items("85", "84"))
    assert [r.score for r in results] == [-1.0, -1.0] and "scorer down" in results[0].error
    with pytest.raises(TypeError, match="reward_manager=batch needs a function"):
        BatchRewardManager(lambda data_source, solution_str, ground_truth, extra_info=None: 0.0)
    with pytest.raises(ValueError, match="returned 1 scores for 2 samples"):
        BatchRewardManager(lambda data_sources, solution_strs, ground_truths, extra_infos: [1.0]).score(
            items("a", "b")
        )


def test_dapo_overlong_penalty():
    # L_max = 16, buffer B = 4: no penalty up to 12 tokens, then -(L - 12) / 4 * factor.
    cfg = rm_config(
        "reward_model.reward_manager=dapo",
        "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=4",
        "reward_model.overlong_buffer.penalty_factor=2.0",
        "reward_model.overlong_buffer.log=true",
        "reward_model.num_workers=0",
    )
    with make_reward_manager(cfg, max_response_length=16) as m:
        assert isinstance(m, OverlongPenaltyManager)
        results = m.score(items("85", "85", "84", lengths=[12, 14, 16]))
    assert [r.score for r in results] == [1.0, 0.0, -2.0]
    assert [r.extra["overlong_reward"] for r in results] == [0.0, -1.0, -2.0]
    assert [r.extra["overlong"] for r in results] == [0.0, 1.0, 1.0]
    assert [r.extra["acc"] for r in results] == [1.0, 1.0, 0.0]  # correctness before the penalty
    with pytest.raises(ValueError, match="needs each item's response_length"):
        m.score([{k: v for k, v in items("85")[0].items() if k != "response_length"}])
    plain = make_reward_manager(rm_config("reward_model.reward_manager=dapo"), max_response_length=16)
    assert isinstance(plain, RewardManager)  # without the buffer, dapo scores like prime
    plain.close()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["reward_model.reward_manager=fancy"], "reward_model.reward_manager"),
        (
            ["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4"],
            "reward_model.overlong_buffer.enable",
        ),
        (
            ["reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true"],
            "reward_model.overlong_buffer.len",
        ),
        (
            [
                "reward_model.reward_manager=dapo",
                "reward_model.overlong_buffer.enable=true",
                "reward_model.overlong_buffer.len=32",
            ],
            "reward_model.overlong_buffer.len",
        ),
        (["reward_model.enable=true"], "reward_model.model.path"),
        (["reward_model.rule_weight=1.0"], "reward_model.rule_weight"),
    ],
)
def test_config_problems_name_the_key(overrides, key):
    problems = reward_config_problems(rm_config(*overrides), max_response_length=16)
    assert problems[0][0] == key
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        make_reward_manager(rm_config(*overrides), max_response_length=16)
    assert reward_config_problems(rm_config(), max_response_length=16) == []


def test_reward_model_alone_and_combined_with_rule_scores(tmp_path):
    path = save_tiny_reward_model(tmp_path)
    alone = make_reward_manager(
        rm_config("reward_model.enable=true", f"reward_model.model.path={path}"), max_response_length=16
    )
    assert isinstance(alone, ModelRewardManager) and alone.rule is None
    batch = items("85", "84")
    model_only = alone.score(batch)
    assert all(r.extra == {"rm_score": r.score} for r in model_only)
    combined = make_reward_manager(
        rm_config(
            "reward_model.enable=true",
            f"reward_model.model.path={path}",
            "reward_model.rule_weight=0.5",
            "reward_model.reward_manager=naive",
            "reward_model.micro_batch_size_per_gpu=1",
        ),
        max_response_length=16,
    )
    results = combined.score(batch)
    tol = score_tol(path)  # micro-batches of 1 against one batch: other padding, other sums
    for alone_result, result, rule in zip(model_only, results, [1.0, 0.0], strict=True):
        assert result.extra["rm_score"] == pytest.approx(alone_result.score, abs=tol)
        assert result.extra["rule_score"] == rule
        assert result.score == pytest.approx(alone_result.score + 0.5 * rule, abs=tol)
    with pytest.raises(ValueError, match="needs each item's prompt"):
        combined.score([{k: v for k, v in batch[0].items() if k != "prompt"}])
