"""``tearless data inspect``: schema, sources, lengths, rows, and every problem in one report."""

from __future__ import annotations

import json

from tearless.cli import main
from tearless.data import write_parquet
from tearless.data.inspection import inspect_file

from .helpers import make_row


def test_a_clean_parquet_file(tmp_path, tokenizer):
    path = tmp_path / "clean.parquet"
    write_parquet([make_row("1+2=", "3"), make_row("10+20=", "30")], path)
    report = inspect_file(path, tokenizer=tokenizer, max_prompt_length=64, num_rows=1)
    assert report.problems == []
    text = report.text
    assert f"{path}: 2 rows" in text
    assert "reward_model: struct<style: string, ground_truth: string>" in text
    assert "arithmetic: 2 rows (tearless.tasks.arithmetic.compute_score)" in text
    # <|user|>1+2=<|end|><|assistant|> is 7 tokens, the other 9
    assert "prompt tokens: min 7, median 9, max 9" in text and "0 over 64" in text
    assert text.count("\nrow ") == 1 and text.endswith("problems:\n  none")


def test_every_problem_is_reported(tmp_path, tokenizer, capsys):
    path = tmp_path / "messy.jsonl"
    rows = [
        make_row("1+2=", "3"),
        make_row("1+2=", "3"),  # duplicate of row 0
        make_row("   ", "5"),  # empty prompt
        make_row("2+2=", ""),  # empty ground truth
        {"data_source": "arithmetic", "prompt": "4+4="},  # no reward_model
        make_row("q" * 100, "1", data_source="my_private_set"),  # unknown source, overlong
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = inspect_file(path, tokenizer=tokenizer, max_prompt_length=32)
    # Rows the trainer refuses (normalize_row's errors) come first, in row order.
    assert report.problems == [
        "empty prompt: 1 rows (2)",
        "missing column 'reward_model.ground_truth': 1 rows (4)",
        "data_source 'my_private_set' has no built-in scorer: set custom_reward_function.path: 1 rows (5)",
        "duplicate prompt (first seen in row 0): 1 rows (1)",
        "empty ground_truth: 1 rows (3)",
        "prompt longer than 32 tokens: 1 rows (5)",
    ]
    assert "data_source: str" in report.text  # JSON lines: the Python types seen
    assert main(["data", "inspect", str(path)]) == 1
    assert "problems:\n  - empty prompt" in capsys.readouterr().out
    assert main(["data", "inspect", str(tmp_path / "none.parquet")]) == 2
