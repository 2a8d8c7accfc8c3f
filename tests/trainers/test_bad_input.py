"""Bad data, paths and reward functions at trainer level: clear errors, or a run that carries on."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tearless import train
from tearless.cli import main as cli
from tearless.config import ConfigError
from tearless.data import DataError, load_rows, write_jsonl, write_parquet
from tearless.rewards import UnknownDataSource
from tearless.run.tracking import read_metrics
from tearless.tasks import arithmetic
from tearless.trainers.records import read_records

ONE_STEP = ("trainer.total_training_steps=1", "trainer.val_before_train=false", "data.val_max_samples=8")


def run(args):
    return train(None, args, log=lambda _: None)


def test_a_row_without_reward_model_names_file_row_and_column(overrides, task, tmp_path):
    rows = load_rows(task.train_file)[:20]
    del rows[3]["reward_model"]  # parquet stores it as null in row 3
    bad = tmp_path / "train.parquet"
    write_parquet(rows, bad)
    with pytest.raises(DataError) as info:
        run(overrides(tmp_path / "run", f"data.train_files={bad}"))
    msg = str(info.value)
    assert str(bad) in msg and "row 3" in msg and "'reward_model.ground_truth'" in msg
    assert not (tmp_path / "run").exists()  # nothing was started


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_an_empty_data_file_is_a_clear_error(overrides, tmp_path, kind):
    path = tmp_path / f"empty.{kind}"
    if kind == "parquet":
        pq.write_table(pa.table({"data_source": pa.array([], pa.string())}), path)
    else:
        path.write_text("\n\n")
    with pytest.raises(DataError, match=rf"{path}.* has no rows"):
        run(overrides(tmp_path / "run", f"data.val_files={path}"))


def test_overlong_prompts_are_an_error_naming_the_fixes(overrides, tmp_path):
    # "<|user|>47+38=<|end|><|assistant|>" is 9 tokens; a cap of 8 makes two-digit sums overlong.
    with pytest.raises(DataError) as info:
        run(overrides(tmp_path / "run", "data.max_prompt_length=8", *ONE_STEP))
    msg = str(info.value)
    assert "9 tokens" in msg and "data.max_prompt_length=8" in msg
    assert "data.truncation=left|right|middle" in msg and "data.filter_overlong_prompts=true" in msg


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_overlong_prompts_are_cut_when_truncation_is_set(overrides, tmp_path, mode):
    summary = run(overrides(tmp_path, "data.max_prompt_length=8", f"data.truncation={mode}", *ONE_STEP))
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert record["step"] == 1 and summary["steps"] == 1
    assert record["prompt_length/max"] == 8 and record["prompt_length/min"] >= 7


@pytest.mark.slow
def test_overlong_prompts_can_be_filtered_out(overrides, tmp_path):
    run(overrides(tmp_path, "data.max_prompt_length=8", "data.filter_overlong_prompts=true", *ONE_STEP))
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert record["prompt_length/max"] <= 8


def test_a_missing_model_path_names_the_key(overrides, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"actor_rollout_ref\.model\.path=/nonexistent/model"):
        run(overrides(tmp_path, "actor_rollout_ref.model.path=/nonexistent/model"))


def test_a_missing_tokenizer_path_names_its_own_key(overrides, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"actor_rollout_ref\.model\.tokenizer_path=/nonexistent/tok"):
        run(overrides(tmp_path, "actor_rollout_ref.model.tokenizer_path=/nonexistent/tok"))


def test_a_missing_custom_reward_file_names_the_key(overrides, tmp_path):
    # Caught by config validation, before any model loads.
    with pytest.raises(
        ConfigError, match=r"custom_reward_function\.path: '/nonexistent/reward\.py' is not a file"
    ):
        run(overrides(tmp_path, "custom_reward_function.path=/nonexistent/reward.py"))


RAISING = """
from tearless.tasks.arithmetic import compute_score as score

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 2:
        raise ValueError("cannot score " + str(ground_truth))
    return score(solution_str, ground_truth)
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_a_reward_function_that_raises_fails_only_its_samples(overrides, tmp_path, workers):
    reward = tmp_path / "reward.py"
    reward.write_text(RAISING)
    run(
        overrides(
            tmp_path / "run",
            f"custom_reward_function.path={reward}",
            f"reward_model.num_workers={workers}",
            "reward_model.failure_score=-1",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
            "data.val_max_samples=8",
        )
    )
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    samples = read_records(tmp_path / "run" / "rollouts.jsonl.gz")
    for r in records:
        assert 0 < r["reward/failures"] < 32  # 8 prompts × 4 responses; only odd sums fail
        assert r["reward/failures"] % 4 == 0  # a prompt's 4 responses fail together
        assert r["critic/score/min"] == -1.0
    for s in samples:
        assert (s["score"] == -1.0) == (int(s["ground_truth"]) % 2 == 1)


