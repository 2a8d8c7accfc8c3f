"""veRL's geo3k score: 0.9 × the last boxed answer right + 0.1 × the think-then-boxed format."""

from __future__ import annotations

import pytest

from tearless.rewards import get_scorer
from tearless.rewards.geo3k import compute_score


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("<think>the angles sum to 180</think> so x = \\boxed{30}", "30", 1.0),
        ("<think>a\nb</think>\n\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # across lines; equivalent forms
        ("x = \\boxed{30}", "30", 0.9),  # right, no <think>
        ("<think>guess</think> \\boxed{40}", "30", 0.1),  # the format only
        ("<think>a</think> \\boxed{30} then \\boxed{40}", "30", 0.1),  # the last box counts
        ("30", "30", 0.0),
    ],
)
def test_hand_worked_scores(response, truth, score):
    assert compute_score(response, truth) == pytest.approx(score)


def test_the_geometry3k_source_is_scored_by_it():
    assert get_scorer("hiyouga/geometry3k") is compute_score
