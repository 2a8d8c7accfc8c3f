"""Reward functions that fork, leave processes, write to the pool's pipe, exit or return absurd
values: every answer is matched to its request, no process outlives its sample, and the trainer goes
on (issue 24, item 7: on main a forking function desynchronised the pool and left 87 processes)."""

from __future__ import annotations

import os
import pickle
import stat
import time

import pytest

from tearless import train
from tearless.rewards import RewardError, RewardManager
from tearless.rewards.managers import BatchRewardManager
from tearless.rewards.pool import MAX_ABS_SCORE, check_value
from tearless.rewards.sandbox import SandboxError
from tearless.run.tracking import read_metrics


def item(solution: str, source: str = "test") -> dict:
    return {"data_source": source, "solution_str": solution, "ground_truth": None, "extra_info": {}}


def processes_named(name: str) -> list[int]:
    """Live processes whose name (``/proc/<pid>/comm``) is ``name``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if comm == name and state not in "ZX":
            found.append(int(pid))
    return found


def rename(name: str) -> None:
    import ctypes

    ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME


def forking_scorer(data_source, solution_str, ground_truth, extra_info=None):
    # The child returns too, as if it were the parent: on main it fell back into the worker loop.
    os.fork()
    return float(len(solution_str))


def daemon_scorer(data_source, solution_str, ground_truth, extra_info=None):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            rename("tl-leftover")
            time.sleep(60)
        os._exit(0)
    return float(len(solution_str))


def pipe_writer(data_source, solution_str, ground_truth, extra_info=None):
    # Forge an answer for another sample on the worker's pipe (a socket it inherits).
    if solution_str == "forge":
        from multiprocessing.connection import Connection

        for fd in range(3, 64):
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    Connection(os.dup(fd)).send_bytes(pickle.dumps((999, ("ok", 1.0, {}, None))))
            except OSError:
                continue
    return float(len(solution_str))


@pytest.mark.parametrize(
    ("scorer", "num_workers"),
    # In this process (num_workers=0) a forked child that returns exits at once; what a function
    # leaves running there is the caller's (only workers can kill a sample's leftovers).
    [(forking_scorer, 0), (forking_scorer, 2), (daemon_scorer, 2)],
    ids=["fork-in-process", "fork-workers", "daemon-workers"],
)
def test_a_scorer_that_forks_is_scored_in_order_and_leaves_no_process(scorer, num_workers):
    before = set(processes_named("tl-leftover"))
    with RewardManager(scorer, num_workers=num_workers, timeout_s=10) as manager:
        texts = ["a" * k for k in range(1, 13)]
        for _ in range(2):  # twice: the pool is still in step after the first batch
            results = manager.score([item(t) for t in texts])
            assert [r.score for r in results] == [float(len(t)) for t in texts]
            assert [r.error for r in results] == [None] * len(texts)
        pids = manager.worker_pids
        assert len(pids) == num_workers
    assert set(processes_named("tl-leftover")) - before == set()


def test_an_answer_forged_on_the_pipe_costs_the_worker_not_the_batch():
    with RewardManager(pipe_writer, num_workers=1, timeout_s=10) as manager:
        results = manager.score([item("ab"), item("forge"), item("abcd")])
        # The forged answer names sample 999: the worker is replaced and its sample scored again by a
        # fresh worker, which forges again, so that sample fails; the others are scored.
        assert results[0].score == 2.0 and results[2].score == 4.0
        assert results[1].error is not None and "worker" in results[1].error
        assert manager.lost_workers == 2


def test_absurd_scores_are_failures_and_absurd_extras_dropped():
    assert check_value(1e39)[0] == "err" and "absurd" in check_value(1e39)[1]
    assert check_value(-2e6)[0] == "err"
    assert check_value(MAX_ABS_SCORE) == ("ok", MAX_ABS_SCORE, {}, None)
    assert check_value({"score": 0.5, "big": 1e39, "fine": 3}) == ("ok", 0.5, {"fine": 3.0}, None)


def test_sys_exit_in_the_in_process_manager_is_a_failed_sample():
    def exits(data_source, solution_str, ground_truth, extra_info=None):
        raise SystemExit(3)

    results = RewardManager(exits, num_workers=0).score([item("x")])
    assert results[0].score == 0.0 and results[0].error == "raised: SystemExit: 3"
    batch = BatchRewardManager(lambda data_sources, solution_strs, ground_truths, extra_infos: exit(4))
    assert batch.score([item("x")])[0].error == "raised: SystemExit: 4"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sandbox_that_cannot_start_stops_scoring_instead_of_scoring_zero(num_workers):
    def broken(data_source, solution_str, ground_truth, extra_info=None):
        raise SandboxError("the code sandbox could not isolate the program: unshare: EPERM")

    with RewardManager(broken, num_workers=num_workers) as manager:
        with pytest.raises(RewardError, match="cannot run: the code sandbox could not isolate"):
            manager.score([item("x"), item("y")])


def forking_reward_file(tmp_path):
    path = tmp_path / "forking_reward.py"
    path.write_text(
        "import ctypes, os, time\n"
        "from tearless.tasks import arithmetic\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        if os.fork() == 0:\n"
        "            ctypes.CDLL(None).prctl(15, b'tl-reward-kid', 0, 0, 0)\n"
        "            time.sleep(60)\n"
        "        return 0.0  # the first child returns into its caller, as the attack on main did\n"
        "    return arithmetic.compute_score(solution_str, ground_truth)\n"
    )
    return path


@pytest.mark.slow
def test_a_forking_reward_leaves_no_process_and_the_run_goes_on(overrides, tmp_path):
    summary = train(
        None,
        overrides(
            tmp_path / "run",
            f"custom_reward_function.path={forking_reward_file(tmp_path)}",
            "reward_model.num_workers=2",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
            "data.val_max_samples=4",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
        ),
        log=lambda _: None,
    )
    assert summary["steps"] == 2
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert [r["reward/failures"] for r in records] == [0.0, 0.0]
    assert processes_named("tl-reward-kid") == []
