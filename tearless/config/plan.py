"""The run's plan: the facts several config keys decide together, resolved once in the driver.

:func:`build_plan` reads the validated :class:`~tearless.config.schema.Config` once and returns a
frozen :class:`RunPlan`; the trainer completes it with the measured ``param_dtype=auto`` choices
(:meth:`RunPlan.with_dtypes`) before any rank is built, and the ranks receive it in their
:class:`~tearless.workers.spec.RankSpec`. The config itself is never changed: the user's ``auto``
stays ``auto`` in the config (and in ``config.json``), the dtype it stands for lives here.

Each fact has this one home (``tests/test_floors.py`` fails when the workers or the trainers derive
one from the config again):

- ``response_length``: the response cap in tokens, ``rollout.response_length`` else
  ``data.max_response_length``;
- ``capabilities``: the rollout engine's (:func:`tearless.rollout.engine.engine_capabilities`);
- ``roles``, ``critic``, ``distills``: which roles the training ranks hold;
- ``param_dtypes``: each role's ``fsdp_config.param_dtype``, ``auto`` replaced by the measured
  choice; ``rollout_dtype``: ``rollout.dtype``; the engine's and the trainer's compute dtypes on a
  device follow from them (:meth:`RunPlan.rollout_dtype`, :meth:`RunPlan.hybrid_rollout_dtype`,
  :meth:`RunPlan.precision_mismatch`);
- ``on_policy_prompts``: the prompt count of an update whose PPO ratio is exactly 1
  (``ppo_epochs = 1`` and one mini-batch), None when no count is (:meth:`RunPlan.on_policy`);
- ``loss_scale_factor``: the actor's constant S of ``seq-mean-token-sum-norm``;
- ``critic_section``: the ``critic`` section with every null (inherit-from-actor) field resolved;
- ``files``: the run's files (:class:`RunFiles`), resolved by the driver once: the policy's weights
  (a Hub ID as its cached snapshot, or the embedded task's model), the data, the embedded task's tool
  YAML, the teacher's weights, the LoRA adapter the actor starts from and the critic's weights (each a
  snapshot too: :func:`adapter_path`, :func:`critic_path`); None in a plan built without a driver;
- ``source``: what the one source of batches reads (:class:`SourceSettings`), with the run's step
  count and the response cap; None in a plan built without a driver;
- ``uses_ray``: the run's worker group is Ray's (:func:`~tearless.config.derived.uses_ray`);
- ``sections``: the config's sections the worker groups and their ranks read (:class:`Sections`):
  they receive the plan, not the whole config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from tearless.config.derived import (
    critic_enabled,
    distills,
    loss_scale_factor,
    response_length,
    roles,
    uses_ray,
)
from tearless.config.schema import (
    ActorConfig,
    AsyncTrainingConfig,
    Config,
    CriticConfig,
    CustomRewardConfig,
    DataConfig,
    ModelConfig,
    RayInitConfig,
    RefConfig,
    RewardModelConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    TeacherConfig,
    TrainerConfig,
)
from tearless.devices import device_defaults
from tearless.models.hub import local_model_path
from tearless.models.loading import check_model_dir, resolve_dtype
from tearless.models.precision import compute_dtype
from tearless.models.vision import vision_model_type
from tearless.rollout.engine import Capabilities, engine_capabilities

ROLES = ("actor", "ref", "teacher", "critic")


def role_key(role: str) -> str:
    """The ``param_dtype`` config key of ``role`` (for messages)."""
    prefix = "critic.model" if role == "critic" else f"actor_rollout_ref.{role}"
    return f"{prefix}.fsdp_config.param_dtype"


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """The files of a run, each model a local directory (a Hub ID resolved to its cached snapshot): the
    policy's weights, the training and validation data, the embedded task's tool YAML (None without
    one), the teacher's weights (None without one), the LoRA adapter the actor starts from
    (``model.lora_adapter_path``; None without one) and the critic's weights (``critic.model.path``;
    None without a critic or when it starts from the policy's)."""

    model_path: str
    train_files: Any
    val_files: Any
    tools: str | None
    teacher_path: str | None
    lora_adapter_path: str | None = None
    critic_path: str | None = None


