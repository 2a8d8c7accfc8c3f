"""The command line: ``tearless config show``, ``tearless train``, ``python -m tearless.main_ppo``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tearless.cli import format_summary, main, one_line


def cli(*args, timeout=120, **kwargs):
    """Run ``tearless <args>``: the console script installed beside the interpreter running the tests,
    else ``python -m tearless.cli``. Not the first ``tearless`` on PATH: from a virtual environment run
    without activating it, that is another interpreter's script, which imports another tearless or none."""
    exe = shutil.which("tearless", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "tearless.cli"]
    env = {**os.environ, "TEARLESS_CACHE": "/nonexistent/tearless-cache"}  # never build the default task
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env, **kwargs)


def test_config_show_prints_every_key_with_its_doc():
    proc = cli("config", "show", "data.train_batch_size=32")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "data.train_batch_size = 32\n    prompts per RL step" in out
    assert "actor_rollout_ref.actor.loss_agg_mode = None\n    token-mean | token-sum" in out
    assert "actor_rollout_ref.actor.policy_loss.ppo_kl_coef = 0.1\n    kl_cov: " in out
    assert "algorithm.adv_estimator = 'grpo'" in out
    assert out.count(" = ") > 80


def test_train_help_prints_the_resolved_config(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("actor_rollout_ref:\n  rollout:\n    n: 4\n")
    proc = cli("train", "--config", str(config), "--help", "trainer.total_training_steps=3")
    assert proc.returncode == 0, proc.stderr
    assert "actor_rollout_ref.rollout.n = 4" in proc.stdout
    assert "trainer.total_training_steps = 3" in proc.stdout
    assert "discount" in proc.stdout  # the docs come with the values


def test_a_config_error_exits_2_with_the_message_and_no_traceback():
    proc = cli("train", "data.train_batch_sise=3")
    assert proc.returncode == 2
    assert "config error: unknown config key 'data.train_batch_sise'" in proc.stderr
    assert "data.train_batch_size" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_an_unknown_command_is_a_usage_error():
    proc = cli("fly")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


@pytest.mark.slow
def test_main_ppo_val_only_validates_the_session_task_and_stops(task, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tearless.main_ppo",
            f"actor_rollout_ref.model.path={task.model_dir}",
            f"data.train_files={task.train_file}",
            f"data.val_files={task.val_file}",
            f"trainer.default_local_dir={tmp_path}",
            "trainer.val_only=true",
            "trainer.logger=[jsonl]",
            "data.val_max_samples=20",
            "actor_rollout_ref.rollout.val_kwargs.n=2",
            "reward_model.num_workers=0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 0
    acc = record["val-core/arithmetic/acc/greedy"]
    assert 0.0 < acc < 1.0 and acc * 20 == round(acc * 20)  # a count out of 20 prompts
    assert 0.0 <= record["val-core/arithmetic/acc/pass@1"] <= record["val-core/arithmetic/acc/pass@2"] <= 1
    assert "val-core/arithmetic/acc/greedy" in proc.stdout  # the summary table
    assert not list(tmp_path.glob("global_step_*"))  # no training, no checkpoint


def test_import_tearless_does_not_import_torch():
    heavy = "('torch', 'transformers', 'omegaconf')"
    code = f"import sys, tearless; print(sorted(m for m in {heavy} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_format_summary_by_hand():
    text = format_summary(
        {
            "run_dir": "runs/x",
            "steps": 5,
            "seconds": 61.6,
            "before": {"val-core/arithmetic/acc/greedy": 0.56, "val-core/arithmetic/reward/greedy": 0.56},
            "after": {"val-core/arithmetic/acc/greedy": 0.85},
        }
    )
    lines = text.splitlines()
    assert lines[0].split() == [
        "val-core/arithmetic/acc/greedy",
        "before",
        "0.560",
        "after",
        "0.850",
        "(+29.0",
        "points)",
    ]
    assert lines[1] == "run directory: runs/x (5 steps, 62 s)"
    assert len(lines) == 2  # reward/* lines are not accuracies


def test_version_and_train_help_show_the_options():
    from tearless import __version__

    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"tearless {__version__}"
    out = cli("train", "--help").stdout
    head = out.split("config keys")[0]
    for option in ("--preset PRESET", "--config CONFIG", "--fresh"):
        assert option in head
    assert "data.train_batch_size = 16" in out
    assert "--preset" not in cli("config", "show").stdout


def test_sft_data_errors_are_one_message_without_traceback(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    proc = cli("sft", f"data.train_files={bad}", "trainer.total_training_steps=1")
    assert proc.returncode == 1
    assert proc.stderr.startswith("tearless: error: ") and str(bad) in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_eval_scores_a_model_with_the_validation_metrics(task, tmp_path, capsys):
    from tearless.cli import main

    out = tmp_path / "scores.json"
    code = main(
        ["eval", str(task.model_dir), f"data.val_files={task.val_file}", "data.val_max_samples=8",
         "reward_model.num_workers=0", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    metrics = result["metrics"]
    assert result["model"] == str(task.model_dir)
    # Greedy accuracy over 8 prompts is a multiple of 1/8; mean@4 over 32 samples a multiple of 1/32;
    # pass@k grows with k and pass@1 equals mean@4 (the unbiased estimator).
    greedy = metrics["val-core/arithmetic/acc/greedy"]
    assert 0.0 <= greedy <= 1.0 and (greedy * 8) == round(greedy * 8)
    mean4 = metrics["val-core/arithmetic/acc/mean@4"]
    assert (mean4 * 32) == round(mean4 * 32)
    assert metrics["val-core/arithmetic/acc/pass@1"] == pytest.approx(mean4)
    assert mean4 <= metrics["val-core/arithmetic/acc/pass@2"] <= metrics["val-core/arithmetic/acc/pass@4"]
    assert "val-core/arithmetic/acc/greedy" in capsys.readouterr().out
    assert main(["eval", str(task.model_dir)]) == 2  # data.val_files is required


@pytest.mark.slow
def test_eval_is_the_trainers_validation_without_a_trainer(task, tmp_path, monkeypatch):
    # `tearless eval` ran a whole RLTrainer (train files := val files, an optimizer, a run directory).
    # Its own entry builds no optimizer, and its numbers are still the trainer's val_only pass to the
    # bit, greedy and sampled (the same policy precision, engine, keys and scorer).
    import torch

    from tearless import train

    common = [
        f"data.val_files={task.val_file}",
        "data.val_max_samples=8",
        "reward_model.num_workers=0",
    ]
    want = train(
        None,
        [
            f"actor_rollout_ref.model.path={task.model_dir}",
            f"data.train_files={task.val_file}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.val_only=true",
            "trainer.logger=[]",
            *common,
        ],
        log=lambda _: None,
    )["before"]

    def no_optimizer(*args, **kwargs):
        raise AssertionError("tearless eval built an optimizer")

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", no_optimizer)
    out = tmp_path / "scores.json"
    assert main(["eval", str(task.model_dir), *common, "--out", str(out)]) == 0
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics == want and "val-core/arithmetic/acc/mean@4" in metrics


def _deep_allocation():
    raise MemoryError


def test_a_memory_error_says_out_of_memory_where_and_what_to_lower():
    # It printed "MemoryError: " and nothing else.
    try:
        _deep_allocation()
    except MemoryError as e:
        line = one_line(e)
    assert line.startswith("MemoryError: out of memory at ")
    assert f"{__file__}, line " in line and "in _deep_allocation" in line
    assert "data.train_batch_size" in line


def test_a_run_stopped_before_its_first_checkpoint_does_not_claim_one(overrides, tmp_path, capsys):
    # The reward stops the run from inside (SIGTERM to itself) while step 1 is scored: no checkpoint yet.
    reward = tmp_path / "stops.py"
    reward.write_text(
        "import os, signal\n\n"
        "def compute_score(**kwargs):\n    os.kill(os.getpid(), signal.SIGTERM)\n    return 0.0\n"
    )
    run = tmp_path / "run"
    args = overrides(run, f"custom_reward_function.path={reward}", "reward_model.num_workers=0")
    code = main(["train", *args])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 143
    assert err.startswith("tearless: stopped by SIGTERM") and "No checkpoint was saved yet" in err
    assert "intact" not in err
