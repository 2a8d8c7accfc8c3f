"""``tearless flow-pretrain`` and ``tearless flow-train``: the Flow-GRPO commands.

``tearless.cli`` registers both (:data:`HELPS`) on the main parser's subcommands; :func:`run` executes one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

# local imports: --help speed: a command imports only what it runs

# The commands and their one-line help; ``tearless.cli`` registers them on the main parser.
HELPS = {
    "flow-pretrain": "flow-matching pre-training of an embedded task's velocity model (points2d, shapes)",
    "flow-train": "Flow-GRPO: RL of a flow-matching model with SDE rollouts (default: the 2-D task)",
}


def base_model(cfg: Any, task: Any, log: Any = print) -> tuple[Any, Path]:
    """The model at ``model.path``, or the task's cached pre-trained base (built first if missing)."""
    from tearless.cachedir import default_cache_dir
    from tearless.flow.models import load_flow_model
    from tearless.flow.pretrain import pretrained_base

    if cfg.model.path is not None:
        model, info = load_flow_model(cfg.model.path)
        if info.get("task") not in (None, task.name):
            raise ValueError(
                f"model.path {cfg.model.path} holds a model of task {info['task']!r}, but task.name is "
                f"{task.name!r}; set task.name={info['task']} or point model.path at a {task.name} model"
            )
        return model, Path(cfg.model.path)
    cache = default_cache_dir() / "flow"
    return pretrained_base(task, cfg.pretrain_settings(), cache, fresh=cfg.pretrain.fresh, log=log)


def run(args: argparse.Namespace) -> int:
    """Execute ``flow-pretrain`` / ``flow-train``; exit 2 on a config error."""
    from tearless.config import ConfigError, describe, load_config
    from tearless.flow.config import FlowConfig

    try:
        cfg = load_config(args.config, list(args.overrides), schema=FlowConfig)
    except ConfigError as e:
        print(f"tearless: config error: {e}", file=sys.stderr)
        return 2
    if args.help:
        print(describe(cfg))
        return 0
    from tearless.flow.tasks import load_reward_fn, make_task

    task = make_task(cfg.task.name, image_size=cfg.task.image_size)
    if args.command == "flow-pretrain":
        return _pretrain(cfg, task)
    try:
        reward_fn = load_reward_fn(cfg.task.reward_fn) if cfg.task.reward_fn else None
        model, source = base_model(cfg, task)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"tearless: {e}", file=sys.stderr)
        return 2
    from tearless.flow.trainer import FlowGRPOTrainer

    summary = FlowGRPOTrainer(cfg, task, model, reward_fn=reward_fn).fit()
    print(f"base model: {source}")
    for key in sorted(summary["before"]):
        b, a = summary["before"][key], summary["after"].get(key)
        print(f"val/{key:<20} before {b:.4f}  after {a:.4f}")
    print(
        f"run directory: {summary['run_dir']} ({summary['epochs']} epochs, {summary['seconds']:.0f} s); "
        f"checkpoint: {summary['checkpoint']}"
    )
    if "grid" in summary:
        print(f"samples before/after: {summary['grid']}")
    return 0


def _pretrain(cfg: Any, task: Any) -> int:
    import shutil

    import torch

    from tearless.flow.models import load_flow_model

    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    _, path = base_model(cfg, task)
    if cfg.pretrain.output_dir is not None:
        out = Path(cfg.pretrain.output_dir)
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(path, out)
        path = out
    info = load_flow_model(path)[1]
    print(f"{task.name} base model in {path}: final loss {info['final_loss']:.4f} ({info['seconds']:.0f} s)")
    return 0
