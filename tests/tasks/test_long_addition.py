"""The medium benchmark's task: five-digit addition worked column by column."""

from __future__ import annotations

from tearless.rewards import compute_score as dispatch
from tearless.tasks.long_addition import compute_score, generate_rows, worked_answer
from tearless.tasks.tokenizer import build_char_tokenizer


def test_worked_answer_by_hand():
    # 47391 + 25868: 1+8=9; 9+6=15 (carry); 3+8+1=12 (carry); 7+5+1=13 (carry); 4+2+1=7 → 73259.
    assert worked_answer(47391, 25868) == "1+8=9;9+6=15;3+8+1=12;7+5+1=13;4+2+1=7;=73259"
    # A carry out of the top column makes a six-digit sum.
    assert worked_answer(99999, 10001).endswith("9+1+1=11;=110000")


def test_answers_are_32_to_64_tokens_with_the_char_tokenizer():
    tok = build_char_tokenizer()
    rows = generate_rows(300, seed=3, split="train")
    lengths = [
        len(tok.encode(worked_answer(r["extra_info"]["a"], r["extra_info"]["b"]))) + 1 for r in rows
    ]  # + the end-of-turn token
    assert 32 <= min(lengths) and max(lengths) <= 64
    assert len({(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows}) == 300


def test_score_gives_half_for_similarity_and_half_for_the_sum():
    info = {"a": 47391, "b": 25868}
    full = worked_answer(47391, 25868)  # 45 characters
    assert compute_score(full, "73259", info) == {"score": 1.0, "acc": 1.0, "similarity": 1.0}
    # The right sum alone: the 6 characters "=73259" match, ratio 2·6 / (6 + 45); plus the half for the sum.
    assert compute_score("=73259", "73259", info)["score"] == 0.5 + 0.5 * 12 / 51
    # The full work with the last digit of the sum wrong: 44 of 45 characters match, no sum credit.
    wrong = full[:-1] + "8"
    assert compute_score(wrong, "73259", info) == {"score": 0.5 * 88 / 90, "acc": 0.0, "similarity": 88 / 90}
    assert compute_score("", "73259", info)["score"] == 0.0
    # The built-in dispatcher knows the data_source.
    assert dispatch("long_addition", full, "73259", info)["score"] == 1.0


def test_held_out_rows_can_be_excluded():
    test = generate_rows(50, seed=1, split="test")
    held = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in test}
    train = generate_rows(500, seed=2, split="train", exclude=held)
    assert not held & {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in train}
