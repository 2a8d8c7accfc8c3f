r"""Flow-matching pre-training of the built-in velocity models on an embedded task's data.

Rectified-flow objective (Liu et al. 2022; SD3, Esser et al. 2024):

.. math:: \mathcal L = \mathbb E_{x_0, \epsilon, t}\,\big\|v_\theta\big((1-t)x_0 + t\epsilon,\ t,\ c\big)
          - (\epsilon - x_0)\big\|^2

with t logit-normal (t = sigmoid(n), n ~ N(0, 1): more weight on the middle times), and the prompt
replaced by the null prompt with probability ``cfg_dropout`` so that the model also learns the
unconditional velocity that classifier-free guidance needs. AdamW with a cosine decay of the learning
rate to 0.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tearless.cachedir import settings_key
from tearless.flow.models import load_flow_model, save_flow_model
from tearless.flow.tasks import TASKS_VERSION, FlowTask


def flow_matching_loss(model: nn.Module, x0: Tensor, cond: Any, generator: torch.Generator) -> Tensor:
    """The rectified-flow loss of one batch (mean over rows and elements)."""
    n = x0.shape[0]
    t = torch.sigmoid(torch.randn(n, generator=generator)).to(x0.device)
    eps = torch.randn(x0.shape, generator=generator).to(x0.device)
    tb = t.view(n, *([1] * (x0.dim() - 1)))
    x_t = (1 - tb) * x0 + tb * eps
    return (model(x_t, t, cond) - (eps - x0)).square().mean()


def pretrain(
    task: FlowTask,
    model: nn.Module,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    cfg_dropout: float = 0.1,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    log_every: int = 500,
) -> list[float]:
    """Train ``model`` in place on ``task.data``; returns the loss of every step."""
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    device = next(model.parameters()).device
    losses = []
    model.train()
    for step in range(steps):
        ids = torch.randint(task.num_prompts, (batch_size,), generator=generator)
        x0 = task.data(ids, generator).to(device)
        drop = torch.rand(batch_size, generator=generator) < cfg_dropout
        cond_ids = torch.where(drop, torch.full_like(ids, task.num_prompts), ids).to(device)
        loss = flow_matching_loss(model, x0, task.cond(cond_ids), generator)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log is not None and (step + 1) % log_every == 0:
            recent = sum(losses[-log_every:]) / len(losses[-log_every:])
            log(f"pretrain step {step + 1}/{steps}: loss {recent:.4f}")
    model.eval()
    return losses


def pretrained_base(
    task: FlowTask,
    settings: dict[str, Any],
    cache_dir: Path,
    *,
    fresh: bool = False,
    log: Callable[[str], None] = print,
) -> tuple[nn.Module, Path]:
    """The task's base model pre-trained with ``settings`` (steps, batch_size, lr, cfg_dropout, seed,
    model kwargs under ``model``), loaded from ``cache_dir`` or trained and cached there first."""
    identity = {"task": task.name, "version": TASKS_VERSION, "num_prompts": task.num_prompts}
    key = settings_key({**identity, **settings})  # a hash of everything that determines the model
    path = cache_dir / f"{task.name}-{key}"
    if (path / "flow_model.json").is_file() and not fresh:
        return load_flow_model(path)[0], path
    torch.manual_seed(settings["seed"])
    model = task.build_model(**settings.get("model", {}))
    log(f"pre-training the {task.name} base model ({settings['steps']} steps); cached in {path}")
    start = time.perf_counter()
    losses = pretrain(
        task,
        model,
        steps=settings["steps"],
        batch_size=settings["batch_size"],
        lr=settings["lr"],
        cfg_dropout=settings["cfg_dropout"],
        seed=settings["seed"],
        log=log,
    )
    tail = losses[-min(len(losses), 200) :]
    tmp = path.with_name(f".{path.name}.tmp")
    save_flow_model(
        model,
        tmp,
        task=task.name,
        pretrain=settings,
        final_loss=sum(tail) / len(tail),
        seconds=time.perf_counter() - start,
    )
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return model, path
