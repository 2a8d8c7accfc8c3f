"""Scale-out: the RL trainer's worker ranks as Ray actors over FSDP2-sharded models.

Light to import: the Ray and FSDP machinery (``tearless.distributed.ray_group``, ``.fsdp``,
``.weight_sync``) is imported only by a run with ``trainer.placement=ray`` (or sharded ranks).
"""

from __future__ import annotations

from typing import Any


def world_size(cfg: Any) -> int:
    """Ranks per pool: ``trainer.nnodes × trainer.n_gpus_per_node`` (CPU worker processes on CPU)."""
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def uses_ray(cfg: Any) -> bool:
    """``trainer.placement`` is ray, or auto with more than one worker."""
    placement = cfg.trainer.placement
    return placement == "ray" or (placement == "auto" and world_size(cfg) > 1)


__all__ = ["uses_ray", "world_size"]
