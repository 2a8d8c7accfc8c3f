"""A long tiny run with resident memory, open files and child processes measured after every step.

Leaks in rollout buffers, logger queues or the reward process pool show as growth after the warm-up
(allocator caches, lazily imported modules and the first checkpoint fill the first steps). Used by
``tests/faults/test_soak.py`` (a bounded run in CI) and ``benchmarks/reliability.py`` (500 steps).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from tearless import cli
from tearless.config import load_config
from tearless.trainers.rl import RLTrainer

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_mb(pid: int | str = "self") -> float:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE / 2**20
    except OSError:  # it exited between the listing and the read
        return 0.0


def _children() -> list[int]:
    """This process's live children, less the training commands' reaper (tearless.cli starts one per
    process, for the whole test session, when a test runs a command in-process)."""
    pid = os.getpid()
    reapers = {p.pid for p in cli._reaper if p is not None}
    children = map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    return [c for c in children if c not in reapers]


def soak(task, run_dir: Path, steps: int) -> dict[str, list[float]]:
    """Train ``steps`` steps; per step: the trainer's RSS, its reward workers' summed RSS (MiB), open
    file descriptors and live child processes."""
    save = max(steps // 5, 1)
    cfg = load_config(
        None,
        [
            f"actor_rollout_ref.model.path={task.model_dir}",
            f"data.train_files={task.train_file}",
            f"data.val_files={task.val_file}",
            f"trainer.default_local_dir={run_dir}",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "data.max_response_length=8",
            "data.val_max_samples=4",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "trainer.val_before_train=false",
            "trainer.logger=[jsonl]",
            f"trainer.total_training_steps={steps}",
            f"trainer.save_freq={save}",
            "trainer.max_actor_ckpt_to_keep=2",
            "trainer.num_rollout_samples=2",
            "trainer.num_threads=1",
            "reward_model.num_workers=2",
        ],
    )
    trainer = RLTrainer(cfg, log=lambda _: None)
    series: dict[str, list[float]] = {"rss_mb": [], "workers_rss_mb": [], "fds": [], "children": []}
    step_fn = trainer.train_step

    def measured(step: int) -> dict[str, float]:
        metrics = step_fn(step)
        children = _children()
        series["rss_mb"].append(_rss_mb())
        series["workers_rss_mb"].append(sum(_rss_mb(c) for c in children))
        series["fds"].append(float(len(os.listdir("/proc/self/fd"))))
        series["children"].append(float(len(children)))
        return metrics

    trainer.train_step = measured
    trainer.fit()
    return series


def growth(values: list[float], warmup: int) -> float:
    """Median of the last 10 values minus the median of the 10 after ``warmup``."""
    return statistics.median(values[-10:]) - statistics.median(values[warmup : warmup + 10])
