"""Multiple choice: which letter the response chose, never misled by the article 'A'."""

from __future__ import annotations

import pytest

from tearless.rewards import compute_score
from tearless.rewards.multiple_choice import answer_letter, extract_choice


@pytest.mark.parametrize(
    ("response", "choice"),
    [
        ("A student might pick (A), but the answer is (C).", "C"),
        ("I think B. Final answer: \\boxed{D}", "D"),  # the box wins over earlier text
        ("A is wrong. The answer is D.", "D"),
        ("<answer>b) 42</answer>", "B"),
        ("<answer> Option C </answer>", "C"),
        ("\\boxed{\\text{(B)}}", "B"),
        ("Answer: **C**", "C"),
        ("The answer is: option E", "E"),
        ("The correct answer is (J) 1914", "J"),
        ("B", "B"),
        ("(B).", "B"),
        ("A good guess would be 42.", None),  # the article is not option A
        ("the answer is a tricky one", None),
        ("<answer>A or B</answer>", None),  # two options named
        ("\\boxed{42}", None),
        ("Answers vary. Answer: Bb", None),
    ],
)
def test_extract_choice(response, choice):
    assert extract_choice(response) == choice


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("the answer is (C)", "C", 1.0),
        ("the answer is (C)", "(C)", 1.0),
        ("the answer is (C)", 2, 1.0),  # a 0-based index
        ("the answer is (C)", "B", 0.0),
        ("Réponse : la bonne réponse… " * 500 + "\\boxed{A}", "A", 1.0),
    ],
)
def test_multiple_choice_scores(response, truth, score):
    assert compute_score("multiple_choice", response, truth) == score


@pytest.mark.parametrize("bad", ["K", "", 10, True, None])
def test_bad_ground_truth(bad):
    with pytest.raises(ValueError, match="letter A-J or an index 0-9"):
        answer_letter(bad)
