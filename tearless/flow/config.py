"""Configuration of ``tearless flow-pretrain`` and ``tearless flow-train`` (Flow-GRPO).

Key names follow the Flow-GRPO code base where it has one (``sample.num_steps``,
``sample.eval_num_steps``, ``sample.noise_level``, ``sample.guidance_scale``, ``train.clip_range``,
``train.adv_clip_max``, ``train.beta``, ``train.timestep_fraction``, ``train.ema``, ``train.lora_rank``
…) and the tearless trainers' ``trainer.*`` section otherwise. The defaults are the CPU-scale settings
that reach the benchmark numbers on the embedded 2-D task in well under a minute; the docs name the
official SD3.5 values.
"""

# ruff: noqa: RUF009  (doc() returns a dataclasses.field carrying the help text; RUF009 cannot see that)

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tearless.config.errors import DEVICES, fail, in_range, one_of, positive
from tearless.config.schema import doc
from tearless.run.tracking import LOGGERS

TASKS = ("points2d", "shapes")


@dataclass
class FlowTaskConfig:
    name: str = doc("points2d", "embedded task: points2d (2-D point clouds) | shapes (tiny images)")
    image_size: int = doc(8, "shapes: image side, 8 or 16")
    reward_fn: Any = doc(
        None,
        "custom reward 'module:function' or 'file.py:function', called as fn(samples, prompt_ids) -> (B,) "
        "rewards; null = the task's rule reward",
    )


@dataclass
class FlowModelConfig:
    path: Any = doc(
        None,
        "a `tearless flow-pretrain` output directory; null = the task's base model, pre-trained with the "
        "pretrain section and cached under $TEARLESS_CACHE/flow",
    )
    hidden: int = doc(128, "points2d MLP: hidden width")
    depth: int = doc(3, "points2d MLP: hidden layers")
    width: int = doc(16, "shapes conv net: channels")
    blocks: int = doc(2, "shapes conv net: residual blocks")
    emb: int = doc(32, "size of the time and prompt embeddings")


@dataclass
class PretrainConfig:
    steps: int = doc(
        -1, "optimizer steps of flow-matching pre-training; -1 = the task's (points2d 4000, shapes 3000)"
    )
    batch_size: int = doc(-1, "samples per pre-training step; -1 = the task's (points2d 256, shapes 128)")
    lr: float = doc(2e-3, "AdamW learning rate (cosine decay to 0)")
    cfg_dropout: float = doc(0.1, "probability of training on the null prompt (for classifier-free guidance)")
    seed: int = doc(0, "seed of the initialisation and the data")
    output_dir: Any = doc(None, "flow-pretrain: where to save the model; null = the cache directory")
    fresh: bool = doc(False, "rebuild the cached base model even if it exists")


@dataclass
class SampleConfig:
    num_steps: int = doc(10, "SDE steps of a training rollout (Flow-GRPO: 10)")
    eval_num_steps: int = doc(40, "ODE steps of evaluation sampling (Flow-GRPO: 40)")
    noise_level: float = doc(0.7, "a in sigma_t = a·sqrt(t/(1-t)) (Flow-GRPO SD3.5: 0.7)")
    shift: float = doc(-1.0, "time shift k of the schedule, sigma = k·s/(1+(k-1)s); -1 = the task's (1 or 3)")
    guidance_scale: float = doc(1.0, "classifier-free guidance scale in sampling and training (SD3.5: 4.5)")
    eval_samples_per_prompt: int = doc(250, "ODE samples per prompt at each evaluation")
    log_prob_reduce: str = doc(
        "mean", "per-step log-prob over latent elements: mean (Flow-GRPO; ratios stay near 1) | sum (exact)"
    )


