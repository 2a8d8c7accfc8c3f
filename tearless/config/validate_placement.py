"""Checks of where the run's processes go: the worker counts and timeouts, Ray's start, separate
rollout workers, and the placement (one process, or Ray workers) the counts call for."""

from __future__ import annotations

import importlib.util

from tearless.config.derived import uses_ray, world_size
from tearless.config.errors import fail, one_of, positive
from tearless.config.schema import Config


def validate_workers(cfg: Config) -> None:
    """Raise ``ConfigError`` for a worker count, timeout or CPU share that is not positive, or separate
    rollout workers with only one of their two counts set."""
    t, rollout = cfg.trainer, cfg.actor_rollout_ref.rollout
    one_of("trainer.placement", t.placement, ("auto", "local", "ray"))
    positive("trainer.nnodes", t.nnodes)
    positive("trainer.n_gpus_per_node", t.n_gpus_per_node)
    positive("trainer.worker_timeout_s", t.worker_timeout_s)
    positive("trainer.num_cpus_per_worker", t.num_cpus_per_worker)
    if cfg.ray_init.num_cpus is not None:
        positive("ray_init.num_cpus", cfg.ray_init.num_cpus)
    positive("ray_init.start_timeout_s", cfg.ray_init.start_timeout_s)
    positive("actor_rollout_ref.rollout.nnodes", rollout.nnodes, allow_zero=True)
    positive("actor_rollout_ref.rollout.n_gpus_per_node", rollout.n_gpus_per_node, allow_zero=True)
    if (rollout.nnodes == 0) != (rollout.n_gpus_per_node == 0):
        fail(
            "actor_rollout_ref.rollout.n_gpus_per_node",
            f"separate rollout workers need both rollout.nnodes and rollout.n_gpus_per_node > 0, got "
            f"{rollout.nnodes} and {rollout.n_gpus_per_node}",
            "Set both (the split placement) or both to 0 (the training workers generate).",
        )


def validate_placement(cfg: Config) -> None:
    """Raise ``ConfigError`` when the worker counts do not fit ``trainer.placement``, or need Ray and Ray
    is not installed."""
    t, rollout = cfg.trainer, cfg.actor_rollout_ref.rollout
    world = world_size(cfg)
    if t.placement == "local" and world != 1:
        fail(
            "trainer.n_gpus_per_node",
            f"trainer.placement=local runs in one process, but nnodes × n_gpus_per_node = {world}",
            "Set trainer.placement=ray (or auto) to use several workers, or nnodes=1 n_gpus_per_node=1.",
        )
    ray_run = uses_ray(cfg)
    if rollout.nnodes * rollout.n_gpus_per_node > 0 and not ray_run:
        fail(
            "actor_rollout_ref.rollout.n_gpus_per_node",
            "separate rollout workers are Ray workers, and this run has the single-process placement",
            "Set trainer.placement=ray, or rollout.nnodes=0 rollout.n_gpus_per_node=0.",
        )
    if ray_run and importlib.util.find_spec("ray") is None:
        fail(
            "trainer.placement",
            f"{world} workers need Ray, which is not installed",
            "pip install 'tearless[distributed]' (or ray), or set trainer.n_gpus_per_node=1.",
        )