@dataclasses.dataclass(frozen=True)
class SourceSettings:
    """What the source of batches (:class:`~tearless.trainers.source.BatchSource`) reads of the
    config (:meth:`from_config`)."""

    n: int
    max_new_tokens: int
    sampling: dict[str, Any]  # temperature, top_p, top_k
    seed: int
    total_steps: int
    max_staleness: int  # k
    asynchronous: bool  # async_training.enable: staleness bounded and reported (async/* metrics)
    partial_rollout: bool
    filter_groups: bool
    target_groups: int  # data.train_batch_size
    max_num_gen_batches: int
    greedy_baselines: bool  # ReMax

    @classmethod
    def from_config(cls, cfg: Config, *, total_steps: int, max_new_tokens: int) -> SourceSettings:
        """The settings of ``cfg``; ``max_staleness`` k is 0 without ``async_training.enable``."""
        rollout, at, fg = cfg.actor_rollout_ref.rollout, cfg.async_training, cfg.algorithm.filter_groups
        return cls(
            n=rollout.n,
            max_new_tokens=max_new_tokens,
            sampling=dict(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k),
            seed=cfg.trainer.seed,
            total_steps=total_steps,
            max_staleness=at.max_staleness if at.enable else 0,
            asynchronous=at.enable,
            partial_rollout=at.partial_rollout,
            filter_groups=fg.enable,
            target_groups=cfg.data.train_batch_size,
            max_num_gen_batches=fg.max_num_gen_batches,
            greedy_baselines=cfg.algorithm.adv_estimator == "remax",
        )


