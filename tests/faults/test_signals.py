"""Nothing outlives the trainer (issue 33, items 1 and 11): a signal to ``tearless train`` while a reward
function hangs leaves no process of the run behind and the run directory's lock free.

On main, SIGTERM or SIGKILL to the trainer during a slow reward left both reward workers alive
(they looked for their parent only between samples) and holding the run lock (forked after it was
taken, they shared its open file description), so the resume was refused naming the dead trainer.
Now the workers die with their parent (a parent-death signal, and a watchdog) and close the lock in
the child; SIGTERM is handled like SIGINT (the pool closed, Ray shut down), exit code 143.

Every check is scoped to the processes this test started: the trainer and its descendants, found
through /proc before the signal. Waits poll a condition with a generous deadline (the machine may be
loaded by other sessions), never a bare sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tearless.trainers import runlock
from tearless.workers.reaper import descendants

pytestmark = pytest.mark.slow

HANG = """
import os, time
from pathlib import Path

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    Path(os.environ["TEARLESS_TEST_HANG_DIR"], f"scoring-{os.getpid()}").touch()
    time.sleep(3600)
    return 0.0
"""
START_S = 600  # a trainer's start-up and first rollout on a loaded 2-core machine
GONE_S = 60


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; its parent (init here) reaps it


def wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def start_trainer(args: list[str], hang_dir: Path, stderr: Path) -> subprocess.Popen:
    # stderr to a file, not a pipe: a surviving worker would hold a pipe open and hang the reader.
    env = {**os.environ, "TEARLESS_TEST_HANG_DIR": str(hang_dir)}
    with open(stderr, "w") as err:
        return subprocess.Popen(
            [sys.executable, "-c", "import sys; from tearless.cli import main; sys.exit(main(sys.argv[1:]))",
             "train", *args],
            stdout=subprocess.DEVNULL, stderr=err, env=env,
        )  # fmt: skip


def interrupt_a_hung_reward(args: list[str], tmp_path: Path, sig: int) -> tuple[int, str, set[int]]:
    """Start the trainer, wait until a reward worker is inside the hung reward, record the trainer's
    descendants, send ``sig``; return the exit code, stderr and the recorded pids."""
    hang_dir, stderr = tmp_path / "hang", tmp_path / "stderr.txt"
    hang_dir.mkdir()
    trainer = start_trainer(args, hang_dir, stderr)
    started: set[int] = set()
    try:
        wait_until(
            lambda: any(hang_dir.iterdir()) or trainer.poll() is not None, START_S, "no reward call started"
        )
        assert trainer.poll() is None, stderr.read_text()
        started = descendants(trainer.pid)
        scoring = {int(p.name.split("-")[1]) for p in hang_dir.iterdir()}
        assert scoring <= started, (scoring, started)
        trainer.send_signal(sig)
        trainer.wait(timeout=300)
        wait_until(lambda: not any(alive(p) for p in started), GONE_S,
                   f"left alive: {sorted(p for p in started if alive(p))}")  # fmt: skip
        return trainer.returncode, stderr.read_text(), started
    finally:
        for p in [trainer.pid, *started]:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        trainer.wait()


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGKILL, -signal.SIGKILL)]
)
def test_no_reward_worker_outlives_the_trainer_and_the_lock_is_free(overrides, tmp_path, sig, code):
    hang = tmp_path / "hang.py"
    hang.write_text(HANG)
    run = tmp_path / "run"
    args = overrides(
        run, "trainer.val_before_train=false", "trainer.total_training_steps=2",
        f"custom_reward_function.path={hang}", "reward_model.num_workers=2", "reward_model.timeout_s=3600",
    )  # fmt: skip
    returncode, err, started = interrupt_a_hung_reward(args, tmp_path, sig)
    assert returncode == code, err
    assert len(started) >= 2  # the two reward workers at least
    if sig != signal.SIGKILL:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tearless: stopped by SIG"), err
    runlock.acquire(run).release()  # free: no survivor holds it


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGKILL, -signal.SIGKILL)]
)
def test_on_ray_nothing_outlives_the_driver_and_the_lock_is_free(overrides, tmp_path, sig, code):
    """The same on the Ray placement (two CPU ranks, each with its reward workers): the driver's
    descendants (the local Ray cluster it started, the rank actors, their reward workers) all end.
    Item 11: after SIGTERM the driver printed Ray's C++ stack dump and exited -6; now 143 and one
    line of its own."""
    pytest.importorskip("ray")
    hang = tmp_path / "hang.py"
    hang.write_text(HANG)
    run = tmp_path / "run"
    repo = Path(__file__).resolve().parents[2]
    args = overrides(
        run, "trainer.val_before_train=false", "trainer.total_training_steps=2",
        f"custom_reward_function.path={hang}", "reward_model.num_workers=2", "reward_model.timeout_s=3600",
        "trainer.placement=ray", "trainer.n_gpus_per_node=2", "trainer.num_threads=1", "ray_init.num_cpus=2",
        "trainer.worker_timeout_s=900", f"ray_init.runtime_env.env_vars.PYTHONPATH={repo}",
        f"ray_init.runtime_env.env_vars.TEARLESS_TEST_HANG_DIR={tmp_path / 'hang'}",
    )  # fmt: skip
    returncode, err, started = interrupt_a_hung_reward(args, tmp_path, sig)
    assert returncode == code, err
    assert len(started) >= 6  # Ray's own processes, two rank actors, their reward workers
    if sig != signal.SIGKILL:
        assert err.strip().splitlines()[-1].startswith(f"tearless: stopped by {signal.Signals(sig).name}"), (
            err
        )
        assert "Stack trace" not in err and "*** SIG" not in err, err
    runlock.acquire(run).release()
