import textwrap

import pytest

from tearless.rewards import RewardManager, load_reward_function
from tearless.userfiles import UserFileError


def write(tmp_path, source, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


GOOD = """
    from math import sqrt
    from dataclasses import dataclass


    @dataclass
    class Weights:
        exact: float = 1.0


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return Weights().exact * float(solution_str == ground_truth)


    def length_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": sqrt(len(solution_str)), "chars": len(solution_str)}


    THRESHOLD = 3
"""


def test_load_default_and_named(tmp_path):
    path = write(tmp_path, GOOD)
    fn = load_reward_function(path)
    assert fn("any", "42", "42") == 1.0
    assert fn("any", "41", "42") == 0.0
    assert load_reward_function(str(path), "length_score")("any", "abcd", None) == {"score": 2.0, "chars": 4}


def test_loaded_function_runs_in_workers(tmp_path):
    fn = load_reward_function(write(tmp_path, GOOD), "length_score")
    items = [
        {"data_source": "x", "solution_str": "a" * n, "ground_truth": None, "extra_info": {}}
        for n in (1, 4, 9)
    ]
    with RewardManager(fn, num_workers=2) as manager:
        results = manager.score(items)
    assert [(r.score, r.extra, r.error) for r in results] == [
        (1.0, {"chars": 1.0}, None),
        (2.0, {"chars": 4.0}, None),
        (3.0, {"chars": 9.0}, None),
    ]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"custom_reward_function.path='.*nope\.py' does not exist"):
        load_reward_function(tmp_path / "nope.py")
    with pytest.raises(UserFileError, match=r"^custom_reward_function.path: .* is a directory, not a"):
        load_reward_function(tmp_path)


def test_missing_name_lists_what_the_file_defines(tmp_path):
    path = write(tmp_path, GOOD)
    with pytest.raises(ValueError) as info:
        load_reward_function(path, "score")
    message = str(info.value)
    assert "custom_reward_function.name='score' is not defined in" in message
    # Imported names (sqrt, dataclass) are not the file's own.
    assert "the callables it defines are Weights, compute_score, length_score" in message
    with pytest.raises(ValueError, match="'THRESHOLD' is a int, not a function"):
        load_reward_function(path, "THRESHOLD")


def test_file_that_raises_on_import(tmp_path):
    path = write(tmp_path, "RATE = 1 / 0\n")
    with pytest.raises(ImportError, match="importing the file raised ZeroDivisionError: division by zero"):
        load_reward_function(path)
    path = write(tmp_path, "def compute_score(:\n", name="broken.py")
    with pytest.raises(ImportError, match="raised SyntaxError"):
        load_reward_function(path)
