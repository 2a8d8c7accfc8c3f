"""The embedded arithmetic task: its reward, its generator and its flawed teacher."""

from __future__ import annotations

import math
import random

import pytest

from tearless.tasks import arithmetic
from tearless.tasks.arithmetic import compute_score, extract_answer


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("7+8=15, 85", 85, 1.0),  # the worked format: the answer is after the last comma
        ("7+8=15, 85", "85", 1.0),
        ("85", 85, 1.0),  # a bare answer is fine too
        (" 85 ", "85", 1.0),
        ("7+8=15, 75", 85, 0.0),  # the dropped carry
        ("75", 85, 0.0),
        ("7+8=15", 85, 0.0),  # no answer: the "15" belongs to "7+8=15", not after a comma
        ("", 85, 0.0),
        ("eighty-five", 85, 0.0),
        ("85, ", 85, 0.0),
        ("1+2=3, -3", "-3", 1.0),
        ("@@##!!", 3, 0.0),
    ],
)
def test_compute_score_by_hand(response, truth, score):
    assert compute_score(response, truth) == score


def test_extract_answer():
    assert extract_answer("7+8=15, 85") == 85
    assert extract_answer("1,2,3") == 3
    assert extract_answer("7+8=15") is None


def test_the_builtin_dispatcher_scores_arithmetic():
    from tearless.rewards import compute_score as dispatch

    assert dispatch("arithmetic", "7+8=15, 85", "85") == 1.0
    assert dispatch("arithmetic", "7+8=15, 75", "85") == 0.0


def test_generate_rows_are_distinct_schema_rows():
    rows = arithmetic.generate_rows(500, seed=3, split="train")
    pairs = [(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows]
    assert len(set(pairs)) == 500
    for i, r in enumerate(rows):
        a, b = r["extra_info"]["a"], r["extra_info"]["b"]
        assert 0 <= a <= 99 and 0 <= b <= 99
        assert r["prompt"] == [{"role": "user", "content": f"{a}+{b}="}]
        assert r["reward_model"] == {"style": "rule", "ground_truth": str(a + b)}
        assert r["data_source"] == "arithmetic" and r["extra_info"]["index"] == i
    assert arithmetic.generate_rows(500, seed=3, split="train") == rows  # seeded


def test_exclude_keeps_splits_disjoint_and_impossible_requests_fail():
    test = arithmetic.generate_rows(200, seed=1, split="test", max_operand=20)
    held = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in test}
    train = arithmetic.generate_rows(241, seed=2, split="train", max_operand=20, exclude=held)
    assert held.isdisjoint((r["extra_info"]["a"], r["extra_info"]["b"]) for r in train)
    # 21 × 21 = 441 problems: 200 held out leave exactly 241.
    with pytest.raises(ValueError, match="cannot draw 242 distinct problems"):
        arithmetic.generate_rows(242, seed=2, split="train", max_operand=20, exclude=held)


def test_session_task_files_split_disjointly(task):
    from tearless.data import load_rows

    train = load_rows(task.train_file)
    val = load_rows(task.val_file)
    assert (len(train), len(val)) == (400, 100)
    key = lambda r: (r["extra_info"]["a"], r["extra_info"]["b"])  # noqa: E731
    assert {key(r) for r in train}.isdisjoint(key(r) for r in val)
    assert {r["extra_info"]["split"] for r in train} == {"train"}
    assert {r["extra_info"]["split"] for r in val} == {"test"}


def test_worked_answer_and_carry_by_hand():
    assert arithmetic.worked_answer(47, 38, 85) == "7+8=15, 85"
    assert arithmetic.has_units_carry(47, 38) and not arithmetic.has_units_carry(41, 38)
    assert arithmetic.has_units_carry(5, 5)  # 5 + 5 = 10 carries


def test_flawed_teacher_drops_the_carry_at_the_configured_rate():
    rng = random.Random(0)
    n, p = 4000, 0.7
    carry = [(a, b) for a in range(100) for b in range(100) if arithmetic.has_units_carry(a, b)]
    wrong = 0
    for _ in range(n):
        a, b = rng.choice(carry)
        text = arithmetic.flawed_teacher(a, b, rng, p)
        assert text.startswith(f"{a % 10}+{b % 10}={a % 10 + b % 10}, ")  # units always right
        answer = extract_answer(text)
        assert answer in (a + b, a + b - 10)
        wrong += answer == a + b - 10
    # Binomial(4000, 0.7): sd = sqrt(4000 · 0.7 · 0.3) ≈ 29; allow 4 sd.
    assert abs(wrong - n * p) <= 4 * math.sqrt(n * p * (1 - p))
    # No carry, nothing to forget: always right.
    assert all(
        extract_answer(arithmetic.flawed_teacher(a, b, rng, 1.0)) == a + b
        for a, b in [(41, 38), (0, 0), (12, 3), (90, 9)]
    )
    assert extract_answer(arithmetic.flawed_teacher(47, 38, rng, 0.0)) == 85
