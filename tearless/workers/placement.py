"""The one factory that knows which worker group a config asks for."""

from __future__ import annotations

from typing import Any

from tearless.workers.group import LocalWorkers, WorkerGroup
from tearless.workers.ray_group import RayWorkers
from tearless.workers.spec import RankSpec


def make_workers(spec: RankSpec, pad_token_id: int, *, run_dir: Any = None) -> WorkerGroup:
    """The worker group of the plan's placement: Ray workers when ``trainer.placement`` asks for
    them (or, with ``auto``, for more than one: :attr:`~tearless.config.plan.RunPlan.uses_ray`), else
    this process."""
    if spec.plan.uses_ray:
        return RayWorkers(spec, pad_token_id, run_dir=run_dir)
    return LocalWorkers(spec, pad_token_id)
