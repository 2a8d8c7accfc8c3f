"""The R1 format helper: think, then answer, each tag once."""

from __future__ import annotations

import pytest

from tearless.rewards.format import check_r1_format, extract_answer, r1_format_reward


@pytest.mark.parametrize(
    ("text", "strict", "loose"),
    [
        ("<think>2+2 is 4</think><answer>4</answer>", True, True),
        ("  <think>\nsteps\n</think>\n\n<answer>\n4\n</answer>\n", True, True),
        ("Sure! <think>x</think><answer>4</answer>", False, True),  # text before <think>
        ("<think>x</think> so: <answer>4</answer>", False, True),
        ("<think>x</think><answer>4</answer> Hope this helps.", False, True),
        ("<answer>4</answer><think>x</think>", False, False),  # wrong order
        ("<think>x</think><answer>4</answer><answer>5</answer>", False, False),  # answer twice
        ("<think>x<think>y</think><answer>4</answer>", False, False),
        ("<think>x</think>", False, False),  # no answer
        ("<answer>4</answer>", False, False),  # no think
        ("", False, False),
    ],
)
def test_check_r1_format(text, strict, loose):
    assert check_r1_format(text, strict=True) is strict
    assert check_r1_format(text, strict=False) is loose
    assert r1_format_reward(text, strict=False, reward=1.0, penalty=-1.0) == (1.0 if loose else -1.0)


def test_extract_answer():
    assert extract_answer("<answer> a </answer> then <answer>\n b \n</answer>") == "b"
    assert extract_answer("<answer>unclosed") is None
