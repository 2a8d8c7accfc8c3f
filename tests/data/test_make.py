"""``tearless data make``: the embedded tasks as seeded train/test files that never overlap."""

from __future__ import annotations

import json

import pytest

from tearless.cli import main
from tearless.data import DataError, load_rows
from tearless.rewards import compute_score
from tearless.tasks.make import make_rows


@pytest.mark.parametrize("task", ["arithmetic", "countdown", "knights_knaves", "word_problems"])
def test_splits_are_seeded_sized_and_disjoint(task):
    splits = make_rows(task, num_train=60, num_test=20, seed=3)
    assert splits == make_rows(task, num_train=60, num_test=20, seed=3)
    assert splits != make_rows(task, num_train=60, num_test=20, seed=4)
    assert (len(splits["train"]), len(splits["test"])) == (60, 20)
    prompts = {split: {json.dumps(r["prompt"]) for r in rows} for split, rows in splits.items()}
    assert len(prompts["train"]) == 60 and not prompts["train"] & prompts["test"]
    assert {r["extra_info"]["split"] for r in splits["test"]} == {"test"}


def test_options_are_checked():
    with pytest.raises(DataError, match="--num-people applies to knights_knaves, not countdown"):
        make_rows("countdown", num_train=1, num_test=1, seed=0, num_people=4)
    with pytest.raises(DataError, match="unknown task 'sudoku'"):
        make_rows("sudoku", num_train=1, num_test=1, seed=0)
    with pytest.raises(DataError, match="num_people must be in"):
        make_rows("knights_knaves", num_train=1, num_test=1, seed=0, num_people=1)


def test_cli_make_writes_files_the_scorers_read(tmp_path, capsys):
    out = tmp_path / "kk"
    args = ["--output", str(out), "--num-train", "8", "--num-test", "4", "--num-people", "4", "--seed", "1"]
    code = main(["data", "make", "knights_knaves", *args])
    assert code == 0 and "train.parquet: 8 rows" in capsys.readouterr().out
    rows = load_rows(out / "train.parquet")
    assert len(rows) == 8 and all(r["extra_info"]["num_people"] == 4 for r in rows)
    truth = rows[0]["reward_model"]["ground_truth"]
    response = "<think>...</think><answer>" + truth.replace("\n", " ") + "</answer>"
    assert compute_score(rows[0]["data_source"], response, truth)["score"] == 3.0
    assert main(["data", "make", "countdown", "--output", str(tmp_path / "cd"), "--num-people", "3"]) == 2


@pytest.mark.parametrize("task", ["countdown", "knights_knaves"])
def test_the_printed_command_fits_the_data_it_wrote(task, tmp_path):
    """``data make`` prints a train command whose preset's lengths hold every prompt it wrote
    (measured with the embedded character-level tokenizer, the longest rendering)."""
    from tearless.config import load_config
    from tearless.data import PromptDataset
    from tearless.tasks.make import make_task, train_command
    from tearless.tasks.tokenizer import build_char_tokenizer

    paths = make_task(task, tmp_path, num_train=30, num_test=10, seed=0)
    command = train_command(task, paths)
    assert command.startswith(f"tearless train --preset {task} data.train_files={paths['train']} ")
    cfg = load_config(None, command.split()[4:6], preset=task)  # the printed data.* overrides
    tokenizer = build_char_tokenizer()
    for path in paths.values():
        # The default data.truncation=error raises on any prompt longer than max_prompt_length.
        PromptDataset(load_rows(path), tokenizer, max_prompt_length=cfg.data.max_prompt_length)
    # The defaults (64 tokens) do not hold them: that is why the preset exists.
    with pytest.raises(DataError, match="longer than"):
        PromptDataset(load_rows(paths["train"]), tokenizer, max_prompt_length=64)


def test_word_problems_state_their_numbers_and_answer_the_operation():
    """Each story names a and b in order; the ground truth is a + b or a − b (never negative), and the
    scorer reads the last integer of a worded answer."""
    import re

    rows = make_rows("word_problems", num_train=200, num_test=50, seed=0)["train"]
    ops = set()
    for r in rows:
        info, text = r["extra_info"], r["prompt"][0]["content"]
        a, b, op = info["a"], info["b"], info["op"]
        ops.add(op)
        assert [int(x) for x in re.findall(r"\d+", text)] == [a, b]
        truth = int(r["reward_model"]["ground_truth"])
        assert truth == (a + b if op == "+" else a - b) and truth >= 0
        assert text.endswith("Answer with a number.")
    assert ops == {"+", "-"}
    score = lambda response, truth: compute_score("word_problems", response, truth)  # noqa: E731
    assert score("Mia has 23 + 15 = 38 pencils now. The answer is 38.", "38") == 1.0
    assert score("38", "38") == 1.0 and score("1,038", "1038") == 1.0
    assert score("She has 38 pencils, or maybe 39", "38") == 0.0
    assert score("thirty-eight", "38") == 0.0


def test_real_model_tasks_print_a_command_naming_the_hub_model(tmp_path, capsys):
    assert main(["data", "make", "knights_knaves", "--output", str(tmp_path / "kk"), "--num-train", "4",
                 "--num-test", "2"]) == 0  # fmt: skip
    command = capsys.readouterr().out.splitlines()[-1].strip()
    assert command == (
        f"tearless train --preset knights_knaves data.train_files={tmp_path / 'kk' / 'train.parquet'} "
        f"data.val_files={tmp_path / 'kk' / 'test.parquet'} "
        "actor_rollout_ref.model.path=HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert main(["data", "make", "word_problems", "--output", str(tmp_path / "wp")]) == 0
    command = capsys.readouterr().out.splitlines()[-1].strip()
    # The preset names the model itself.
    assert command.startswith("tearless train --preset word_problems data.train_files=")
    assert "model.path" not in command
