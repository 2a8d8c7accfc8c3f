"""Countdown: the equation checker (never eval), the reward values and the generator."""

from __future__ import annotations

import json
import random

import pytest

from tearless.rewards import compute_score
from tearless.tasks import countdown
from tearless.tasks.countdown import InvalidEquation, evaluate, generate_rows, literals, parse_equation

TRUTH = {"target": 104, "numbers": [43, 2, 95]}


def respond(equation: str) -> str:
    return f"<think>95 - 43 = 52, 52 * 2 = 104</think>\n<answer>{equation}</answer>"


@pytest.mark.parametrize(
    ("response", "score"),
    [
        (respond("(95 - 43) * 2"), 1.0),
        (respond("2 * (95 - 43)"), 1.0),
        (respond("(95 − 43) × 2"), 1.0),  # unicode operators
        (respond("(95 - 43) * 2 = 104"), 1.0),
        (respond("(95 - 43) * 2 = 105"), 0.1),  # a false claim
        (respond("95 + 43 + 2"), 0.1),  # valid, wrong value
        (respond("(95 - 43) * 2 + 0"), 0.1),  # a number that was not given
        (respond("(95 - 43) * 2 * 1"), 0.1),
        (respond("95 - 43 * 2 + 2"), 0.1),  # 2 used twice
        (respond("(95 - 43)"), 0.1),  # 2 unused
        (respond("(95 - 43) ** 2"), 0.1),  # power is not allowed
        (respond("-(43 - 95) * 2"), 0.1),  # unary minus is not allowed
        (respond("(95.0 - 43) * 2"), 0.1),  # floats are not literals of the game
        (respond("__import__('os').system('echo hi')"), 0.1),  # code is rejected, never run
        (respond("(95 - 43) * 2 / (2 - 2)"), 0.1),
        ("<think>hm</think> (95 - 43) * 2", 0.0),  # no answer tag
        ("<answer>(95 - 43) * 2</answer> but really <answer>95 + 43</answer>", 0.1),  # the last tag
    ],
)
def test_countdown_scores(response, score):
    result = compute_score("countdown", response, TRUTH)
    assert result["score"] == score
    assert result["acc"] == float(score == 1.0)


def test_exact_fractions_and_ground_truth_as_json():
    # 8 / (3 - 8 / 3) = 24 only in exact arithmetic (floats give 23.999…).
    truth = json.dumps({"target": 24, "numbers": [8, 3, 8, 3]})
    assert compute_score("countdown", "<answer>8 / (3 - 8 / 3)</answer>", truth)["acc"] == 1.0
    assert compute_score("countdown", "<answer>8/(3-8/3)</answer>", truth, None, score=2.0)["score"] == 2.0


def test_parser_limits():
    tree = parse_equation("((1 + 2) * 3) / 4")
    assert literals(tree) == [4, 3, 1, 2] or sorted(literals(tree)) == [1, 2, 3, 4]
    assert evaluate(tree) == pytest.approx(9 / 4)
    for bad in [
        "",
        "1 +",
        "x + 1",
        "abs(1)",
        "1 if 1 else 2",
        "[1]",
        "1; 2",
        "True + 1",
        "(" * 200 + "1" + ")" * 200,
    ]:
        with pytest.raises(InvalidEquation):
            parse_equation(bad)


def test_generator_problems_are_solvable_distinct_and_seeded():
    rows = generate_rows(200, seed=7, split="train")
    assert rows == generate_rows(200, seed=7, split="train")
    keys = {
        (
            tuple(sorted(r["reward_model"]["ground_truth"]["numbers"])),
            r["reward_model"]["ground_truth"]["target"],
        )
        for r in rows
    }
    assert len(keys) == 200
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        assert len(truth["numbers"]) in (3, 4) and 1 <= truth["target"] <= 100
        witness = respond(row["extra_info"]["solution"])
        assert compute_score(row["data_source"], witness, truth)["acc"] == 1.0
        assert str(truth["numbers"]) in row["prompt"][0]["content"]


def test_make_problem_keeps_intermediate_results_positive_integers():
    rng = random.Random(0)
    for _ in range(100):
        problem = countdown.make_problem(rng, 4)
        assert evaluate(parse_equation(problem["solution"])) == problem["target"]
