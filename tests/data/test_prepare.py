"""``tearless data prepare``: local GSM8K and MATH copies in their usual layouts → veRL parquet."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tearless.cli import main
from tearless.data import DataError, load_rows
from tearless.data.prepare import GSM8K_INSTRUCTION, MATH_INSTRUCTION, prepare, split_of
from tearless.rewards import compute_score

GSM8K = [
    {"question": "Ann has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,000 more than $500. Price?", "answer": "500 + 1000 = 1500\n#### 1,500"},
]


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_gsm8k_hugging_face_parquet_layout(tmp_path):
    source = tmp_path / "gsm8k" / "main"
    source.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(GSM8K), source / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(GSM8K[:1]), source / "test-00000-of-00001.parquet")
    summary = prepare("gsm8k", tmp_path / "gsm8k", tmp_path / "out")
    assert summary["rows"] == {"train": 2, "test": 1}
    train = load_rows(tmp_path / "out" / "train.parquet")
    assert [r["reward_model"]["ground_truth"] for r in train] == ["7", "1500"]
    row = train[1]
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["prompt"] == [{"role": "user", "content": f"{GSM8K[1]['question']} {GSM8K_INSTRUCTION}"}]
    assert row["extra_info"] == {
        "split": "train",
        "index": 1,
        "question": GSM8K[1]["question"],
        "answer": GSM8K[1]["answer"],
    }
    assert compute_score(row["data_source"], "so #### 1,500", row["reward_model"]["ground_truth"]) == 1.0


def test_gsm8k_openai_jsonl_layout_single_file_and_errors(tmp_path):
    write_jsonl(tmp_path / "grade_school_math" / "data" / "test.jsonl", GSM8K)
    assert prepare("gsm8k", tmp_path / "grade_school_math", tmp_path / "a")["rows"] == {"test": 2}
    write_jsonl(tmp_path / "mine.jsonl", GSM8K)
    with pytest.raises(DataError, match=r"cannot tell the split .* pass --split"):
        prepare("gsm8k", tmp_path / "mine.jsonl", tmp_path / "b")
    assert prepare("gsm8k", tmp_path / "mine.jsonl", tmp_path / "b", split="train")["rows"] == {"train": 2}
    write_jsonl(tmp_path / "bad" / "train.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(DataError, match=r"GSM8K record 0 \(train\) needs .*'#### <number>'"):
        prepare("gsm8k", tmp_path / "bad", tmp_path / "c")
    with pytest.raises(DataError, match="does not exist"):
        prepare("gsm8k", tmp_path / "nothing", tmp_path / "c")


def test_math_hendrycks_layout_and_math500_jsonl(tmp_path):
    root = tmp_path / "MATH"
    problems = {
        "train/algebra/1.json": {"problem": "Solve $2x=1$.", "level": "Level 1", "type": "Algebra",
                                  "solution": "So $x=\\boxed{\\frac{1}{2}}$."},
        "train/algebra/2.json": {"problem": "Prove it.", "level": "Level 5", "type": "Algebra",
                                  "solution": "No boxed answer here."},
        "test/constrained_optimization/3.json": {"problem": "Max?", "level": "Level 2", "type": "Other",
                                                  "solution": "\\boxed{\\{1, 2\\}}"},
    }  # fmt: skip
    for name, record in problems.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(record))
    summary = prepare("math", root, tmp_path / "out")
    assert summary["rows"] == {"train": 1, "test": 1} and summary["skipped"] == {"train": 1, "test": 0}
    row = load_rows(tmp_path / "out" / "train.parquet")[0]
    assert row["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert row["reward_model"]["ground_truth"] == "\\frac{1}{2}"
    assert row["prompt"][0]["content"] == f"Solve $2x=1$. {MATH_INSTRUCTION}"
    assert row["extra_info"]["level"] == "Level 1" and row["extra_info"]["type"] == "Algebra"
    assert load_rows(tmp_path / "out" / "test.parquet")[0]["reward_model"]["ground_truth"] == "\\{1, 2\\}"
    write_jsonl(
        tmp_path / "MATH-500" / "test.jsonl",
        [{"problem": "1+1?", "solution": "\\boxed{3}", "answer": "2", "subject": "Prealgebra", "level": 1}],
    )
    prepare("math", tmp_path / "MATH-500", tmp_path / "m500")
    row = load_rows(tmp_path / "m500" / "test.parquet")[0]
    assert row["reward_model"]["ground_truth"] == "2"  # the answer field wins over the solution's box
    assert row["extra_info"]["type"] == "Prealgebra"


@pytest.mark.parametrize(
    ("path", "split"),
    [
        ("main/train-00000-of-00001.parquet", "train"),
        ("data/validation.jsonl", "test"),
        ("MATH/test/algebra/12.json", "test"),
        ("constrained/test.jsonl", "test"),
        ("data/all.jsonl", None),
    ],
)
def test_split_of(path, split):
    from pathlib import Path

    assert split_of(Path(path)) == split


def test_cli_prepare(tmp_path, capsys):
    write_jsonl(tmp_path / "gsm" / "train.jsonl", GSM8K)
    assert (
        main(["data", "prepare", "gsm8k", "--input", str(tmp_path / "gsm"), "--output", str(tmp_path / "o")])
        == 0
    )
    assert "train.parquet: 2 rows" in capsys.readouterr().out
    assert (
        main(["data", "prepare", "gsm8k", "--input", str(tmp_path / "none"), "--output", str(tmp_path)]) == 2
    )
    assert "data error: --input" in capsys.readouterr().err


def test_hub_datasets_need_the_datasets_package_and_say_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # as if not installed
    with pytest.raises(DataError, match=r"reading openai/gsm8k from the Hugging Face Hub needs the datasets"):
        prepare("gsm8k", None, tmp_path / "out")
    # A Hub ID given as --input (not a local path) takes the same road.
    assert (
        main(["data", "prepare", "math", "--input", "HuggingFaceH4/MATH-500", "--output", str(tmp_path)]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HuggingFaceH4/MATH-500 from the Hugging Face Hub" in err
    assert not (tmp_path / "out").exists()