@dataclasses.dataclass(frozen=True)
class Sections:
    """The config's sections as the worker groups and their ranks read them, each its reader's own
    (the facts several keys decide together are the plan's, not read from here):

    - ``trainer``: every rank's process (seed, threads, freed memory, the collectives' timeout); the
      Ray group's layout (nodes, GPUs per node, colocation, CPUs per worker);
    - ``ray_init``: the cluster the Ray group starts or joins;
    - ``model``: the policy's model (dtype, tokenizer, LoRA, padding-free and fused forwards,
      external modules);
    - ``actor``, ``ref``, ``teacher``: each role's own (optimizer, update and loss knobs, FSDP,
      micro-batches); ``critic``: the critic's as the user gave it (its model, micro-batches; the
      update settings with the actor's inherited are :attr:`RunPlan.critic_section`);
    - ``rollout``: the engine, sampling and the multi-turn loop;
    - ``reward_model``, ``custom_reward_function``: the reward manager;
    - ``data``: the prompt length and batch a vLLM engine sizes its cache by;
    - ``async_training``: partial rollouts (weights taken between two tokens);
    - ``rollout_correction``: its bypass mode (π_old is the rollout's, the update never detached).
    """

    trainer: TrainerConfig
    ray_init: RayInitConfig
    model: ModelConfig
    actor: ActorConfig
    ref: RefConfig
    teacher: TeacherConfig
    critic: CriticConfig
    rollout: RolloutConfig
    reward_model: RewardModelConfig
    custom_reward_function: CustomRewardConfig
    data: DataConfig
    async_training: AsyncTrainingConfig
    rollout_correction: RolloutCorrectionConfig

    @classmethod
    def of(cls, cfg: Config) -> Sections:
        """``cfg``'s sections (the same objects: nothing is copied or changed)."""
        arr = cfg.actor_rollout_ref
        return cls(
            trainer=cfg.trainer,
            ray_init=cfg.ray_init,
            model=arr.model,
            actor=arr.actor,
            ref=arr.ref,
            teacher=arr.teacher,
            critic=cfg.critic,
            rollout=arr.rollout,
            reward_model=cfg.reward_model,
            custom_reward_function=cfg.custom_reward_function,
            data=cfg.data,
            async_training=cfg.async_training,
            rollout_correction=cfg.algorithm.rollout_correction,
        )

    def fsdp(self, role: str) -> Any:
        """``role``'s FSDP settings as the user gave them (its ``param_dtype`` may read ``auto``: the
        dtype is :meth:`RunPlan.param_dtype`'s)."""
        return self.critic.model.fsdp_config if role == "critic" else getattr(self, role).fsdp_config

    def compute_copies(self, role: str) -> bool:
        """Whether ``role``'s model holds its weights in its reduced compute dtype
        (``fsdp_config.compute_copies``: each role's own, unset = the actor's for the reference and
        the teacher, false for the critic, a model of its own precision)."""
        own = self.fsdp(role).compute_copies
        if role == "critic":
            return bool(own)
        return self._own_or_actors(role, own, self.actor.fsdp_config.compute_copies)

    def compiles(self, role: str) -> bool:
        """Whether ``role``'s decoder layers run compiled in its passes (``use_torch_compile``: the
        actor's; the reference's and the teacher's own, unset = the actor's; never the critic's)."""
        own = {"actor": self.actor, "ref": self.ref, "teacher": self.teacher}.get(role)
        return self._own_or_actors(role, own and own.use_torch_compile, self.actor.use_torch_compile)

    @staticmethod
    def _own_or_actors(role: str, own: bool | None, actors: bool | None) -> bool:
        if role == "critic":
            return False
        return bool(actors if own is None else own)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """The resolved facts of one run (see the module docs); built by :func:`build_plan`."""

    roles: tuple[str, ...]
    critic: bool
    distills: bool
    response_length: int
    loss_scale_factor: float
    capabilities: Capabilities
    # The rollout runs apart from the trained weights: an engine with its own copy, or rollout nodes.
    separate_rollout: bool
    rollout_dtype_name: str | None
    lora_sync_name: str | None  # rollout.lora_sync as set (null: the device's default)
    param_dtypes: dict[str, str | None]
    critic_section: CriticConfig
    uses_ray: bool
    sections: Sections
    auto_resolved: frozenset[str] = frozenset()  # roles whose param_dtype was measured from auto
    on_policy_prompts: int | None = None
    files: RunFiles | None = None
    source: SourceSettings | None = None

    def param_dtype(self, role: str) -> str | None:
        """``role``'s ``param_dtype`` (``auto`` only where the trainer measured nothing: a role built
        outside a trainer, which :func:`~tearless.models.precision.compute_dtype` treats as null)."""
        return self.param_dtypes[role]

    def with_dtypes(self, choices: Mapping[str, str]) -> RunPlan:
        """This plan with the roles of ``choices`` (``{role: dtype}``, measured from ``auto``) resolved."""
        return dataclasses.replace(
            self,
            param_dtypes={**self.param_dtypes, **choices},
            auto_resolved=self.auto_resolved | frozenset(choices),
        )

    def on_policy(self, num_prompts: int) -> bool:
        """One epoch over one mini-batch of ``num_prompts`` prompts: the update's ratio is exactly 1,
        old log-probs are not needed."""
        return num_prompts == self.on_policy_prompts

    def lora_sync(self, device: str) -> str:
        """How a vLLM engine of a LoRA run takes the policy: ``rollout.lora_sync``, or the device's default
        (:attr:`tearless.devices.DeviceDefaults.lora_adapter_sync`): ``adapter`` or ``merged``."""
        if self.lora_sync_name is not None:
            return self.lora_sync_name
        return "adapter" if device_defaults(device).lora_adapter_sync else "merged"

    def rollout_dtype(self, device: str) -> str:
        """The dtype a separate rollout engine holds the policy in: ``rollout.dtype``, or bfloat16 on
        GPU and float32 on CPU."""
        name = self.rollout_dtype_name
        return name if name else ("bfloat16" if device == "cuda" else "float32")

    def hybrid_rollout_dtype(self, device: str, *, warn: bool = True) -> torch.dtype:
        """The compute dtype of the built-in engine sampling from the trained weights (hybrid
        placement): ``rollout.dtype``, or the actor's ``param_dtype`` when it is null."""
        if self.rollout_dtype_name is not None:
            key = "actor_rollout_ref.rollout.dtype"
            return compute_dtype(self.rollout_dtype_name, device, key, warn=warn)
        return compute_dtype(self.param_dtype("actor"), device, role_key("actor"), warn=warn)

    def precision_mismatch(self, device: str) -> bool:
        """Whether the hybrid built-in engine computes in another dtype than the actor's log-prob
        forward (then π_old is recomputed, so ``rollout_corr/*`` shows the mismatch)."""
        if self.separate_rollout:
            return False
        actor = compute_dtype(self.param_dtype("actor"), device, role_key("actor"), warn=False)
        return self.hybrid_rollout_dtype(device, warn=False) != actor

    def sharded(self, device: str, world: int) -> bool:
        """Whether a training rank of a group of ``world`` ranks on ``device`` shards its models with
        FSDP2: a group of several ranks, or one GPU process in which a role offloads its parameters or
        optimizer state to CPU memory (FSDP2's offload, over a one-rank group). A sharded model
        computes a reduced dtype through FSDP2's mixed precision, never from compute copies."""
        offload = device == "cuda" and any(
            f.param_offload or f.optimizer_offload for f in map(self.sections.fsdp, ROLES)
        )
        return world > 1 or offload

    def holds_copies(self, role: str, device: str) -> bool:
        """Whether ``role``'s model, unsharded on ``device``, computes from compute copies (a frozen
        one: holds its parameters in them; :mod:`tearless.models.copies`): its
        ``fsdp_config.compute_copies`` and a bf16 compute dtype there (float16 keeps autocast: its
        copies would need loss scaling)."""
        dtype = compute_dtype(self.param_dtype(role), device, role_key(role), warn=False)
        return dtype == torch.bfloat16 and self.sections.compute_copies(role)

    def holds_base_in_copies(self, device: str) -> bool:
        """Whether a LoRA actor with compute copies holds its frozen base in the copies' dtype alone
        (2 bytes a parameter, no float32 master: :mod:`tearless.models.copies`): when its engine
        samples in that dtype too (the built-in hybrid engine's :meth:`hybrid_rollout_dtype`; an
        engine holding its own weights, or the built-in one on rollout nodes, is sent them in
        :meth:`rollout_dtype`), so nothing forwards the base in float32; with a float32 engine the
        base keeps its float32 masters beside the copies."""
        if not (self.sections.model.lora_rank > 0 and self.holds_copies("actor", device)):
            return False
        if self.separate_rollout:
            return resolve_dtype(self.rollout_dtype(device)) == torch.bfloat16
        return self.hybrid_rollout_dtype(device, warn=False) == torch.bfloat16

    def eager_despite_compile(self, world: int) -> str | None:
        """The line to print when ``actor.use_torch_compile`` is on but the actor's passes all carry a
        KV cache, which runs eager (:mod:`tearless.models.compiled`): the shared-prompt padded pass
        of a single process (``share_prompt_forward`` without activation checkpointing, which takes
        the plain pass for the update, and without ``use_remove_padding``, which a vision-language
        batch never takes: it is never packed); else None."""
        m = self.sections.model
        vision = self.files is not None and vision_model_type(self.files.model_path) is not None
        packed = m.use_remove_padding and not vision
        cached = m.share_prompt_forward and not (packed or m.enable_gradient_checkpointing)
        if not (self.sections.actor.use_torch_compile and cached and world == 1):
            return None
        if vision:
            return (
                "actor_rollout_ref.actor.use_torch_compile=true compiles nothing in this run: a "
                "vision-language batch is never packed, and the shared-prompt pass "
                "(model.share_prompt_forward=true) forwards through a KV cache, which runs eager; set "
                "actor_rollout_ref.model.share_prompt_forward=false to compile the update and the "
                "log-prob passes"
            )
        return (
            "actor_rollout_ref.actor.use_torch_compile=true compiles nothing in this run: the shared-prompt "
            "pass (model.share_prompt_forward=true, model.use_remove_padding=false) forwards through a KV "
            "cache, which runs eager; set actor_rollout_ref.model.use_remove_padding=true to compile the "
            "update and the log-prob passes"
        )


