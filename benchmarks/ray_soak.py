"""Ray soak: a long tiny run on two Ray CPU ranks with every process's resident memory per step.

Settles whether the Ray ranks leak (RELIABILITY.md: ~0.07 MiB/step after step 54 of a 150-step run
was seen once). After every step it appends one JSON line to ``--out``: the step, the driver's RSS,
each rank's RSS (the pids are read from the run's ``workers_*.json``), the driver's open files and the
wall time, so a run cut short still says how far it got. At the end (and with ``--summarise`` on a
partial file) it prints, per process, the least-squares slope of RSS over the steps after the
warm-up (a tenth of the run), in MiB per step, and the growth: the median of the last 50 steps minus
the median of the 50 after the warm-up.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/ray_soak.py --steps 1000 --out soak.jsonl
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/ray_soak.py --rank-env MALLOC_ARENA_MAX=2 ...
    PYTHONPATH=$PWD python benchmarks/ray_soak.py --summarise soak.jsonl

Not run by CI (hours on a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tearless.config import load_config
from tearless.tasks.bootstrap import TaskSpec
from tearless.trainers.rl import RLTrainer
from tearless.trainers.warmup import prepare_task
from tests.conftest import TASK_SPEC

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb(pid: int | str) -> float | None:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE / 2**20
    except (OSError, ValueError, IndexError):  # gone
        return None


def heap(_actor: object = None) -> dict[str, float]:
    """What a process holds beyond its pages (run in a rank through ``__ray_call__``): Python's
    allocated blocks and tracked objects, and glibc's heap: bytes in use by live allocations
    (``uordblks`` + ``hblkhd``, mmapped) against bytes held (``arena`` + ``hblkhd``); held minus in use
    is free memory the allocator keeps (fragmentation)."""
    import ctypes
    import gc

    class Mallinfo2(ctypes.Structure):  # defined here: a ctypes class does not pickle into the rank
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
            "keepcost",
        )]  # fmt: skip

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2
    m = libc.mallinfo2()
    return {
        "py_blocks": sys.getallocatedblocks(),
        "gc_objects": len(gc.get_objects()),
        "malloc_in_use_mb": (m.uordblks + m.hblkhd) / 2**20,
        "malloc_held_mb": (m.arena + m.hblkhd) / 2**20,
    }


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``: Σ(x-x̄)(y-ȳ) / Σ(x-x̄)²."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def summarise(rows: list[dict]) -> str:
    if len(rows) < 20:
        return f"{len(rows)} steps: too few to fit"
    warmup = max(len(rows) // 10, 5)
    window = min(50, (len(rows) - warmup) // 2)
    lines = [f"{len(rows)} steps (warm-up {warmup}), {rows[-1]['wall_s'] / 3600:.2f} h"]
    for name in ["driver", *sorted(k for k in rows[-1] if k.startswith("rank"))]:
        pts = [(r["step"], r[name]) for r in rows[warmup:] if r.get(name) is not None]
        xs, ys = [float(p[0]) for p in pts], [p[1] for p in pts]
        grown = statistics.median(ys[-window:]) - statistics.median(ys[:window])
        lines.append(
            f"  {name}: {ys[0]:.1f} -> {ys[-1]:.1f} MiB, "
            f"slope {slope(xs, ys) * 1000:+.2f} MiB per 1000 steps, "
            f"growth {grown:+.2f} MiB (median of last {window} - median of first {window} after warm-up)"
        )
    fds = [r["fds"] for r in rows[warmup:]]
    lines.append(f"  driver open files {min(fds)}-{max(fds)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=Path("ray_soak.jsonl"))
    parser.add_argument("--summarise", type=Path, help="only print the summary of an existing file")
    parser.add_argument(
        "--rank-env", action="append", default=[], metavar="KEY=VALUE",
        help="an environment variable of the rank processes (e.g. MALLOC_ARENA_MAX=2); repeatable",
    )  # fmt: skip
    args = parser.parse_args()
    if args.summarise:
        rows = [json.loads(line) for line in args.summarise.read_text().splitlines() if line.strip()]
        print(summarise(rows))
        return
    root = Path(tempfile.mkdtemp(prefix="tearless-ray-soak-"))
    cache = os.environ.get("TEARLESS_TEST_TASK_CACHE") or str(root / "task")
    task = prepare_task(TaskSpec(**TASK_SPEC), cache, log=lambda _: None)
    run_dir = root / "run"
    repo = str(Path(__file__).resolve().parents[1])
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
            "actor_rollout_ref.actor.use_kl_loss=true",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.logger=[jsonl]",
            f"trainer.total_training_steps={args.steps}",
            f"trainer.save_freq={max(args.steps // 5, 1)}",
            "trainer.max_actor_ckpt_to_keep=2",
            "trainer.num_rollout_samples=2",
            "trainer.num_threads=1",
            "trainer.placement=ray",
            "trainer.n_gpus_per_node=2",
            "trainer.worker_timeout_s=600",
            "ray_init.num_cpus=2",
            f"ray_init.runtime_env.env_vars.PYTHONPATH={repo}",
            *(f"ray_init.runtime_env.env_vars.{kv}" for kv in args.rank_env),
        ],
    )
    trainer = RLTrainer(cfg, log=lambda _: None)
    step_fn = trainer.train_step
    started = time.monotonic()
    out = args.out.open("a")

    def measured(step: int) -> dict[str, float]:
        metrics = step_fn(step)
        row: dict = {"step": step, "wall_s": round(time.monotonic() - started, 1), "driver": rss_mb("self")}
        for path in sorted(run_dir.glob("workers_*.json")):
            for w in json.loads(path.read_text()):
                row[f"rank{w['rank']}_{path.stem[8:]}"] = rss_mb(w["pid"])
        row["fds"] = len(os.listdir("/proc/self/fd"))
        if step % 100 == 1:  # the ranks' heaps, every 100 steps
            import ray

            for name, pool in trainer.workers.pools.items():
                for r, handle in enumerate(pool.handles):
                    row[f"heap_{name}{r}"] = ray.get(handle.__ray_call__.remote(heap))
        out.write(json.dumps(row) + "\n")
        out.flush()
        return metrics

    trainer.train_step = measured
    trainer.fit()
    out.close()
    print(summarise([json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]))


if __name__ == "__main__":
    main()
