"""The small checks every config's validation is built from (tearless.config.errors), and the shape the
validation keeps: a short driver over one module per idea."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

import tearless.config
from tearless.config import ConfigError, load_config
from tearless.config.dpo import DPOConfig
from tearless.config.errors import count, existing_file, in_range
from tearless.config.rm import RMConfig
from tearless.config.sft import SFTConfig

CONFIG = Path(tearless.config.__file__).parent


def message(check, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        check(*args, **kwargs)
    return str(info.value)


def test_in_range_takes_each_end_open_or_closed_and_refuses_nan():
    # [0, 1): 0 is in, 1 is out; (0, 1]: the reverse; NaN compares false with both ends, so it is out.
    in_range("k", 0, 0, 1, "Fix.", high_open=True)
    in_range("k", 1, 0, 1, "Fix.", low_open=True)
    assert message(in_range, "k", 1.0, 0, 1, "Fix.", high_open=True) == "k: must be in [0, 1), got 1.0. Fix."
    assert message(in_range, "k", 0, 0, 1, "Fix.", low_open=True) == "k: must be in (0, 1], got 0. Fix."
    assert message(in_range, "k", math.nan, 0.0, 1.0, "Fix.") == "k: must be in [0.0, 1.0], got nan. Fix."
    worded = message(
        in_range, "k", 0.7, 0, 0.5, "Fix.", high_open=True, problem="{value} is not in {interval}"
    )
    assert worded == "k: 0.7 is not in [0, 0.5). Fix."


def test_count_refuses_negatives_bools_and_non_integers():
    count("k", 0, "Fix.")
    for bad in (-1, True, 1.0, "2"):
        assert message(count, "k", bad, "Fix.") == f"k: must be an integer >= 0, got {bad!r}. Fix."


def test_existing_file_names_a_missing_path_and_refuses_a_directory(tmp_path):
    (tmp_path / "tools.yaml").write_text("tools: []\n")
    existing_file("k", str(tmp_path / "tools.yaml"), "config", "Point it at a file.")
    missing = str(tmp_path / "nope.yaml")
    assert message(existing_file, "k", missing, "config", "Fix.") == f"k: {missing!r} is not a file. Fix."
    assert message(existing_file, "k", str(tmp_path), "config", "Fix.").startswith("k")


@pytest.mark.parametrize(
    ("schema", "key", "value", "shown"),
    [
        (SFTConfig, "data.micro_batch_size_per_gpu", "four", "'four'"),
        (SFTConfig, "trainer.total_training_steps", "[1,2]", "[1, 2]"),
        (DPOConfig, "algorithm.cpo_alpha", "high", "'high'"),
        (RMConfig, "data.micro_batch_size_per_gpu", "four", "'four'"),
    ],
)
def test_the_offline_configs_refuse_a_word_where_a_number_belongs_in_one_line(schema, key, value, shown):
    # Their own copy of `positive` compared the word with 0 and raised a TypeError traceback.
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{key}={value}"], schema=schema)
    assert str(info.value) == f"{key}: must be a number, got {shown}. Set a number."


def _functions(path: Path) -> dict[str, int]:
    tree = ast.parse(path.read_text())
    return {
        f"{path.name}:{node.name}": node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def test_validation_stays_a_short_driver_over_small_functions():
    lengths = {name: n for path in sorted(CONFIG.rglob("*.py")) for name, n in _functions(path).items()}
    assert lengths["validate.py:validate"] < 60
    assert {name: n for name, n in lengths.items() if n > 80} == {}
