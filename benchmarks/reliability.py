"""The figures of RELIABILITY.md: SIGKILL campaigns against real training processes, and a soak run.

1. Named kills: one run of 4 steps killed at every fault point of every step it can still reach
   (rollout, reward, update, checkpoint_write, then checkpoint_rename on odd steps and metrics on
   even ones: 20 kills), resumed with ``trainer.resume_mode=auto`` after each.
2. Random kills: runs of 4 steps, each killed up to ``--kills-per-run`` times at a uniformly random
   moment of an attempt (0.1 s to the median length of a whole run), until ``--random-kills`` kills
   have landed (a kill timed after the run ended lands nowhere and is not counted).
After every kill the run directory is checked (:func:`tests.faults.chain.check_run_dir`); at the end
of every run its checkpoints, metrics and rollout samples must equal an uninterrupted run's exactly.
3. Soak: ``--soak-steps`` steps with the trainer's RSS, its reward workers' RSS, open files and child
   processes measured after every step.
4. ``--bad-inputs``: only the bad-input campaign (:mod:`tests.faults.bad_inputs`): every case as a
   real ``tearless train`` process, classified one-line / traceback / silent / hang, and the counts.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/reliability.py
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/reliability.py --bad-inputs [--cases hostile]

The task is built (or reused) in ``$TEARLESS_TEST_TASK_CACHE`` (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tearless import faults, train
from tearless.tasks.bootstrap import TaskSpec
from tearless.trainers.warmup import prepare_task
from tests.conftest import TASK_SPEC
from tests.faults import chain
from tests.faults.bad_inputs import make_cases, run_case
from tests.faults.soak import growth, soak


def named_plan(steps: int) -> list[str]:
    plan = []
    for step in range(1, steps + 1):
        last = "checkpoint_rename" if step % 2 else "metrics"
        plan += [f"{p}:{step}" for p in ("rollout", "reward", "update", "checkpoint_write", last)]
    assert {p.split(":")[0] for p in plan} == set(faults.POINTS)
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-kills", type=int, default=30, help="random kills that land mid-run")
    parser.add_argument("--kills-per-run", type=int, default=3)
    parser.add_argument("--soak-steps", type=int, default=500, help="0: no soak")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bad-inputs", action="store_true", help="only the bad-input campaign")
    parser.add_argument("--case-limit-s", type=float, default=300.0, help="bad-input case: a hang past it")
    parser.add_argument("--cases", default="", help="bad-input cases whose name contains this text only")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tearless-reliability-"))
    cache = os.environ.get("TEARLESS_TEST_TASK_CACHE") or str(root / "task")
    task = prepare_task(TaskSpec(**TASK_SPEC), cache, log=lambda _: None)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"python {platform.python_version()}"
    )
    if args.bad_inputs:
        bad_inputs(task, root, args.case_limit_s, args.cases)
        return

    reference = root / "uninterrupted"
    train(None, chain.run_args(task, reference), log=lambda _: None)
    server = chain.ForkServer(root)
    started = time.monotonic()
    # The length of a whole attempt (the median of three) bounds the random kill times.
    whole = statistics.median(server.attempt(task, root / f"calibration-{i}").seconds for i in range(3))
    run_dir = root / "named"
    attempts = chain.campaign(server, task, run_dir, named_plan(chain.STEPS), log=lambda _: None)
    chain.check_final(run_dir, reference)
    kills = sum(a.returncode != 0 for a in attempts)
    orphans = sum(len(a.orphans) for a in attempts)
    runs = 1
    print(f"named kills: {kills} (every point of every reachable step), final weights identical")
    random_kills, tried = 0, 0
    while random_kills < args.random_kills:
        run_dir = root / f"random-{runs}"
        attempts = chain.campaign(
            server, task, run_dir, [], args.kills_per_run, seed=args.seed + runs,
            window=(0.1, whole), log=lambda _: None,
        )  # fmt: skip
        chain.check_final(run_dir, reference)
        random_kills += sum(a.returncode != 0 for a in attempts)
        tried += sum(a.fault is not None for a in attempts)
        orphans += sum(len(a.orphans) for a in attempts)
        runs += 1
    server.close()
    print(
        f"random kills: {random_kills} landed of {tried} tried (the rest came after the run ended), "
        f"window 0.1-{whole:.1f} s, {runs - 1} runs, final weights identical in every run"
    )
    print(f"kills survived: {kills + random_kills} in {runs} runs, {time.monotonic() - started:.0f} s; "
          f"reward workers outliving a killed trainer: {orphans}")  # fmt: skip
    if not args.soak_steps:
        return
    series = soak(task, root / "soak", args.soak_steps)
    warmup = max(args.soak_steps // 10, 5)
    rss = series["rss_mb"]
    print(
        f"soak {args.soak_steps} steps: trainer RSS {rss[warmup]:.1f} MiB after warm-up (step {warmup}), "
        f"{statistics.median(rss[-10:]):.1f} MiB at the end (growth {growth(rss, warmup):+.1f} MiB, "
        f"max {max(rss):.1f}); reward workers {growth(series['workers_rss_mb'], warmup):+.1f} MiB; "
        f"open files {int(min(series['fds']))}-{int(max(series['fds']))}; "
        f"reward processes {sorted({int(c) for c in series['children']})}"
    )


def bad_inputs(task, root: Path, limit_s: float, matching: str = "") -> None:
    """Run every bad-input case (whose name contains ``matching``); one line per case, then the counts."""
    counts: dict[str, int] = {"one-line": 0, "traceback": 0, "silent": 0, "hang": 0}
    cases = [c for c in make_cases(task, root / "inputs") if matching in c.name]
    for i, case in enumerate(cases):
        kind, last, seconds = run_case(case, task, root / f"case-{i}", limit_s)
        counts[kind] += 1
        print(f"{kind:9} {seconds:6.1f} s  {case.name}: {last}", flush=True)
    print(
        f"bad inputs tried: {len(cases)}; one-line errors {counts['one-line']}, tracebacks "
        f"{counts['traceback']}, silent {counts['silent']}, hangs {counts['hang']}"
    )


if __name__ == "__main__":
    main()
