"""reasoning-gym's tasks as rows (``tearless data make reasoning_gym:<task>``) and their scorer."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from tearless.data.rows import DataError
from tearless.rewards import compute_score
from tearless.tasks.make import make_rows, make_task

pytest.importorskip("reasoning_gym", reason="the adapter's tests need reasoning-gym (tearless[agents])")

ADDITION = {
    "operators": ["+"],
    "min_terms": 2,
    "max_terms": 2,
    "allow_parentheses": False,
    "allow_negation": False,
}


def test_rows_split_apart_and_score_with_the_tasks_own_scorer(tmp_path):
    rows = make_rows("reasoning_gym:basic_arithmetic", num_train=40, num_test=10, seed=3, config=ADDITION)
    train, test = rows["train"], rows["test"]
    assert len(train) == 40 and len(test) == 10
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    row = test[0]
    assert row["data_source"] == "reasoning_gym/basic_arithmetic"
    question = row["prompt"][0]["content"]  # e.g. "Calculate 5 + 33."
    a, b = (int(x) for x in question.removeprefix("Calculate ").rstrip(".").split(" + "))
    truth = row["reward_model"]["ground_truth"]
    assert truth == str(a + b)
    entry = json.loads(row["extra_info"]["reasoning_gym_entry"])
    assert entry["question"] == question
    score = lambda text: compute_score(row["data_source"], text, truth, row["extra_info"])  # noqa: E731
    assert score(truth) == 1.0
    assert score(f"I add them. <answer>{truth}</answer>") == 1.0
    assert score(str(a + b + 1)) == 0.0
    assert score("no idea") == 0.0
    # The same seed writes the same files; they read back as the rows.
    paths = make_task(
        "reasoning_gym:basic_arithmetic", tmp_path, num_train=40, num_test=10, seed=3, config=ADDITION
    )
    assert [r["prompt"] for r in pq.read_table(paths["test"]).to_pylist()] == [r["prompt"] for r in test]


def test_bad_tasks_and_configs_are_one_line_errors():
    with pytest.raises(DataError, match="reasoning_gym:no_such_task"):
        make_rows("reasoning_gym:no_such_task", num_train=2, num_test=2, seed=0)
    with pytest.raises(DataError, match=r"only \d+ training questions differ"):
        make_rows(
            "reasoning_gym:basic_arithmetic",
            num_train=2000,  # one-digit sums: 100 questions, most of them drawn for the 200 test rows
            num_test=200,
            seed=0,
            config={**ADDITION, "min_digits": 1, "max_digits": 1},
        )
    with pytest.raises(DataError, match="--config applies to reasoning_gym"):
        make_rows("arithmetic", num_train=2, num_test=2, seed=0, config={"a": 1})
    with pytest.raises(ValueError, match=r"extra_info\.reasoning_gym_task"):
        compute_score("reasoning_gym/basic_arithmetic", "3", "3", {})