@dataclass
class FlowTrainConfig:
    epochs: int = doc(150, "RL epochs; each samples prompts_per_epoch × group_size rollouts")
    prompts_per_epoch: int = doc(4, "prompts per epoch (Flow-GRPO: 48 groups), drawn round-robin")
    group_size: int = doc(16, "SDE samples per prompt (Flow-GRPO: 24)")
    updates_per_epoch: int = doc(2, "optimizer steps per inner epoch (Flow-GRPO: 2)")
    inner_epochs: int = doc(1, "passes over each epoch's rollouts (Flow-GRPO: 1)")
    lr: float = doc(1e-3, "AdamW learning rate (Flow-GRPO SD3.5 LoRA: 3e-4)")
    weight_decay: float = doc(1e-4, "AdamW weight decay")
    betas: list = doc([0.9, 0.999], "AdamW betas")
    grad_clip: float = doc(1.0, "max global gradient norm")
    clip_range: float = doc(1e-2, "PPO clip ε on the per-step ratio (Flow-GRPO: 1e-4 with lr 3e-4)")
    adv_clip_max: float = doc(5.0, "advantages are clipped to [-adv_clip_max, adv_clip_max]")
    std_scope: str = doc(
        "batch",
        "advantage std (population, ÷ n, as Flow-GRPO): batch (Flow-GRPO's global_std) | group (per prompt)",
    )
    adv_epsilon: float = doc(1e-4, "ε added to the std (Flow-GRPO: 1e-4)")
    beta: float = doc(0.04, "KL coefficient to the reference (Flow-GRPO GenEval: 0.04); 0 = no reference")
    kl_variant: str = doc(
        "exact",
        "exact: ||mu-mu_ref||²/(2σ_t²h) | official: without h, as Flow-GRPO's code since July 2025",
    )
    timestep_fraction: float = doc(
        0.99, "train the first int(num_steps·fraction) steps (0.99: all but the last)"
    )
    timesteps: Any = doc(None, "explicit list of trained step indices (overrides timestep_fraction)")
    noise_aware_weighting: bool = doc(
        False, "weight each step's loss by σ_t√h / mean over trained steps (TempFlow-GRPO's 2.25·σ_t√h)"
    )
    lora: bool = doc(True, "train LoRA adapters (peft) instead of all weights; reference = adapters off")
    lora_rank: int = doc(4, "LoRA rank (Flow-GRPO SD3.5: 32)")
    lora_alpha: float = doc(8.0, "LoRA alpha (Flow-GRPO SD3.5: 64)")
    ema: bool = doc(False, "evaluate (and save) an exponential moving average of the trained weights")
    ema_decay: float = doc(0.9, "EMA decay (Flow-GRPO: 0.9)")
    ema_every: int = doc(8, "EMA update every N optimizer steps (Flow-GRPO: 8)")
    shuffle_advantages: bool = doc(
        False, "control experiment: permute advantages across samples (no signal, same statistics)"
    )


@dataclass
class FlowTrainerConfig:
    project_name: str = doc("tearless", "project name (run directory and loggers)")
    experiment_name: str = doc("flow_grpo", "experiment name (run directory and loggers)")
    default_local_dir: Any = doc(None, "run directory; null = runs/<project_name>/<experiment_name>")
    logger: list = doc(["console", "jsonl"], "loggers: console | jsonl | tensorboard | wandb")
    test_freq: int = doc(25, "evaluate (ODE) every N epochs, before the first and after the last")
    save_freq: int = doc(-1, "checkpoint every N epochs (and at the end); -1 = only at the end")
    seed: int = doc(1, "seed of RL sampling and the LoRA initialisation")
    device: str = doc("auto", "auto | cpu | cuda")
    num_threads: int = doc(1, "torch CPU threads (1 is fastest for these tiny nets)")
    log_freq: int = doc(25, "print a metrics table every N epochs")


