"""The chain_addition task: its teacher, its step verifier, its rows and its build."""

from __future__ import annotations

import math
import random

import pytest

from tearless.rewards import compute_score as dispatch
from tearless.tasks import chain_addition as ca


def test_worked_answer_and_the_flawed_teacher():
    assert ca.worked_lines([23, 58, 17]) == ["23+58=81", "81+17=98"]
    # forget_carry = 1: 3 + 8 carries, so 23 + 58 is written 71; 71 + 17 has no units carry (1 + 7).
    assert ca.worked_lines([23, 58, 17], random.Random(0), 1.0) == ["23+58=71", "71+17=88"]
    row = ca.to_row([23, 58, 17], "train", 0)
    assert row["prompt"] == [{"role": "user", "content": "23+58+17="}]
    assert row["reward_model"]["ground_truth"] == "98"
    assert ca.teacher(row, random.Random(0), 0.0) == "23+58=81\n81+17=98"


@pytest.mark.parametrize(
    ("response", "steps", "validity", "outcome"),
    [
        ("23+58=81\n81+17=98", [1.0, 1.0], 1.0, 1.0),
        # The dropped carry makes step 1 wrong; step 2 continues correctly from what was written.
        ("23+58=71\n71+17=88", [0.0, 1.0], 0.5, 0.0),
        # Step 2 adds the wrong operand, or continues from a sum that was not written.
        ("23+58=81\n81+71=152", [1.0, 0.0], 0.5, 0.0),
        ("23+58=81\n80+17=97", [1.0, 0.0], 0.5, 0.0),
        # A missing step counts as invalid in the validity; an unparsable line scores 0.
        ("23+58=81", [1.0], 0.5, 0.0),
        ("23+58=81\nso 98", [1.0, 0.0], 0.5, 0.0),
        # An extra line is not one of the expected steps: scored 0, validity unchanged.
        ("23+58=81\n81+17=98\n98+0=98", [1.0, 1.0, 0.0], 1.0, 1.0),
    ],
)
def test_steps_are_judged_each_on_its_own(response, steps, validity, outcome):
    result = ca.compute_score(response, "98", {"operands": [23, 58, 17]})
    assert result["step_scores"] == steps
    assert result["step_validity"] == validity
    assert result["score"] == result["acc"] == outcome
    assert result["step_ends"] == [i for i, ch in enumerate(response + "\n") if ch == "\n"]
    assert dispatch("chain_addition", response, "98", {"operands": [23, 58, 17]}) == result


def test_without_operands_only_the_outcome():
    assert ca.compute_score("1+2=3\n3+4=7", "7") == {"score": 1.0, "acc": 1.0}
    assert ca.compute_score("", "7", {"operands": [1, 2, 4]}) == {
        "score": 0.0,
        "acc": 0.0,
        "step_validity": 0.0,
    }


def test_rows_are_distinct_and_held_out_problems_stay_out_of_training():
    from tearless.tasks.bootstrap import TaskSpec

    train, val = ca.task_rows(TaskSpec(name="chain_addition", num_train=300, num_val=50))
    operands = [tuple(r["extra_info"]["operands"]) for r in train + val]
    assert len(set(operands)) == 350
    assert all(len(o) == ca.NUM_OPERANDS and all(0 <= x <= ca.MAX_OPERAND for x in o) for o in operands)
    assert all(int(r["reward_model"]["ground_truth"]) == sum(r["extra_info"]["operands"]) for r in train)


def test_build_writes_rows_a_model_and_a_round_tripping_tokenizer(tmp_path):
    from tearless.data import load_rows
    from tearless.models.loading import load_causal_lm, load_tokenizer
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.warmup import prepare_task

    spec = TaskSpec(
        name="chain_addition", num_train=40, num_val=10, warmup_steps=3, hidden_size=32, num_layers=1
    )
    files = prepare_task(spec, tmp_path, log=lambda _: None)
    train, _ = ca.task_rows(spec)
    assert [list(map(int, r["extra_info"]["operands"])) for r in load_rows(files.train_file)] == [
        r["extra_info"]["operands"] for r in train
    ]
    tok = load_tokenizer(files.model_dir)
    text = "23+58=81\n81+17=98"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert load_causal_lm(files.model_dir).config.hidden_size == 32


