"""Resume after a hard crash reproduces the uninterrupted run exactly.

How the interruption is made real: the 4-step run is started as a separate process
(``python -m tearless.main_ppo``) whose reward function SIGKILLs its own process (the trainer: with
``reward_model.num_workers=0`` rewards are scored in-process) as soon as it is asked to score
anything after step 3 was logged, that is during step 4. Nothing gets to clean up: no ``finally``,
no closing of files. The last complete checkpoint is step 2 (``save_freq=2``), so the resumed run
must throw away the logged step 3, replay steps 3 and 4 from the step-2 state, and land on exactly
the weights and metrics of a run that was never interrupted. The LR schedule, the number of total
steps and every setting are the same in both runs; only the kill differs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from safetensors.torch import load_file

from tearless import train
from tearless.run.tracking import read_metrics
from tearless.trainers.records import read_records

pytestmark = pytest.mark.slow

REWARD_FILE = textwrap.dedent(
    """
    import json, os, signal
    from pathlib import Path

    from tearless.tasks.arithmetic import compute_score as arithmetic_score


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        kill_after = os.environ.get("TEARLESS_TEST_KILL_AFTER_STEP")
        if kill_after:
            path = Path(os.environ["TEARLESS_TEST_RUN_DIR"]) / "metrics.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            if lines and json.loads(lines[-1])["step"] == int(kill_after):
                os.kill(os.getpid(), signal.SIGKILL)
        return arithmetic_score(solution_str, ground_truth, extra_info)
    """
)


def comparable(record: dict) -> dict:
    """A metrics record without wall-clock numbers and without the sampler-vs-trainer log-prob mismatch
    (``rollout_corr/``, compared separately with :func:`mismatch`)."""
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/", "rollout_corr/"))}


def mismatch(record: dict) -> dict:
    """The ``rollout_corr/`` metrics (~1e-8 to 1e-6 here). The decode loop's one-row matmuls split their
    reductions by thread count, so they depend on it; both runs pin it (``trainer.num_threads=1``:
    the crashed run is another process, with torch's default count, and this process's count is
    whatever earlier tests left), which makes them, like every trained number, bit-identical."""
    return {k: v for k, v in record.items() if k.startswith("rollout_corr/")}


def run_args(overrides, run_dir, reward_file):
    return overrides(
        run_dir,
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # two optimizer steps per RL step
        "data.val_max_samples=20",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",  # lr depends on the step
        "actor_rollout_ref.actor.optim.lr_warmup_steps=1",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "trainer.num_rollout_samples=3",
        "trainer.num_threads=1",  # the same in both processes: see mismatch()
        f"custom_reward_function.path={reward_file}",
    )


@pytest.fixture(scope="module")
def runs(overrides, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    reward_file = root / "reward.py"
    reward_file.write_text(REWARD_FILE)
    full, crashed = root / "uninterrupted", root / "crashed"
    full_summary = train(None, run_args(overrides, full, reward_file), log=lambda _: None)

    env = {**os.environ, "TEARLESS_TEST_KILL_AFTER_STEP": "3", "TEARLESS_TEST_RUN_DIR": str(crashed)}
    proc = subprocess.run(
        [sys.executable, "-m", "tearless.main_ppo", *run_args(overrides, crashed, reward_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    killed = dict(
        returncode=proc.returncode,
        steps=[r["step"] for r in read_metrics(crashed / "metrics.jsonl")],
        checkpoints=sorted(p.name for p in crashed.glob("global_step_*")),
        stderr=proc.stderr,
    )
    resumed_summary = train(None, run_args(overrides, crashed, reward_file), log=lambda _: None)
    return dict(full=full, crashed=crashed, full_summary=full_summary, resumed=resumed_summary, killed=killed)


def test_the_crash_is_a_hard_kill_during_step_4(runs):
    killed = runs["killed"]
    assert killed["returncode"] == -signal.SIGKILL, killed["stderr"][-2000:]
    assert killed["steps"] == [0, 1, 2, 3]  # step 3 was logged, its checkpoint was not written
    assert killed["checkpoints"] == ["global_step_2"]
    assert runs["resumed"]["start_step"] == 2


def test_resumed_weights_equal_the_uninterrupted_run_exactly(runs):
    for step in (2, 4):
        a = load_file(runs["full"] / f"global_step_{step}" / "actor" / "model.safetensors")
        b = load_file(runs["crashed"] / f"global_step_{step}" / "actor" / "model.safetensors")
        assert a.keys() == b.keys()
        different = [k for k in a if not a[k].equal(b[k])]
        assert not different, (step, different)


def test_resumed_metrics_equal_the_uninterrupted_run_and_each_step_is_logged_once(runs):
    full = read_metrics(runs["full"] / "metrics.jsonl")
    resumed = read_metrics(runs["crashed"] / "metrics.jsonl")
    assert [r["step"] for r in full] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    for a, b in zip(full, resumed, strict=True):
        assert comparable(a) == comparable(b), a["step"]
        assert mismatch(a) == mismatch(b), a["step"]  # exactly, with the thread count pinned
    # The cosine schedule really moves (λ = 1, 1, 0.75, 0.25 over the 4 steps), so a scheduler that
    # resume did not restore would restart at λ(0) and change steps 3 and 4.
    lrs = [r["actor/lr"] for r in full[1:]]
    assert len(set(lrs)) > 1
    assert runs["resumed"]["after"] == runs["full_summary"]["after"]


def test_resume_does_not_duplicate_rollout_samples(runs):
    # The killed run wrote step 3's samples before dying; the resumed run replays step 3.
    for run in ("full", "crashed"):
        steps = [r["step"] for r in read_records(runs[run] / "rollouts.jsonl.gz")]
        assert steps == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4], (run, steps)


def test_resuming_a_finished_run_changes_nothing(runs, overrides):
    before = (runs["full"] / "metrics.jsonl").read_text()
    mtime = (runs["full"] / "global_step_4" / "COMPLETE").stat().st_mtime_ns
    again = run_args(overrides, runs["full"], runs["full"].parent / "reward.py")
    summary = train(None, again, log=lambda _: None)
    assert summary["start_step"] == 4 and "after" not in summary
    assert (runs["full"] / "metrics.jsonl").read_text() == before
    assert (runs["full"] / "global_step_4" / "COMPLETE").stat().st_mtime_ns == mtime