@dataclass
class FlowConfig:
    task: FlowTaskConfig = field(default_factory=FlowTaskConfig)
    model: FlowModelConfig = field(default_factory=FlowModelConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    train: FlowTrainConfig = field(default_factory=FlowTrainConfig)
    trainer: FlowTrainerConfig = field(default_factory=FlowTrainerConfig)

    def validate(self) -> None:
        """Check every key before anything is built; errors name the key and the fix."""
        one_of("task.name", self.task.name, TASKS)
        if self.task.name == "shapes":
            one_of("task.image_size", self.task.image_size, (8, 16))
        for key in ("hidden", "depth", "width", "blocks", "emb"):
            positive(f"model.{key}", getattr(self.model, key))
        for key in ("steps", "batch_size"):
            if getattr(self.pretrain, key) != -1:
                positive(f"pretrain.{key}", getattr(self.pretrain, key))
        positive("pretrain.lr", self.pretrain.lr)
        in_range("pretrain.cfg_dropout", self.pretrain.cfg_dropout, 0, 1, "Use e.g. 0.1.", high_open=True)
        s = self.sample
        positive("sample.num_steps", s.num_steps)
        positive("sample.eval_num_steps", s.eval_num_steps)
        positive("sample.eval_samples_per_prompt", s.eval_samples_per_prompt)
        positive("sample.noise_level", s.noise_level)
        if s.shift != -1.0:
            positive("sample.shift", s.shift)
        positive("sample.guidance_scale", s.guidance_scale)
        one_of("sample.log_prob_reduce", s.log_prob_reduce, ("mean", "sum"))
        t = self.train
        for key in (
            "epochs",
            "prompts_per_epoch",
            "updates_per_epoch",
            "inner_epochs",
            "lora_rank",
            "ema_every",
        ):
            positive(f"train.{key}", getattr(t, key))
        if t.group_size < 2:
            fail(
                "train.group_size",
                f"must be >= 2, got {t.group_size}",
                "A group needs two samples to compare.",
            )
        batch = t.prompts_per_epoch * t.group_size
        if batch % t.updates_per_epoch:
            fail(
                "train.updates_per_epoch",
                f"{t.updates_per_epoch} does not divide the {batch} rollouts of an epoch "
                f"(train.prompts_per_epoch × train.group_size)",
                "Pick a divisor.",
            )
        for key in ("lr", "clip_range", "adv_clip_max", "adv_epsilon", "grad_clip", "lora_alpha"):
            positive(f"train.{key}", getattr(t, key))
        positive("train.beta", t.beta, allow_zero=True)
        positive("train.weight_decay", t.weight_decay, allow_zero=True)
        one_of("train.std_scope", t.std_scope, ("batch", "group"))
        one_of("train.kl_variant", t.kl_variant, ("exact", "official"))
        in_range("train.ema_decay", t.ema_decay, 0, 1, "Use e.g. 0.9.", low_open=True, high_open=True)
        if t.timesteps is None:
            if not 0 < t.timestep_fraction <= 1 or int(s.num_steps * t.timestep_fraction) < 1:
                fail(
                    "train.timestep_fraction",
                    f"{t.timestep_fraction} trains no step of sample.num_steps={s.num_steps}",
                    "Use a fraction in (0, 1] with int(num_steps·fraction) >= 1.",
                )
        else:
            # One index (train.timesteps=2) is not a list: read as a count it would train other steps
            # than as an index, so the user says which.
            if not isinstance(t.timesteps, (list, tuple)):
                fail(
                    "train.timesteps",
                    f"{t.timesteps!r} is not a list of step indices",
                    f"Write a list, e.g. train.timesteps=[{t.timesteps}] to train that one step, or set "
                    "train.timestep_fraction to train the first steps.",
                )
            steps = list(t.timesteps)
            # bool is an int subclass: train.timesteps=[true] is not step 1
            bad = [
                i for i in steps if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < s.num_steps
            ]
            if not steps or bad or len(set(steps)) != len(steps):
                fail(
                    "train.timesteps",
                    f"{steps} must be distinct step indices in [0, {s.num_steps})",
                    "List each trained step once, or set it to null.",
                )
        if len(self.trainer.logger) == 0 or any(x not in LOGGERS for x in self.trainer.logger):
            fail(
                "trainer.logger", f"{self.trainer.logger} must be a non-empty subset of {LOGGERS}", "Fix it."
            )
        one_of("trainer.device", self.trainer.device, DEVICES)
        positive("trainer.test_freq", self.trainer.test_freq)
        positive("trainer.log_freq", self.trainer.log_freq)
        positive("trainer.num_threads", self.trainer.num_threads, allow_zero=True)
        if self.trainer.save_freq == 0 or self.trainer.save_freq < -1:
            fail("trainer.save_freq", f"got {self.trainer.save_freq}", "Use -1 (only at the end) or N > 0.")

    def trained_steps(self) -> list[int]:
        """Indices of the SDE steps the loss is taken on (default: all but the last)."""
        if self.train.timesteps is not None:
            return sorted(self.train.timesteps)
        return list(range(int(self.sample.num_steps * self.train.timestep_fraction)))

    def shift(self) -> float:
        """The schedule shift: sample.shift, or the task's (1 for points2d, 3 for shapes, as SD3)."""
        if self.sample.shift != -1.0:
            return self.sample.shift
        return 3.0 if self.task.name == "shapes" else 1.0

    def pretrain_settings(self) -> dict[str, Any]:
        """Everything that determines the pre-trained base model (its cache key)."""
        m = self.model
        model = (
            {"hidden": m.hidden, "depth": m.depth, "emb": m.emb}
            if self.task.name == "points2d"
            else {"width": m.width, "blocks": m.blocks, "emb": m.emb}
        )
        p = self.pretrain
        shapes = self.task.name == "shapes"
        extra = {"image_size": self.task.image_size} if shapes else {}
        return {
            "steps": p.steps if p.steps != -1 else (3000 if shapes else 4000),
            "batch_size": p.batch_size if p.batch_size != -1 else (128 if shapes else 256),
            "lr": p.lr,
            "cfg_dropout": p.cfg_dropout,
            "seed": p.seed,
            "model": model,
            **extra,
        }
