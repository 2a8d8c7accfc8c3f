"""Crash campaigns: a short training run killed with SIGKILL again and again, resumed each time.

Each attempt is a real training process (``tearless train …``, forked from a process that has
imported torch already, see :mod:`tests.faults.forkserver`) on the session task. It dies either at
a named point (``TEARLESS_FAULT=<point>:<step>``, see :mod:`tearless.faults`) or at a random moment
chosen by this process, which then SIGKILLs it. After every death :func:`check_run_dir` checks what a
resume may rely on; the next attempt resumes with ``trainer.resume_mode=auto``. When an attempt
finally completes, its checkpoints must hold exactly the weights of an uninterrupted run.

Used by ``tests/faults/test_kills.py`` (a bounded campaign in CI) and ``benchmarks/reliability.py``
(the long campaign whose figures are in RELIABILITY.md).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from tearless.run import checkpoint as ckpt
from tearless.run.tracking import read_metrics
from tearless.trainers import runlock
from tearless.trainers.records import read_records

STEPS = 4
REPO = Path(__file__).resolve().parents[2]


def run_args(task, run_dir: Path, *, steps: int = STEPS) -> list[str]:
    """A run that reaches every fault point within a second or two of start-up: 4 prompts × 2
    responses, two optimizer steps per RL step (so the optimizer state matters), a cosine schedule
    (so the scheduler state matters), a KL loss (so the reference model loads), a checkpoint every
    step, two reward worker processes, three rollout samples per step."""
    return [
        f"actor_rollout_ref.model.path={task.model_dir}",
        f"data.train_files={task.train_file}",
        f"data.val_files={task.val_file}",
        f"trainer.default_local_dir={run_dir}",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.max_response_length=8",
        "data.val_max_samples=4",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=null",  # every step's checkpoint is compared
        "trainer.num_rollout_samples=3",
        "trainer.num_threads=1",
        "reward_model.num_workers=2",
    ]


@dataclass
class Attempt:
    fault: str | None  # "<point>:<step>", "random@<seconds>" or None (run to the end)
    returncode: int
    seconds: float
    orphans: list[int] = field(default_factory=list)  # reward workers still alive 3 s after the kill
    stderr: str = ""


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class ForkServer:
    """The campaign's process factory (:mod:`tests.faults.forkserver`), started once, used per attempt."""

    def __init__(self, workdir: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        env.pop("TEARLESS_FAULT", None)
        self.workdir = workdir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.forkserver"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def attempt(self, task, run_dir: Path, fault: str | None = None, kill_after: float | None = None,
                *, steps: int = STEPS, timeout: float = 300, fsize: int | None = None,
                expect_error: bool = False) -> Attempt:  # fmt: skip
        """One training process: with ``fault`` it kills itself there; with ``kill_after`` this process
        SIGKILLs it after that many seconds (if it is still running). Reward workers it had forked are
        watched: they must exit on their own once it is gone. With ``fsize`` its writes fail past
        that many bytes; ``expect_error``: it must then stop with exit code 1 (a clear error)."""
        stderr = self.workdir / "attempt.stderr"
        request = {
            "args": run_args(task, run_dir, steps=steps),
            "fault": fault,
            "stderr": str(stderr),
            "fsize": fsize,
        }
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        started = time.monotonic()
        pid = json.loads(self.proc.stdout.readline())["pid"]
        children: set[int] = set()
        deadline = started + (kill_after if kill_after is not None else timeout)
        while _alive(pid) and time.monotonic() < deadline:
            children.update(_children(pid))
            time.sleep(0.02)
        if _alive(pid):
            children.update(_children(pid))
            os.kill(pid, signal.SIGKILL)
        returncode = json.loads(self.proc.stdout.readline())["status"]
        seconds = time.monotonic() - started
        if returncode not in ((1,) if expect_error else (0, -signal.SIGKILL)):
            raise AssertionError(
                f"attempt {fault or kill_after} failed ({returncode}):\n{stderr.read_text()[-3000:]}"
            )
        orphans = []
        if returncode != 0:
            # A reward worker checks for its parent once a second and then exits.
            limit = time.monotonic() + 3.0
            while time.monotonic() < limit and any(_alive(c) for c in children):
                time.sleep(0.1)
            orphans = [c for c in children if _alive(c)]
        label = fault if fault else (f"random@{kill_after:.2f}s" if kill_after is not None else None)
        return Attempt(label, returncode, seconds, orphans, stderr.read_text())

    def close(self) -> None:
        # It holds nothing between attempts; killing it skips a slow interpreter shutdown.
        self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait(timeout=30)


