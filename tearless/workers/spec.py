"""What a rank of a worker group builds (:class:`RankSpec`), shared by the group, the rank and Ray,
and the trained roles' update settings (:func:`role_settings`), built once from the plan.

A spec carries the run's plan (:class:`~tearless.config.plan.RunPlan`), not the config: the groups and
the ranks read the facts derived from the config and the config's sections (:attr:`RankSpec.sections`,
each reader its own) from it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from tearless.config import Config, ConfigError
from tearless.config.plan import RunPlan, Sections, build_plan
from tearless.workers.schedule import UpdateSettings


def resolve_device(name: str) -> str:
    """``trainer.device`` as seen from *this* process: ``auto`` is ``cuda`` where this process sees a
    GPU, else ``cpu``. A worker decides for itself (a CPU-only head node must not make GPU workers
    train on their CPUs); ``cuda`` without a visible GPU is refused in one line."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device=cuda, but this process sees no CUDA device (a CPU build of torch, or "
            "CUDA_VISIBLE_DEVICES hides them); install a CUDA build of torch or set trainer.device=cpu"
        )
    return name


@dataclasses.dataclass
class RankSpec:
    """What a rank builds. ``model_path`` holds the initial weights (the driver's
    ``plan.files.model_path``); ``resume_dir`` a checkpoint whose ``actor/`` (and ``critic/``) replace
    them. ``device`` is ``trainer.device`` as asked
    (``auto`` included): each rank resolves it in its own process (:func:`resolve_device`).
    ``models`` are roles' models already in memory, used as given instead of loading ``model_path``
    (an in-process group, :class:`~tearless.workers.group.LocalWorkers`, over a model that a test
    or a benchmark holds; the trainer gives none). ``plan`` holds the facts derived from ``cfg``
    (:mod:`tearless.config.plan`): the trainer's, with ``param_dtype=auto`` measured and the run's
    files (the teacher's weights, the LoRA adapter, the critic's weights, the embedded task's tool
    YAML); a spec built without one gets :func:`~tearless.config.plan.build_plan`'s of ``cfg``, whose
    ``auto`` computes as null and which holds no files (a LoRA actor starts from new adapters, the
    critic from ``model_path``). ``cfg`` is read only to build that plan; the spec does not keep it."""

    cfg: dataclasses.InitVar[Config | None]
    roles: tuple[str, ...]
    rollout: bool
    model_path: str
    total_steps: int
    device: str
    # Shard the models over a process group even at world size 1 (FSDP2 over one rank): what one
    # GPU process does when a role offloads its parameters or optimizer state (see Rank.setup).
    sharded: bool = False
    resume_dir: str | None = None
    reward_fn: Callable[..., Any] | None = None
    models: dict[str, torch.nn.Module] = dataclasses.field(default_factory=dict)
    plan: RunPlan | None = None

    def __post_init__(self, cfg: Config | None) -> None:
        if self.plan is None:
            if cfg is None:
                raise ValueError("a RankSpec needs a plan, or the config to build one from")
            self.plan = build_plan(cfg)

    @property
    def sections(self) -> Sections:
        """The config's sections the groups and ranks read (:class:`~tearless.config.plan.Sections`)."""
        return self.plan.sections

    def replaced(self, **changes: Any) -> RankSpec:
        """This spec with ``changes``, its plan kept."""
        return dataclasses.replace(self, cfg=None, **changes)


def role_settings(spec: RankSpec) -> dict[str, UpdateSettings]:
    """The update schedule of each trained role (``actor``, ``critic``) of ``spec``: mini-batches of
    ``ppo_mini_batch_size × rollout.n`` rows, the critic's section and seq-mean-token-sum-norm's
    constant S as the plan resolved them. A group builds them once to plan the updates, a rank once
    for the roles it holds."""
    plan = spec.plan
    n = plan.sections.rollout.n
    return {
        "actor": UpdateSettings.of_section(plan.sections.actor, n, "actor", plan.loss_scale_factor),
        "critic": UpdateSettings.of_section(
            plan.critic_section, n, "critic", plan.critic_section.loss_scale_factor
        ),
    }