def test_config_asks_for_room_for_the_worked_answers():
    from tearless.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"task\.warmup_steps: 300 steps leave the chain_addition model"):
        load_config(None, ["task.name=chain_addition"])
    with pytest.raises(ConfigError, match=r"data\.max_response_length: 16 tokens cut off the chain_addition"):
        load_config(None, ["task.name=chain_addition", "task.warmup_steps=800"])
    cfg = load_config(
        None,
        [
            "task.name=chain_addition",
            "task.warmup_steps=800",
            f"data.max_response_length={ca.RESPONSE_TOKENS}",
        ],
    )
    assert cfg.task.name == "chain_addition"


def test_the_tiny_prm_is_trained_cached_and_read_by_the_scorer(tmp_path):
    from tearless.rewards.prm import ProcessRewardScorer
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.step_prm import prepare_prm
    from tearless.trainers.warmup import prepare_task

    spec = TaskSpec(
        name="chain_addition", num_train=24, num_val=8, warmup_steps=3, hidden_size=32, num_layers=1
    )
    files = prepare_task(spec, tmp_path, log=lambda _: None)
    logs: list[str] = []
    prm = prepare_prm(spec, files, tmp_path, samples_per_prompt=2, steps=3, log=logs.append)
    assert any("training the chain_addition task's process reward model" in line for line in logs)
    info = prm.info
    assert info["train_answers"] <= 48 and info["settings"]["steps"] == 3
    for key in ("held_out_step_accuracy", "held_out_bad_step_recall", "held_out_valid_share"):
        assert 0.0 <= info[key] <= 1.0
    logs.clear()
    assert prepare_prm(spec, files, tmp_path, samples_per_prompt=2, steps=3, log=logs.append) == prm
    assert logs == []  # cached
    scores, ends = ProcessRewardScorer(prm.model_dir).score(
        [[{"role": "user", "content": "23+58+17="}]], ["23+58=81\n81+17=98"]
    )[0]
    assert ends == (8, 17) and all(0.0 < p < 1.0 for p in scores)
    with pytest.raises(ValueError, match=r"made for task\.name=chain_addition, not 'arithmetic'"):
        prepare_prm(TaskSpec(), files, tmp_path)


def test_the_implicit_prm_is_trained_on_outcomes_and_scores_steps(tmp_path):
    from tearless.data import load_rows
    from tearless.rewards.prm import ProcessRewardScorer
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.step_prm import outcome_rows, prepare_implicit_prm
    from tearless.trainers.warmup import prepare_task

    spec = TaskSpec(
        name="chain_addition", num_train=24, num_val=8, warmup_steps=3, hidden_size=32, num_layers=1
    )
    files = prepare_task(spec, tmp_path, log=lambda _: None)
    from tearless.models.loading import load_causal_lm, load_tokenizer

    rows = outcome_rows(
        load_causal_lm(files.model_dir),
        load_tokenizer(files.model_dir),
        load_rows(files.val_file)[:3],
        samples_per_prompt=2,
        seed=0,
    )
    assert len(rows) == 6
    for row in rows:  # the label is the verifier's outcome
        assert row["label"] == (
            ca.compute_score(row["completion"], row["reward_model"]["ground_truth"])["acc"] == 1.0
        )
    prm = prepare_implicit_prm(spec, files, tmp_path, log=lambda _: None)
    assert "val/loss" in prm.info["held_out_after"]
    scorer = ProcessRewardScorer(prm.model_dir, kind="implicit", ref_path=files.model_dir, beta=0.5)
    ((scores, ends),) = scorer.score([[{"role": "user", "content": "23+58+17="}]], ["23+58=81\n81+17=98"])
    assert ends == (8, 17) and len(scores) == 2 and all(math.isfinite(s) for s in scores)
