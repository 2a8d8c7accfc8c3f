"""The code execution reward: extraction, test-case conventions, comparison, and scores."""

from __future__ import annotations

import json
import sys

import pytest

from tearless.rewards import compute_score
from tearless.rewards.code_reward import extract_code, outputs_match, parse_tests, values_match

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")

FENCE = "```"


def answer(code: str, lang: str = "python", before: str = "Here is my solution.\n") -> str:
    return f"{before}{FENCE}{lang}\n{code}\n{FENCE}\nThis runs in O(n)."


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (answer("print(1)"), "print(1)\n"),
        (answer("print(2)", lang="Python3"), "print(2)\n"),
        (answer("print(3)", lang=""), "print(3)\n"),
        # The last Python block wins; a C++ block after it is ignored.
        (
            answer("print('draft')") + answer("print('final')") + answer("int main(){}", "cpp"),
            "print('final')\n",
        ),
        # A truncated last block (no closing fence) leaves the earlier complete one.
        (answer("print('done')") + f"{FENCE}python\nprint('cut off", "print('done')\n"),
        ("print('no fences at all')", None),
        (answer("int main(){}", "cpp"), None),
    ],
)
def test_extract_code(response, expected):
    assert extract_code(response) == expected


def test_parse_tests_conventions():
    stdio = parse_tests(
        json.dumps({"inputs": [["1 2", "3"], "4\n"], "outputs": [["3", "x"], "4"], "fn_name": ""})
    )
    assert stdio.fn_name is None
    assert stdio.inputs == ["1 2\n3\n", "4\n"] and stdio.outputs == ["3\nx\n", "4"]
    call = parse_tests({"fn_name": "f", "inputs": [[1, 2], 5], "outputs": [[3], 5]})
    assert call.inputs == [[1, 2], [5]] and call.fn_name == "f"
    with pytest.raises(ValueError, match="as many outputs as inputs"):
        parse_tests({"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_tests("{inputs: [1]}")
    with pytest.raises(ValueError, match=r"needs \{\"inputs\""):
        parse_tests({"input_output": "{}"})


@pytest.mark.parametrize(
    ("actual", "expected", "match"),
    [
        ("1 2\n3\n", "1 2\n3", True),
        ("1   2 \r\n3", "1 2\n3\n", True),  # whitespace is only a separator
        ("0.3333333", "0.333333333", True),  # within 1e-6
        ("0.334", "0.333333333", False),
        ("1e5", "100000", True),
        ("3", "3.0", True),
        ("YES", "yes", False),  # case matters
        ("1 2", "1 2 3", False),
        ("", "", True),
        ("nan", "nan", True),
        ("inf", "1e400", False),  # not finite: only an exact token match counts
        ("héllo wörld", "héllo  wörld", True),
    ],
)
def test_outputs_match(actual, expected, match):
    assert outputs_match(actual, expected) is match


@pytest.mark.parametrize(
    ("actual", "expected", "match"),
    [
        (5, 5, True),
        (5, [5], True),  # APPS wraps expected values in a list
        ([1, 2], [[1, 2]], True),
        ([1, 2], [1, 2], True),
        (0.1 + 0.2, 0.3, True),
        (True, 1, False),  # a bool is not a number here
        ({"a": [1.0]}, {"a": [1]}, True),
        ("5", 5, False),
        ([1, 2], [2, 1], False),
    ],
)
def test_values_match(actual, expected, match):
    assert values_match(actual, expected) is match


STDIO = {"inputs": ["2\n3 4\n", "1\n10\n", "3\n1 1 1\n"], "outputs": ["7\n", "10\n", "3\n"]}


@pytest.mark.parametrize(
    ("code", "score"),
    [
        ("n = int(input())\nprint(sum(map(int, input().split())))", 1.0),
        # Right on two tests of three: the third has more numbers than it reads.
        ("n = int(input())\nprint(sum(map(int, input().split()[:2])))", 2 / 3),
        ("import sys\ndata = sys.stdin.read().split()\nprint(sum(map(int, data[1:])))\nexit(0)", 1.0),
        ("print('debug')\nn = int(input())\nprint(sum(map(int, input().split())))", 0.0),  # extra output
        ("n = int(input())\nraise SystemExit(1)", 0.0),
        ("def solve(:", 0.0),  # does not compile
        ("import os\nos.system('echo 7')", 0.0),  # refused by the guard
        ("while True:\n    pass", 0.0),  # times out on the first test and ends the sample
    ],
)
def test_stdio_scores_are_the_fraction_passed(code, score):
    result = compute_score("code", answer(code), json.dumps(STDIO), None, time_limit_s=0.5)
    assert result["score"] == pytest.approx(score)
    assert result["acc"] == float(score == 1.0)


def test_function_call_tests_leetcode_style_and_sources():
    truth = {
        "fn_name": "twoSum",
        "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]],
        "outputs": [[[0, 1]], [[1, 2]]],
    }
    code = (
        "from typing import List\n"
        "class Solution:\n"
        "    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
        "        seen = {}\n"
        "        for i, x in enumerate(nums):\n"
        "            if target - x in seen:\n"
        "                return [seen[target - x], i]\n"
        "            seen[x] = i\n"
    )
    for source in ("code", "apps", "taco", "codecontests", "codeforces"):
        assert compute_score(source, answer(code), truth)["score"] == 1.0
    wrong = code.replace("return [seen[target - x], i]", "return (i, seen[target - x])")
    assert compute_score("code", answer(wrong), truth)["score"] == 0.0
    top_level = "def twoSum(nums, target):\n    return [0, 1]\n"
    assert compute_score("code", answer(top_level), truth)["score"] == 0.5
    missing = "def other(nums, target):\n    return [0, 1]\n"
    assert compute_score("code", answer(missing), truth)["score"] == 0.0


def test_no_code_block_scores_zero_and_max_tests_and_extra_info_limits():
    assert compute_score("code", "I would loop over the numbers.", STDIO) == {"score": 0.0, "acc": 0.0}
    only_first = answer("print(7)")
    assert compute_score("code", only_first, STDIO)["score"] == pytest.approx(1 / 3)
    assert compute_score("code", only_first, STDIO, None, max_tests=1)["score"] == 1.0
    slow = answer("import time\ntime.sleep(0.6)\nprint(7)")
    assert compute_score("code", slow, STDIO, {"time_limit_s": 0.3}, max_tests=1)["score"] == 0.0


def test_unicode_and_a_long_noisy_response():
    truth = {"inputs": ["wörld\n"], "outputs": ["héllo wörld ✓\n"]}
    noise = "Let me think. " * 2000 + f"{FENCE}python\nprint('wrong')\n{FENCE}\n" + "More thoughts. " * 2000
    code = "print('héllo', input(), '✓')"
    assert compute_score("code", noise + answer(code), truth)["score"] == 1.0
