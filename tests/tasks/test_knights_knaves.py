"""Knights and knaves: the solver, unique-solution puzzles and Logic-RL's reward values."""

from __future__ import annotations

import itertools
import random

import pytest

from tearless.rewards import compute_score
from tearless.tasks.knights_knaves import (
    generate_rows,
    holds,
    make_puzzle,
    parse_ground_truth,
    parse_roles,
    render_statement,
    solution_text,
    solve,
)

TRUTH = "(1) Zoey is a knave\n(2) Oliver is a knight"


def test_solver_on_a_classic():
    # Zoey: "Oliver is a knave." Oliver: "Zoey and I are different kinds."
    # If Oliver were a knave, his claim is false, so both are knaves, and then Zoey's claim
    # ("Oliver is a knave") is true: contradiction. So Oliver is a knight and Zoey a knave.
    zoey = ("knave", 1)
    oliver = ("<->", ("knight", 0), ("knave", 1))
    assert solve([zoey, oliver]) == [(False, True)]
    assert solve([("knight", 0), ("knight", 1)]) == list(itertools.product((True, False), repeat=2))
    assert solve([("knave", 0)]) == []  # "I am a knave" has no solution


def test_holds_truth_tables():
    a, b = ("knight", 0), ("knight", 1)
    for x, y in itertools.product((True, False), repeat=2):
        knights = (x, y)
        assert holds(("->", a, b), knights) == ((not x) or y)
        assert holds(("<->", a, b), knights) == (x == y)
        assert holds(("not", ("and", a, b)), knights) == (not (x and y))
        assert holds(("or", ("knave", 0), b), knights) == ((not x) or y)


def test_rendering_is_unambiguous():
    names = ["Zoey", "Oliver", "Mia"]
    statement = ("or", ("and", ("knight", 0), ("knave", 1)), ("not", ("knight", 2)))
    assert render_statement(statement, names) == (
        "(Zoey is a knight and Oliver is a knave) or (it is not the case that Mia is a knight)"
    )


@pytest.mark.parametrize("num_people", [2, 3, 5, 8])
def test_generated_puzzles_have_exactly_one_solution(num_people):
    rows = generate_rows(15, seed=num_people, split="test", num_people=num_people)
    assert rows == generate_rows(15, seed=num_people, split="test", num_people=num_people)
    for row in rows:
        truth = parse_ground_truth(row["reward_model"]["ground_truth"])
        assert len(truth) == num_people
        text = row["prompt"][1]["content"]
        assert all(name in text for name in truth) and text.endswith("who is a knave?")
    rng = random.Random(num_people)
    for _ in range(20):
        puzzle = make_puzzle(rng, num_people)
        assert solve(puzzle["statements"]) == [tuple(puzzle["solution"])]
        assert all(s != ("knave", i) for i, s in enumerate(puzzle["statements"]))


@pytest.mark.parametrize("source", ["knights_knaves", "kk_logic"])
@pytest.mark.parametrize(
    ("response", "total", "acc"),
    [
        ("<think>Zoey lies.</think><answer>(1) Zoey is a knave (2) Oliver is a knight</answer>", 3.0, 1.0),
        ("<think>...</think>\n<answer>\nOliver is a knight.\nZoey is a knave.\n</answer>", 3.0, 1.0),
        ("<think>x</think><answer>(1) ZOEY is a KNAVE (2) oliver is a knight</answer>", 3.0, 1.0),
        ("<think>x</think><answer>(1) Zoey is a knight (2) Oliver is a knight</answer>", -0.5, 0.0),
        ("<think>x</think><answer>Zoey is a knave</answer>", -1.0, 0.0),  # Oliver missing
        ("<think>x</think><answer>Zoey is not a knight but a knave; Oliver is a knight</answer>", -1.0, 0.0),
        ("<think>x</think><answer>Zoey and Oliver are knights</answer>", -1.0, 0.0),
        ("<answer>(1) Zoey is a knave (2) Oliver is a knight</answer>", -3.0, 0.0),  # no think
        ("<think>x</think><answer>(1) Zoey is a knave (2) Oliver is a knight", -3.0, 0.0),  # unclosed
        ("<think>a</think><think>b</think><answer>Zoey is a knave, Oliver is a knight</answer>", -3.0, 0.0),
        ("The answer: Zoey is a knave, Oliver is a knight.", -3.0, 0.0),
    ],
)
def test_logic_rl_reward_values(source, response, total, acc):
    result = compute_score(source, response, TRUTH)
    assert result["score"] == total
    assert result["acc"] == acc
    assert result["format"] + result["answer"] == total


def test_reward_values_are_keyword_arguments_and_long_outputs_work():
    right = (
        "<think>" + "Let me consider Zoey… " * 3000 + "</think><answer>Zoey: knave, Oliver: knight</answer>"
    )
    binary = dict(
        format_reward=0.0, format_penalty=0.0, correct_reward=1.0, wrong_penalty=0.0, unreadable_penalty=0.0
    )
    assert compute_score("knights_knaves", right, TRUTH, None, **binary)["score"] == 1.0
    assert compute_score("knights_knaves", right, TRUTH)["score"] == 3.0


def test_parsers():
    assert parse_ground_truth(solution_text(["Mia", "Leo"], [True, False])) == {"Mia": True, "Leo": False}
    assert parse_roles("Mia is a knight, Leo is a knave", ["Mia", "Leo"]) == {"Mia": True, "Leo": False}
    assert parse_roles("Ann is a knight, Anna is a knave", ["Ann", "Anna"]) == {"Ann": True, "Anna": False}
    with pytest.raises(ValueError, match="knights-and-knaves ground truth"):
        parse_ground_truth("Zoey: knave")
