"""AdamW and its learning-rate schedule: the one optimizer factory of the RL roles (actor, critic), the
offline trainers (SFT, DPO/KTO, reward models), the embedded tasks' warm-ups and Flow-GRPO (AdamW at a
constant lr, no schedule).

The schedule is a multiplier of the base lr per scheduler step (:func:`lr_lambda`): a linear warm-up
over ``warmup_steps``, then constant, or a cosine from 1 down to ``min_lr_ratio``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch


def lr_lambda(
    total_steps: int, warmup_steps: int, kind: str, min_lr_ratio: float, num_cycles: float
) -> Callable[[int], float]:
    r"""Multiplier of the base lr at scheduler step s: :math:`(s+1)/W` while :math:`s < W` (the
    warm-up), then 1 (``constant``) or :math:`r + (1-r)\max(0, \tfrac12(1 + \cos(2\pi c\,p)))` with
    :math:`p = (s-W)/\max(1, T-W)`, r = ``min_lr_ratio``, c = ``num_cycles`` (``cosine``)."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * 2.0 * num_cycles * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * max(0.0, cosine)

    return f


def adamw(
    params: Iterable[torch.nn.Parameter],
    lr: float,
    betas: Sequence[float],
    weight_decay: float,
    *,
    fused: bool | None = None,
) -> torch.optim.Optimizer:
    """AdamW over ``params``; ``fused`` as torch's AdamW takes it (None: torch's default kernel)."""
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused=fused)


def lr_schedule(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_steps: int,
    kind: str,
    min_lr_ratio: float,
    num_cycles: float,
) -> torch.optim.lr_scheduler.LambdaLR:
    """``optimizer``'s learning rate times :func:`lr_lambda`, stepped once per optimizer step."""
    multiplier = lr_lambda(total_steps, warmup_steps, kind, min_lr_ratio, num_cycles)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def make_optimizer(
    params: list[torch.nn.Parameter], optim_cfg: Any, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """:func:`adamw` and :func:`lr_schedule` from an RL role's ``optim`` section (``lr_warmup_steps``,
    else ``lr_warmup_steps_ratio × total_steps``; ``lr_scheduler_type``, ``min_lr_ratio``,
    ``num_cycles``).

    AdamW is torch's fused implementation (one kernel over every tensor instead of about ten ops per
    tensor) where it exists: plain (unsharded) floating-point parameters on CPU or CUDA."""
    o = optim_cfg
    warmup = o.lr_warmup_steps if o.lr_warmup_steps >= 0 else int(o.lr_warmup_steps_ratio * total_steps)
    optimizer = adamw(params, o.lr, o.betas, o.weight_decay, fused=can_fuse(params) or None)
    return optimizer, lr_schedule(
        optimizer, total_steps, warmup, o.lr_scheduler_type, o.min_lr_ratio, o.num_cycles
    )


def can_fuse(params: list[torch.nn.Parameter]) -> bool:
    """Whether torch's fused AdamW can step ``params``: floating point, on CPU or CUDA, not DTensors
    (FSDP2 shards)."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") and not isinstance(p, DTensor)
        for p in params
    )
