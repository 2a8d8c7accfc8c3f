"""A run directory is one run's (issue 24, items 4, 5, 6, 8): a second trainer is refused naming the
first's pid, a resume into another run or with unannounced changes is refused naming the keys, an
allowed change really takes effect, a damaged newest checkpoint is reported and the previous one
used, and a step that breaks the weights stops the run with the step and the fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tearless.cli import main as cli
from tearless.config import load_config
from tearless.config.resume_compat import ResumeMismatch
from tearless.run.tracking import read_metrics
from tearless.trainers import runlock
from tearless.trainers.rl import RLTrainer

pytestmark = pytest.mark.slow
QUICK = ["trainer.val_before_train=false", "data.val_max_samples=4", "trainer.save_freq=1"]


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = cli(["train", *args])
    return code, capsys.readouterr().err


def test_a_second_trainer_on_the_directory_is_refused_naming_the_first(overrides, tmp_path, capsys):
    run = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tearless.cli import main; sys.exit(main(sys.argv[1:]))",
         "train", *overrides(run, *QUICK, "trainer.total_training_steps=500")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        lock = run / runlock.LOCK_FILE
        deadline = time.monotonic() + 120
        while not (lock.exists() and f'"pid": {first.pid}' in lock.read_text()):
            assert first.poll() is None and time.monotonic() < deadline, "the first trainer did not start"
            time.sleep(0.2)
        code, err = run_cli(overrides(run, *QUICK, "trainer.total_training_steps=2"), capsys)
        assert code == 1
        assert f"another trainer is using {run}: pid {first.pid}" in err
        assert len(err.strip().splitlines()) == 1
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The killed trainer's lock went with it: the next trainer resumes from its newest checkpoint.
    steps_done = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    code, err = run_cli(
        overrides(run, *QUICK, f"trainer.total_training_steps={max(steps_done, default=0) + 1}"), capsys
    )
    assert code == 0, err


def test_resume_is_refused_into_another_run_and_without_leave_to_change_the_optimisation(
    overrides, task, tmp_path, capsys
):
    run = tmp_path / "run"
    base = overrides(run, *QUICK, "trainer.experiment_name=mine")
    assert run_cli([*base, "trainer.total_training_steps=1"], capsys)[0] == 0
    # Other data: another run, refused whatever resume_allow_changes says.
    copy = tmp_path / "other.parquet"
    copy.write_bytes(Path(task.train_file).read_bytes())
    code, err = run_cli([*base, "trainer.total_training_steps=2", f"data.train_files={copy}",
                         "trainer.resume_allow_changes=[data.train_files]"], capsys)  # fmt: skip
    assert code == 1
    assert "it belongs to another run" in err and f"data.train_files: {json.dumps(task.train_file)}" in err
    assert "trainer.experiment_name=" in err
    # A new learning rate: refused unless listed; it was silently ignored on main.
    code, err = run_cli(
        [*base, "trainer.total_training_steps=2", "actor_rollout_ref.actor.optim.lr=0.0002"], capsys
    )
    assert code == 1
    assert "actor_rollout_ref.actor.optim.lr: 0.0001 in the checkpoint, 0.0002 now" in err
    assert "trainer.resume_allow_changes=[actor_rollout_ref.actor.optim.lr]" in err
    # Listed: the restored optimizer takes it (constant schedule: lr = base lr), and config.json says so.
    lr = "actor_rollout_ref.actor.optim.lr"
    cfg = load_config(
        None,
        [*base, "trainer.total_training_steps=2", f"{lr}=0.0002", f"trainer.resume_allow_changes=[{lr}]"],
    )
    trainer = RLTrainer(cfg, log=lambda _: None)
    assert trainer.start_step == 1
    assert [g["lr"] for g in trainer.workers.rank.roles["actor"].optimizer.param_groups] == [0.0002]
    assert trainer.workers.rank.roles["actor"].scheduler.base_lrs == [0.0002]
    trainer.fit()
    saved = json.loads((run / "config.json").read_text())
    assert saved["actor_rollout_ref"]["actor"]["optim"]["lr"] == 0.0002
    # The step-2 checkpoint records the rate it trained with; more steps and other logging are
    # bookkeeping, free to change.
    code, err = run_cli(
        [
            *base,
            "trainer.total_training_steps=3",
            "trainer.log_freq=1",
            "actor_rollout_ref.actor.optim.lr=0.0002",
        ],
        capsys,
    )
    assert code == 0, err


def test_default_run_directories_differ_between_the_quick_start_and_another_model(task):
    quick = load_config(None, [])
    paths = [f"actor_rollout_ref.model.path={task.model_dir}", f"data.train_files={task.train_file}"]
    own = load_config(None, [*paths, f"data.val_files={task.val_file}"])
    assert quick.trainer.default_local_dir == "runs/tearless/arithmetic-grpo"
    assert own.trainer.experiment_name.startswith("model-train-grpo-")
    assert quick.trainer.default_local_dir != own.trainer.default_local_dir
    rloo = load_config(None, ["algorithm.adv_estimator=rloo"])
    assert rloo.trainer.experiment_name == "arithmetic-rloo"


def test_a_flipped_bit_in_the_newest_checkpoint_is_detected_and_the_previous_one_used(overrides, tmp_path):
    run = tmp_path / "run"
    base = overrides(run, *QUICK)
    cfg = load_config(None, [*base, "trainer.total_training_steps=2"])
    RLTrainer(cfg, log=lambda _: None).fit()
    weights = run / "global_step_2" / "actor" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit of a weight, far from the header
    weights.write_bytes(bytes(data))
    logs: list[str] = []
    trainer = RLTrainer(load_config(None, [*base, "trainer.total_training_steps=3"]), log=logs.append)
    assert trainer.start_step == 1
    assert any(
        "global_step_2 is damaged" in line and "model.safetensors does not match" in line for line in logs
    )
    expected = torch.load(run / "global_step_1" / "trainer_state.pt", weights_only=True)["global_step"]
    assert expected == 1
    trainer.fit()
    assert sorted(p.name for p in run.glob("global_step_*")) == [
        "global_step_1",
        "global_step_2",
        "global_step_3",
    ]
    # A missing file of the newest: reported and skipped the same way.
    (run / "global_step_3" / "trainer_state.pt").unlink()
    logs.clear()
    trainer = RLTrainer(load_config(None, [*base, "trainer.total_training_steps=4"]), log=logs.append)
    assert trainer.start_step == 2
    assert any("trainer_state.pt is missing" in line for line in logs)


def test_an_update_that_breaks_the_weights_stops_the_run_naming_the_step(overrides, tmp_path, capsys):
    run = tmp_path / "run"
    code, err = run_cli(overrides(run, *QUICK, "trainer.total_training_steps=3",
                                  "actor_rollout_ref.actor.optim.lr=1e10"), capsys)  # fmt: skip
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "step 1: the actor's weights (or its logits) are NaN or infinite" in err
    assert "Lower actor_rollout_ref.actor.optim.lr" in err
    assert not list(run.glob("global_step_*"))  # nothing of the broken step was saved


def test_bad_reward_files_data_sources_and_unwritable_run_dirs_are_one_line_errors(
    overrides, task, tmp_path, capsys
):
    broken = tmp_path / "broken_reward.py"
    broken.write_text("RATE = 1 / 0\n")
    code, err = run_cli(overrides(tmp_path / "a", *QUICK, f"custom_reward_function.path={broken}"), capsys)
    assert code == 1 and err.startswith("tearless: error: custom_reward_function.path=")
    assert "ZeroDivisionError" in err and len(err.strip().splitlines()) == 1
    rows = pq.read_table(task.train_file).to_pylist()[:16]
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text("".join(json.dumps({**row, "data_source": "no-such-source"}) + "\n" for row in rows))
    code, err = run_cli(overrides(tmp_path / "b", *QUICK, f"data.train_files={unknown}"), capsys)
    assert code == 1 and "no built-in reward function for data_source 'no-such-source'" in err
    assert len(err.strip().splitlines()) == 1
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err = run_cli(overrides(blocker / "run", *QUICK), capsys)
    assert code == 1 and "cannot use the run directory" in err and len(err.strip().splitlines()) == 1


def test_disk_full_while_training_is_one_line(overrides, tmp_path, capsys, monkeypatch):
    def full(self):
        raise OSError(28, "No space left on device", str(tmp_path / "metrics.jsonl"))

    monkeypatch.setattr(RLTrainer, "fit", full)
    code, err = run_cli(overrides(tmp_path / "run", *QUICK), capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1
    # fit failed before any checkpoint: the line says so instead of claiming an intact one.
    assert "No space left on device" in err and "No checkpoint was saved yet" in err


def test_resume_refuses_a_model_or_data_file_rewritten_at_the_same_path(task, overrides, tmp_path):
    """Issue 33, item 4: resume compared paths only, so replacing the model's safetensors (the KL
    reference is loaded from it) or rewriting the parquet in place trained on the new files without
    a word. The checkpoint now keeps each file's size and content hash; a touch alone is no change."""
    import shutil

    model, data = tmp_path / "model", tmp_path / "train.parquet"
    shutil.copytree(task.model_dir, model)
    shutil.copy(task.train_file, data)
    run = tmp_path / "run"
    base = [*overrides(run, *QUICK), f"actor_rollout_ref.model.path={model}", f"data.train_files={data}"]
    RLTrainer(load_config(None, [*base, "trainer.total_training_steps=1"]), log=lambda _: None).fit()
    resumed = load_config(None, [*base, "trainer.total_training_steps=2"])

    weights = model / "model.safetensors"
    original = weights.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x10
    weights.write_bytes(bytes(flipped))
    with pytest.raises(ResumeMismatch, match=rf"actor_rollout_ref.model.path: {weights} changed \(same size"):
        RLTrainer(resumed, log=lambda _: None)
    weights.write_bytes(original)

    rows = pq.read_table(data).to_pylist()
    pq.write_table(pa.Table.from_pylist(rows[1:] + rows[:1]), data)  # the same rows, rewritten in place
    with pytest.raises(ResumeMismatch, match=rf"data.train_files: {data} changed"):
        RLTrainer(resumed, log=lambda _: None)
    shutil.copy(task.train_file, data)

    os.utime(weights)  # a touch: the same content
    assert RLTrainer(resumed, log=lambda _: None).start_step == 1