def adapter_path(cfg: Config) -> str | None:
    """The LoRA adapter a LoRA actor starts from, for :attr:`RunFiles.lora_adapter_path`: the driver's
    ``model.lora_adapter_path``, a Hub ID as its cached snapshot (downloaded unless offline); None
    without one, or when the actor has no LoRA."""
    m = cfg.actor_rollout_ref.model
    if not m.lora_adapter_path or m.lora_rank == 0:
        return None
    return local_model_path(m.lora_adapter_path, "actor_rollout_ref.model.lora_adapter_path")


def critic_path(cfg: Config) -> str | None:
    """The critic's weights, for :attr:`RunFiles.critic_path`: the driver's ``critic.model.path``, a Hub
    ID as its cached snapshot; None when it is null (the critic starts from the policy's weights) or the
    run has no critic (the path is never read, nor downloaded)."""
    path = cfg.critic.model.path
    return str(check_model_dir(path, "critic.model.path")) if path and critic_enabled(cfg) else None


def critic_section(cfg: Config) -> CriticConfig:
    """The ``critic`` section with ``ppo_mini_batch_size``, ``ppo_epochs``, ``loss_agg_mode`` and
    ``use_dynamic_bsz`` taken from the actor's where null, ``loss_scale_factor`` from
    :func:`~tearless.config.derived.loss_scale_factor` (a copy: the config keeps its nulls)."""
    c, a = cfg.critic, cfg.actor_rollout_ref.actor
    inherited = ("ppo_mini_batch_size", "ppo_epochs", "loss_agg_mode", "use_dynamic_bsz")
    filled = {name: getattr(a, name) for name in inherited if getattr(c, name) is None}
    if c.loss_scale_factor is None:
        filled["loss_scale_factor"] = loss_scale_factor(cfg)
    return dataclasses.replace(c, **filled)