def check_run_dir(run_dir: Path) -> dict:
    """What resume relies on after a crash: every ``global_step_N`` that has the marker is a whole,
    loadable checkpoint (weights_only state, safetensors weights, the step it claims), the directory
    that resume would pick is one of them, and ``metrics.jsonl`` parses up to at most a torn last line.
    Returns the latest complete step and the metrics steps."""
    complete = ckpt.complete_checkpoints(run_dir)
    for path in complete:
        state = ckpt.load_state(path)  # weights_only=True
        step = int(path.name.rsplit("_", 1)[1])
        assert state["global_step"] == step, path
        weights = load_file(path / "actor" / "model.safetensors")
        assert weights and all(torch.isfinite(w).all() for w in weights.values()), path
        assert (path / "actor" / "config.json").is_file() and (path / "actor" / "tokenizer.json").is_file()
    for path in run_dir.glob("global_step_*"):
        # Nothing half-written ever carries a step directory's name: saves go to hidden names first.
        assert (path / ckpt.MARKER).is_file(), f"{path} has a step name but no marker"
    latest = ckpt.latest_checkpoint(run_dir)
    assert latest == (complete[-1] if complete else None)
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    for i, line in enumerate(lines):
        try:
            json.loads(line)
        except json.JSONDecodeError:
            assert i == len(lines) - 1, f"line {i + 1} of {metrics} is torn and is not the last"
    return {
        "latest": int(latest.name.rsplit("_", 1)[1]) if latest else 0,
        "metric_steps": [r["step"] for r in read_metrics(metrics)],
    }


def different_weights(a: Path, b: Path) -> list[str]:
    """Names of the tensors that differ between two checkpoints' actor weights (empty: identical)."""
    wa = load_file(a / "actor" / "model.safetensors")
    wb = load_file(b / "actor" / "model.safetensors")
    assert wa.keys() == wb.keys()
    return [k for k in wa if not wa[k].equal(wb[k])]


def comparable(record: dict) -> dict:
    """A metrics record without wall-clock numbers."""
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/"))}


def check_final(run_dir: Path, reference: Path, steps: int = STEPS) -> None:
    """The campaign's run ended where the uninterrupted one did, with the same weights at every
    checkpoint, the same metrics (each step once) and the same rollout samples, and no debris."""
    for step in range(1, steps + 1):
        name = f"global_step_{step}"
        assert not different_weights(reference / name, run_dir / name), name
        a, b = ckpt.load_state(reference / name), ckpt.load_state(run_dir / name)
        assert _equal(a["workers"], b["workers"]), name  # schedules and skipped-step counts
        assert _equal(optimizer_state(reference / name), optimizer_state(run_dir / name)), name
    full, resumed = read_metrics(reference / "metrics.jsonl"), read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    for x, y in zip(full, resumed, strict=True):
        assert comparable(x) == comparable(y), x["step"]
    assert read_records(reference / "rollouts.jsonl.gz") == read_records(run_dir / "rollouts.jsonl.gz")
    assert (run_dir / ckpt.TRACKER).read_text() == str(steps)
    # The run lock's file stays (a lock file deleted on release would race the next taker).
    hidden = [p.name for p in run_dir.iterdir() if p.name.startswith(".") and p.name != runlock.LOCK_FILE]
    assert not hidden, "debris left behind"


def optimizer_state(checkpoint: Path) -> dict:
    """Everything under a checkpoint's ``optim/``: each role's index and shard tensors."""
    from safetensors.torch import load_file

    state = {}
    for path in sorted((checkpoint / "optim").rglob("*")):
        if path.suffix == ".safetensors":
            state[str(path.relative_to(checkpoint))] = load_file(path)
        elif path.suffix == ".json":
            state[str(path.relative_to(checkpoint))] = json.loads(path.read_text())
    return state


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.equal(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def campaign(
    server: ForkServer,
    task,
    run_dir: Path,
    faults: list[str],
    random_kills: int = 0,
    *,
    seed: int = 0,
    window: tuple[float, float] = (4.0, 9.0),
    steps: int = STEPS,
    finish: bool = True,
    log=print,
) -> list[Attempt]:
    """Kill a run at each of ``faults`` in turn, then ``random_kills`` times at a random moment in
    ``window`` seconds after start, checking the directory after every death; then (``finish``) let it
    run to the end.
    Raises on the first broken invariant; returns the attempts."""
    rng = random.Random(seed)
    attempts = []
    plan = [(f, None) for f in faults] + [(None, rng.uniform(*window)) for _ in range(random_kills)]
    for fault, kill_after in plan:
        before = check_run_dir(run_dir) if run_dir.exists() else {"latest": 0}
        attempt = server.attempt(task, run_dir, fault, kill_after, steps=steps)
        state = check_run_dir(run_dir)
        assert state["latest"] >= before["latest"], (attempt, before, state)  # no progress is ever lost
        assert not attempt.orphans, f"reward workers {attempt.orphans} outlived their trainer"
        if fault:
            assert attempt.returncode == -signal.SIGKILL, f"{fault} was never reached"
        attempts.append(attempt)
        log(f"{attempt.fault}: exit {attempt.returncode} after {attempt.seconds:.1f} s, latest checkpoint "
            f"{state['latest']}, metrics of steps {state['metric_steps']}")  # fmt: skip
        if attempt.returncode == 0:
            return attempts  # a random kill that came after the end: the run is complete
    if finish:
        final = server.attempt(task, run_dir, steps=steps)
        assert final.returncode == 0, final
        attempts.append(final)
    return attempts
