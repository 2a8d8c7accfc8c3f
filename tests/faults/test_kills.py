"""SIGKILL at chosen points of real training processes; resume must lose nothing and change nothing.

A bounded campaign (four kills, one at each kind of place a crash hurts: while reward workers are
busy, in the middle of writing a checkpoint, between publishing a checkpoint and updating its
pointer, between a checkpoint and its metrics line) followed by a run to the end. After each kill
:func:`chain.check_run_dir` checks the directory; at the end every checkpoint must hold exactly the
weights and optimizer state of an uninterrupted run, and the metrics and rollout samples must be
those of the uninterrupted run, each step once. The long campaign (every point, random kill times)
is ``benchmarks/reliability.py``; its figures are in RELIABILITY.md.
"""

from __future__ import annotations

import pytest

from tearless import faults, train
from tearless.run import checkpoint as ckpt
from tests.faults import chain

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = chain.ForkServer(tmp_path_factory.mktemp("forkserver"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference(task, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train(None, chain.run_args(task, run_dir), log=lambda _: None)
    return run_dir


@pytest.mark.timeout(300)
def test_kills_at_every_dangerous_point_then_resume_equals_the_uninterrupted_run(
    server, task, reference, tmp_path
):
    run_dir = tmp_path / "run"
    attempts = chain.campaign(
        server, task, run_dir, ["reward:1", "checkpoint_write:2"], finish=False, log=lambda _: None
    )
    # The kill in the middle of writing step 2's checkpoint left its hidden temporary directory,
    # which resume must ignore (and the next save removes).
    assert [p.name.split(".tmp-")[0] for p in run_dir.glob(".global_step_*")] == [".global_step_2"]
    assert chain.check_run_dir(run_dir)["latest"] == 1
    # A torn last metrics line (what a full disk or a power cut leaves; one small write is never
    # torn by SIGKILL alone) must not stop the reader, the resume or the final metrics.
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "actor/pg_lo')
    assert chain.check_run_dir(run_dir)["metric_steps"] == [1]
    attempts += chain.campaign(
        server, task, run_dir, ["checkpoint_rename:3", "metrics:4"], log=lambda _: None
    )
    assert [a.returncode for a in attempts] == [-9, -9, -9, -9, 0]
    # checkpoint_rename:3 died with step 3 published but the pointer file still saying 2.
    # metrics:4 died with step 4's checkpoint written and its metrics line not: the line comes back
    # from the checkpoint, and the last attempt trains nothing.
    chain.check_final(run_dir, reference)


def test_the_fault_plan_is_parsed_strictly():
    assert faults.parse("reward:3, checkpoint_write:2,reward:5") == {
        "reward": {3, 5},
        "checkpoint_write": {2},
    }
    assert faults.parse(None) == {} and faults.parse("") == {}
    for bad in ("reward", "nowhere:1", "reward:x"):
        with pytest.raises(ValueError, match="TEARLESS_FAULT"):
            faults.parse(bad)


def test_debris_of_dead_processes_is_removed_and_a_live_process_keeps_its_own(tmp_path):
    import os
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f".global_step_3.tmp-{dead_pid}").mkdir()
    (tmp_path / f".metrics.jsonl.tmp-{dead_pid}").write_text("x")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / f".global_step_4.tmp-{live.pid}").mkdir()
        (tmp_path / "global_step_2").mkdir()
        removed = ckpt.remove_debris(tmp_path)
    finally:
        live.kill()
        live.wait()
    assert sorted(p.name for p in removed) == [
        f".global_step_3.tmp-{dead_pid}",
        f".metrics.jsonl.tmp-{dead_pid}",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".global_step_4.tmp-{live.pid}", "global_step_2"]
    assert os.getpid() != dead_pid


@pytest.mark.timeout(300)
def test_a_real_write_failure_while_saving_is_a_clear_error_and_loses_nothing(
    server, task, reference, tmp_path
):
    # Kill in step 3 (checkpoints 1 and 2 exist), then resume under RLIMIT_FSIZE = 2.5 MB: the weights
    # (1.8 MB) fit, the trainer state (3.5 MB: AdamW moments) does not, so saving step 3 hits a real
    # EFBIG from the kernel, as a full disk would give ENOSPC.
    run_dir = tmp_path / "run"
    chain.campaign(server, task, run_dir, ["reward:3"], finish=False, log=lambda _: None)
    failed = server.attempt(task, run_dir, fsize=2_500_000, expect_error=True)
    message = failed.stderr.strip().splitlines()[-1]
    assert message.startswith("tearless: error: saving checkpoint global_step_3 in ")
    assert "[Errno 27] File too large" in message and "ulimit -f" in message
    assert f"the latest complete checkpoint is still {run_dir / 'global_step_2'}" in message
    assert "Traceback" not in failed.stderr
    state = chain.check_run_dir(run_dir)
    assert state["latest"] == 2 and not list(run_dir.glob(".*global_step_3*"))
    assert (run_dir / ckpt.TRACKER).read_text() == "2"
    # With the limit gone the run resumes from step 2 and ends exactly like the uninterrupted one.
    assert server.attempt(task, run_dir).returncode == 0
    chain.check_final(run_dir, reference)