def build_plan(cfg: Config, files: RunFiles | None = None, total_steps: int | None = None) -> RunPlan:
    """The plan of the validated ``cfg`` (``param_dtype=auto`` still unresolved: the trainer measures
    it and calls :meth:`RunPlan.with_dtypes`). A driver gives the ``files`` it resolved and, when it
    trains, the run's ``total_steps`` (then the plan holds the source's settings)."""
    arr = cfg.actor_rollout_ref
    rollout, actor = arr.rollout, arr.actor
    capabilities = engine_capabilities(rollout.name)
    sections = Sections.of(cfg)
    return RunPlan(
        roles=roles(cfg),
        critic=critic_enabled(cfg),
        distills=distills(cfg),
        response_length=response_length(cfg),
        loss_scale_factor=loss_scale_factor(cfg),
        capabilities=capabilities,
        separate_rollout=capabilities.holds_own_weights or rollout.nnodes > 0,
        rollout_dtype_name=rollout.dtype,
        lora_sync_name=rollout.lora_sync,
        param_dtypes={role: sections.fsdp(role).param_dtype for role in ROLES},
        critic_section=critic_section(cfg),
        uses_ray=uses_ray(cfg),
        sections=sections,
        on_policy_prompts=actor.ppo_mini_batch_size if actor.ppo_epochs == 1 else None,
        files=files,
        source=None
        if total_steps is None
        else SourceSettings.from_config(cfg, total_steps=total_steps, max_new_tokens=response_length(cfg)),
    )
