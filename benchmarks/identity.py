"""Bit-identity of short training runs between two versions of the code: a refactor's check.

Runs a list of short configs (a few steps each) on the embedded tasks through :func:`tearless.train`
and writes, per config, every non-timing metric of every logged step and a sha256 of the final
checkpoint's weights (each safetensors file's tensors in sorted key order) to a JSON file. Run it
before and after a change, then compare: each config is identical, or the first metric or tensor
file that differs is named.

    OMP_NUM_THREADS=1 python benchmarks/identity.py --out /tmp/before.json --cache /tmp/identity-cache
    OMP_NUM_THREADS=1 python benchmarks/identity.py --out /tmp/after.json --cache /tmp/identity-cache
    python benchmarks/identity.py --compare /tmp/before.json /tmp/after.json

Metrics that measure time, throughput or memory change from run to run whatever the code; they are
left out (a key with ``time``, ``timing``, ``throughput``, ``perf``, ``mfu``, ``seconds`` or
``memory`` in it, or a path segment ending in ``_s``, e.g. ``timing_s/gen``). Floats are written
with ``repr`` (JSON's), so equal means the same bits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

STEPS = 3
SMALL = [
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",  # on-policy: π_old detached, zero-advantage rows skipped
    "data.max_response_length=16",
    "data.val_max_samples=8",
    "actor_rollout_ref.rollout.val_kwargs.n=2",
    "trainer.val_before_train=false",
    "trainer.num_threads=1",
    "trainer.logger=[jsonl]",
    "reward_model.num_workers=0",
    f"trainer.total_training_steps={STEPS}",
    f"trainer.save_freq={STEPS}",
]
SEARCH_R1 = [
    "task.num_train=16",
    "task.num_val=4",
    "task.warmup_steps=30",
    "data.train_batch_size=4",
    "data.max_response_length=64",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # on-policy; the agent loop gives no sampler entropy
    "actor_rollout_ref.rollout.val_kwargs.n=1",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
    "trainer.val_before_train=false",
    "trainer.num_threads=1",
    "trainer.logger=[jsonl]",
    "reward_model.num_workers=0",
    f"trainer.total_training_steps={STEPS}",
    f"trainer.save_freq={STEPS}",
]
# name: (preset, overrides on top of SMALL (SEARCH_R1 for the multi-turn task)). On-policy unless said:
# the update's two per-step facts (π_old detached, zero-advantage rows left out) are both on.
CONFIGS: dict[str, tuple[str | None, list[str]]] = {
    "grpo": (None, []),
    # two optimizer steps per RL step: the stored π_old, nothing skipped
    "grpo_two_minibatches": (None, ["actor_rollout_ref.actor.ppo_mini_batch_size=4"]),
    "grpo_filter_groups": (
        None,
        ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=3"],
    ),
    "remax": (None, ["algorithm.adv_estimator=remax"]),
    "gae_critic": (None, ["algorithm.adv_estimator=gae"]),
    "async_k1": (None, ["async_training.enable=true", "async_training.max_staleness=1"]),
    "lora": (None, ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.actor.optim.lr=2e-3"]),
    "grpo_kl_entropy": (
        None,
        [
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            "actor_rollout_ref.actor.ppo_epochs=2",
        ],
    ),
    "search_r1": ("search_r1", []),
    # without the preset's KL loss zero-advantage rows are skipped, and with no sampler entropy from the
    # agent loop their entropy metric is a forward of the policy before the update
    "search_r1_no_kl": ("search_r1", ["actor_rollout_ref.actor.use_kl_loss=false"]),
    "ray_2ranks": (
        None,
        [
            "trainer.placement=ray",
            "trainer.n_gpus_per_node=2",
            "ray_init.num_cpus=2",
            "trainer.worker_timeout_s=900",
            f"ray_init.runtime_env.env_vars.PYTHONPATH={Path(__file__).resolve().parents[1]}",
        ],
    ),
}
DROPPED = re.compile(r"time|timing|throughput|perf|mfu|seconds|memory|_s(/|$)")


def kept(key: str) -> bool:
    return not DROPPED.search(key)


def weights_digest(step_dir: Path) -> dict[str, str]:
    """sha256 of each safetensors file under a checkpoint, over its tensors in sorted key order."""
    import torch
    from safetensors.torch import load_file

    out = {}
    for path in sorted(step_dir.rglob("*.safetensors")):
        h = hashlib.sha256()
        tensors = load_file(path)
        for key in sorted(tensors):
            t = tensors[key].contiguous()
            h.update(key.encode())
            h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
            h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
        out[str(path.relative_to(step_dir))] = h.hexdigest()
    return out


def run_config(name: str, cache: Path, work: Path) -> dict:
    from tearless import train
    from tearless.run.tracking import read_metrics
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.warmup import prepare_task

    preset, extra = CONFIGS[name]
    run_dir = work / name
    if preset == "search_r1":
        base = [f"task.cache_dir={cache / 'search_r1'}", *SEARCH_R1]
    else:
        task = prepare_task(TaskSpec(num_train=400, num_val=100, warmup_steps=300), cache, log=lambda _: None)
        base = [
            f"actor_rollout_ref.model.path={task.model_dir}",
            f"data.train_files={task.train_file}",
            f"data.val_files={task.val_file}",
            *SMALL,
        ]
    start = time.perf_counter()
    train(None, [*base, f"trainer.default_local_dir={run_dir}", *extra], preset=preset, log=lambda _: None)
    seconds = time.perf_counter() - start
    rows = [{k: v for k, v in r.items() if kept(k)} for r in read_metrics(run_dir / "metrics.jsonl")]
    final = run_dir / f"global_step_{STEPS}"
    return {"metrics": rows, "weights": weights_digest(final), "seconds": seconds}


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def first_difference(a: dict, b: dict) -> str | None:
    """The first metric (step order, then key order) or weight file that differs; None if none."""
    if len(a["metrics"]) != len(b["metrics"]):
        return f"{len(a['metrics'])} vs {len(b['metrics'])} metric rows"
    for i, (ra, rb) in enumerate(zip(a["metrics"], b["metrics"], strict=True)):
        for key in sorted(set(ra) | set(rb)):
            if key not in ra or key not in rb or not same(ra[key], rb[key]):
                va, vb = ra.get(key, "<absent>"), rb.get(key, "<absent>")
                return f"row {i} (step {ra.get('step')}): {key} {va!r} vs {vb!r}"
    for path in sorted(set(a["weights"]) | set(b["weights"])):
        if a["weights"].get(path) != b["weights"].get(path):
            return f"weights {path} differ"
    return None


def compare(path_a: str, path_b: str) -> int:
    a, b = json.loads(Path(path_a).read_text()), json.loads(Path(path_b).read_text())
    bad = 0
    for name in [n for n in a if n in b] + [n for n in a if n not in b] + [n for n in b if n not in a]:
        if name not in a or name not in b:
            print(f"{name:20s} only in {'A' if name in a else 'B'}")
            continue
        diff = first_difference(a[name], b[name])
        rows, keys = len(a[name]["metrics"]), sum(len(r) for r in a[name]["metrics"])
        tensors = len(a[name]["weights"])
        if diff is None:
            print(f"{name:20s} identical ({rows} rows, {keys} metric values, {tensors} weight files)")
        else:
            bad += 1
            print(f"{name:20s} DIFFERS: {diff}")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--cache", default=None, help="task cache directory (built once)")
    parser.add_argument("--only", nargs="*", default=None, help=f"configs to run (of {', '.join(CONFIGS)})")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        parser.error("--out (or --compare A B) is required")
    names = args.only or list(CONFIGS)
    if "ray_2ranks" in names:
        try:
            import ray  # noqa: F401
        except ImportError:
            print("ray is not installed: ray_2ranks left out", file=sys.stderr)
            names.remove("ray_2ranks")
    cache = Path(args.cache or tempfile.mkdtemp(prefix="identity-cache-"))
    results = {}
    with tempfile.TemporaryDirectory(prefix="identity-") as work:
        for name in names:
            results[name] = run_config(name, cache, Path(work))
            print(f"{name:20s} {results[name]['seconds']:6.1f} s", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
