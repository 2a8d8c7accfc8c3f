"""Flow-GRPO on the embedded tasks: the 2-D run, its shuffled-advantage control, and the image run.

One torch thread. Each task's base model is pre-trained first (cached like ``tearless flow-train``'s,
in $TEARLESS_CACHE/flow; its pre-training time is read from the cached model); the RL clock starts at
the trainer's first evaluation. Prints one JSON line per run and a verdict on the done-when criteria:

- points2d: ODE-40 reward from about 0.2 to >= 0.9 within 60 CPU seconds of RL (process time, one
  thread, evaluations included; wall time is reported too), on-mode share >= 0.95, and the
  shuffled-advantage control not improving (reward gain <= 0.05);
- shapes: ODE-40 reward +0.3 over the pre-trained model, before/after PNG grid in the run directory.

    python benchmarks/flow_grpo.py --out runs/flow_bench
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tearless.cachedir import default_cache_dir
from tearless.config import load_config
from tearless.flow.config import FlowConfig
from tearless.flow.pretrain import pretrained_base
from tearless.flow.tasks import make_task
from tearless.flow.trainer import FlowGRPOTrainer
from tearless.run.tracking import read_metrics

POINTS = ["task.name=points2d", "trainer.test_freq=10", "train.epochs=150"]
SHAPES = ["task.name=shapes", "train.lr=3e-3", "trainer.test_freq=25", "sample.eval_samples_per_prompt=128"]


def run(name: str, overrides: list[str], out: Path, cache: Path) -> dict:
    cfg = load_config(
        None,
        [
            *overrides,
            "trainer.logger=[jsonl]",
            "trainer.num_threads=1",
            f"trainer.default_local_dir={out / name}",
        ],
        schema=FlowConfig,
    )
    task = make_task(cfg.task.name, image_size=cfg.task.image_size)
    model, path = pretrained_base(task, cfg.pretrain_settings(), cache)
    pretrain_s = json.loads((path / "flow_model.json").read_text())["seconds"]
    summary = FlowGRPOTrainer(cfg, task, model).fit()
    records = read_metrics(out / name / "metrics.jsonl")
    curve = [
        (r["step"], r.get("timing_s/cpu_total", 0.0), r.get("timing_s/total", 0.0), r["val/reward"])
        for r in records
        if "val/reward" in r
    ]
    first_09 = next(((step, cpu, wall) for step, cpu, wall, reward in curve if reward >= 0.9), None)
    row = {
        "run": name,
        "pretrain_s": round(pretrain_s, 1),
        "rl_wall_s": round(summary["seconds"], 1),
        "rl_cpu_s": round(summary["cpu_seconds"], 1),
        "epochs": summary["epochs"],
        "before": {k: round(v, 3) for k, v in summary["before"].items()},
        "after": {k: round(v, 3) for k, v in summary["after"].items()},
        "curve_epoch_cpu_wall_reward": [(s, round(c, 1), round(w, 1), round(r, 3)) for s, c, w, r in curve],
        "first_reward_0.9": first_09
        and {"epoch": first_09[0], "cpu_s": round(first_09[1], 1), "wall_s": round(first_09[2], 1)},
        "grid": summary.get("grid"),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/flow_bench")
    ap.add_argument("--only", choices=["points2d", "shapes"], help="run one task only")
    ap.add_argument("--shapes-epochs", type=int, default=150)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    cache = default_cache_dir() / "flow"
    verdict = {}
    if args.only in (None, "points2d"):
        main_run = run("points2d", POINTS, out, cache)
        control = run("points2d_shuffled", [*POINTS, "train.shuffle_advantages=true"], out, cache)
        hit = main_run["first_reward_0.9"]
        verdict["points2d: reward >= 0.9 within 60 CPU s of RL"] = bool(hit and hit["cpu_s"] <= 60)
        verdict["points2d: on-mode share >= 0.95"] = main_run["after"]["on_mode"] >= 0.95
        gain = control["after"]["reward"] - control["before"]["reward"]
        verdict["points2d: shuffled control does not improve (gain <= 0.05)"] = gain <= 0.05
    if args.only in (None, "shapes"):
        shapes = run("shapes", [*SHAPES, f"train.epochs={args.shapes_epochs}"], out, cache)
        verdict["shapes: reward +0.3 over the pre-trained model"] = (
            shapes["after"]["reward"] - shapes["before"]["reward"] >= 0.3
        )
        verdict["shapes: before/after grid saved"] = bool(shapes["grid"]) and Path(shapes["grid"]).is_file()
    for k, v in verdict.items():
        print(f"{'PASS' if v else 'FAIL'}  {k}")


if __name__ == "__main__":
    main()
