"""Configuration of ``tearless dpo``: offline direct preference optimisation.

veRL has no DPO trainer, so the algorithm keys follow TRL's ``DPOConfig`` (``beta``, ``loss_type``,
``label_smoothing``, ``reference_free``) under ``algorithm``; data, model, optim and trainer keys are
those of ``tearless sft``. With no data and no model, ``tearless dpo`` starts from the embedded
task's warmed-up model and trains on preference pairs made from its own samples (correct vs
incorrect answers, judged by the task's verifier), cached next to the task.
"""

# ruff: noqa: RUF009  (doc() returns a dataclasses.field carrying the help text; RUF009 cannot see that)

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tearless.config.schema import TaskConfig, doc
from tearless.config.sft import (
    OfflineModelConfig,
    OfflineOptimConfig,
    OfflineTrainerConfig,
    fail,
    one_of,
    positive,
    validate_common,
)


@dataclass
class DPODataConfig:
    train_files: Any = doc(
        None,
        "parquet/JSONL file(s) of preference rows (prompt, chosen, rejected); null = pairs made "
        "from the embedded task's warm-up model",
    )
    val_files: Any = doc(
        None, "held-out preference rows for val/* metrics; null = none (the embedded task: held-out pairs)"
    )
    val_prompt_files: Any = doc(
        None,
        "veRL-schema prompt rows (data_source, prompt, reward_model.ground_truth) whose greedy "
        "accuracy is measured at validation; null = none (the embedded task: its held-out prompts)",
    )
    prompt_key: str = doc("prompt", "prompt column: a string or a list of chat messages")
    chosen_key: str = doc("chosen", "preferred response column: a string or a list of messages")
    rejected_key: str = doc("rejected", "dispreferred response column: a string or a list of messages")
    max_length: int = doc(1024, "longest prompt + response in tokens")
    truncation: str = doc(
        "error", "longer sequences: error | left (keep the end) | right (keep the start) | middle"
    )
    train_batch_size: int = doc(32, "preference pairs per optimizer step")
    micro_batch_size_per_gpu: Any = doc(
        None, "pairs per forward/backward (the loss is still the step's pair mean); null = all"
    )
    shuffle: bool = doc(True, "shuffle training pairs each epoch (seeded by data.seed)")
    seed: Any = doc(None, "shuffle seed; null = trainer.seed")
    max_response_length: int = doc(16, "cap on generated tokens in the greedy accuracy check")
    val_max_samples: int = doc(-1, "use at most this many validation pairs and prompts (-1 = all)")


@dataclass
class DPOAlgorithmConfig:
    loss_type: str = doc(
        "sigmoid",
        "dpo_loss kind: sigmoid (DPO, Rafailov et al. 2023) | ipo (Azar et al. 2023) | hinge (SLiC)",
    )
    beta: float = doc(
        2.0,
        "β: the strength of the implicit KL to the reference (> 0). Tuned for the embedded tiny "
        "model; with TRL's 0.1 it drifts (chosen log-probs fall) and greedy accuracy barely moves",
    )
    label_smoothing: float = doc(
        0.0, "ε of conservative DPO (sigmoid only): the share of labels assumed flipped, in [0, 0.5)"
    )
    reference_free: bool = doc(
        False, "score against a uniform reference (log π_ref = 0) instead of the initial model"
    )


@dataclass
class DPOModelConfig(OfflineModelConfig):
    ref_path: Any = doc(
        None,
        "reference model directory (its log-probs are computed once, before training); null = "
        "model.path, i.e. the policy's starting point",
    )


@dataclass
class DPOOptimConfig(OfflineOptimConfig):
    lr: float = doc(3e-5, "AdamW learning rate (tuned for the embedded tiny model; TRL's default is 1e-6)")
    warmup_steps_ratio: float = doc(0.1, "linear lr warm-up as a fraction of the total steps")
    lr_scheduler: str = doc("constant", "after warm-up: constant | cosine")


@dataclass
class DPOTrainerConfig(OfflineTrainerConfig):
    total_epochs: int = doc(4, "passes over the training pairs")
    experiment_name: str = doc("dpo", "experiment name (run directory and loggers)")
    log_freq: int = doc(20, "print a metrics table every N steps")


@dataclass
class DPOTaskConfig(TaskConfig):
    samples_per_prompt: int = doc(8, "answers sampled per prompt from the warm-up model to make pairs")
    temperature: float = doc(1.0, "sampling temperature of those answers")


@dataclass
class DPOConfig:
    data: DPODataConfig = field(default_factory=DPODataConfig)
    model: DPOModelConfig = field(default_factory=DPOModelConfig)
    algorithm: DPOAlgorithmConfig = field(default_factory=DPOAlgorithmConfig)
    optim: DPOOptimConfig = field(default_factory=DPOOptimConfig)
    trainer: DPOTrainerConfig = field(default_factory=DPOTrainerConfig)
    task: DPOTaskConfig = field(default_factory=DPOTaskConfig)

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first wrong key and the fix (called by ``load_config``)."""
        from tearless.algos import DPO_LOSSES

        validate_common(self.data, self.model, self.optim)
        self.trainer.validate()
        alg = self.algorithm
        one_of("algorithm.loss_type", alg.loss_type, tuple(sorted(DPO_LOSSES)))
        positive("algorithm.beta", alg.beta)
        if not 0 <= alg.label_smoothing < 0.5:
            fail("algorithm.label_smoothing", f"{alg.label_smoothing} is not in [0, 0.5)", "Use e.g. 0.1.")
        if alg.label_smoothing and alg.loss_type != "sigmoid":
            fail(
                "algorithm.label_smoothing",
                f"is only defined for loss_type=sigmoid, not {alg.loss_type}",
                "Set it to 0 or use algorithm.loss_type=sigmoid.",
            )
        if alg.reference_free and self.model.ref_path is not None:
            fail("model.ref_path", "is set but algorithm.reference_free=true uses no reference", "Drop one.")
        if self.data.train_files is None:
            one_of("task.name", self.task.name, ("arithmetic",))
            for key in ("num_train", "num_val", "warmup_steps", "samples_per_prompt"):
                positive(f"task.{key}", getattr(self.task, key))
            positive("task.temperature", self.task.temperature)
            if self.task.samples_per_prompt < 2:
                fail(
                    "task.samples_per_prompt",
                    "must be >= 2 to find a correct and an incorrect answer",
                    "Use e.g. 8.",
                )
