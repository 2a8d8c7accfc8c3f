"""Competition math: the last boxed answer, compared by mathematical equivalence."""

from __future__ import annotations

import pytest

from tearless.rewards import compute_score
from tearless.rewards.math_answer import last_boxed, normalize


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{1} wait, no: \\boxed{2}", "2"),  # the last one
        ("\\boxed{\\{1, \\{2\\}\\}}", "\\{1, \\{2\\}\\}"),  # nested braces
        ("\\fbox{7}", "7"),
        ("The answer is \\boxed 5$.", "5"),
        ("\\boxed{3} then \\boxed{\\frac{1}{", "3"),  # a truncated last box falls back to an earlier one
        ("no box here: 42", None),
        ("\\boxedfoo{4}", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_normalize():
    assert normalize("\\left( \\dfrac{1}{2}, 3 \\right).") == "(\\frac{1}{2},3)"


@pytest.mark.parametrize(
    "source", ["math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"]
)
@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("Thus $x = \\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
        ("\\boxed{5\\text{ cm}}", "5", 1.0),
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", 1.0),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})", 1.0),
        ("\\boxed{12.}", "12", 1.0),
        ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),
        ("I get 1/2, so \\boxed{7}", "\\frac{1}{2}", 0.0),  # a distractor before the box
        ("The answer is 0.5", "0.5", 0.0),  # no box: no answer
        ("\\boxed{}", "0", 0.0),
        ("\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", 1.0),  # a boxed ground truth is unboxed
    ],
)
def test_math_scores(source, response, truth, score):
    assert compute_score(source, response, truth) == score


def test_long_noisy_response_with_unicode():
    response = "Étape ①: on calcule… " * 1000 + "Donc \\boxed{2\\pi}."
    assert compute_score("math", response, "2 \\pi") == 1.0