def _rows(n, seed, *, hang_first=False):
    rows = arithmetic.generate_rows(n, seed=seed, split="x")
    for i, r in enumerate(rows):
        r["extra_info"]["hang"] = hang_first and i == 0
    return rows


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hanging_reward_callable_times_out_and_the_step_finishes(overrides, tmp_path):
    def reward_fn(data_source, solution_str, ground_truth, extra_info=None):
        if (extra_info or {}).get("hang"):
            time.sleep(3600)
        return arithmetic.compute_score(solution_str, ground_truth)

    train_file, val_file = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    write_jsonl(_rows(4, seed=5, hang_first=True), train_file)
    write_jsonl(_rows(4, seed=6), val_file)
    started = time.perf_counter()
    summary = train(
        None,
        overrides(
            tmp_path / "run",
            f"data.train_files={train_file}",
            f"data.val_files={val_file}",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "data.shuffle=false",
            "reward_model.num_workers=1",
            "reward_model.timeout_s=1",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
        ),
        reward_fn=reward_fn,
        log=lambda _: None,
    )
    elapsed = time.perf_counter() - started
    (record,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert record["reward/failures"] == 2.0  # the hanging prompt's two responses
    assert record["timing_s/reward"] >= 2.0  # two 1 s timeouts, one worker
    assert elapsed < 60
    assert "after" in summary  # validation at the end ran with the same pool


EXTRAS = """
from tearless.tasks.arithmetic import compute_score as score

def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    s = score(solution_str, ground_truth)
    return {"score": scale * s, "acc": s, "chars": len(solution_str), "label": "not a number"}
"""


@pytest.mark.slow
def test_extra_reward_keys_are_logged_and_reward_kwargs_are_passed(overrides, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(EXTRAS)
    run(
        overrides(
            tmp_path / "run",
            f"custom_reward_function.path={reward}",
            "+custom_reward_function.reward_kwargs.scale=2.0",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
            "data.val_max_samples=8",
        )
    )
    for r in read_metrics(tmp_path / "run" / "metrics.jsonl"):
        assert "reward_extra/label/mean" not in r  # non-numeric extras are dropped
        # acc is 0/1 and the score is twice it; correctness comes from acc, not from score >= 1.
        assert r["reward_extra/acc/mean"] == pytest.approx(r["reward/accuracy"])
        assert r["critic/score/mean"] == pytest.approx(2 * r["reward/accuracy"])
        assert r["critic/score/max"] in (0.0, 2.0)
        # One character per token, and the EOS token of a finished response decodes to nothing.
        finished = 1 - r["response_length/clip_ratio"]
        assert r["reward_extra/chars/mean"] == pytest.approx(r["response_length/mean"] - finished)


def test_an_unknown_data_source_is_refused_when_the_data_loads(overrides, task, tmp_path):
    # Found by the built-in dispatcher when the rows load (row 7 of 20), not at the first scoring
    # after a rollout: the run directory is never made.
    rows = load_rows(task.train_file)[:20]
    rows[7]["data_source"] = "no-such-source"
    bad = tmp_path / "train.jsonl"
    write_jsonl(rows, bad)
    with pytest.raises(UnknownDataSource) as info:
        run(overrides(tmp_path / "run", f"data.train_files={bad}"))
    assert str(info.value).startswith(
        f"data.train_files={bad}: row 7: no built-in reward function for data_source 'no-such-source'"
    )
    assert not (tmp_path / "run").exists()
    # A custom reward function takes any data_source.
    scorer = tmp_path / "any.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    run(
        overrides(
            tmp_path / "run2", f"data.train_files={bad}", f"custom_reward_function.path={scorer}", *ONE_STEP
        )
    )


def test_a_keyboard_interrupt_raised_by_an_in_process_reward_is_one_line(overrides, tmp_path, capsys):
    # Not a signal (the CLI turns SIGINT into its own stop): the reward function's own raise, which
    # printed a traceback; now one line naming where it was raised.
    reward = tmp_path / "interrupts.py"
    reward.write_text("def compute_score(**kwargs):\n    raise KeyboardInterrupt\n")
    args = overrides(
        tmp_path / "run", *ONE_STEP, f"custom_reward_function.path={reward}", "reward_model.num_workers=0"
    )
    code = cli(["train", *args])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 1 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(
        "tearless: error: KeyboardInterrupt raised by the run's own code, not by a signal"
    )
    assert f"{reward}, line 2, in compute_score" in lines[0]
