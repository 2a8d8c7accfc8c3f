"""Configuration of ``tearless rm``: a Bradley–Terry reward model trained on preference pairs.

The pairs are the files ``tearless dpo`` reads (``prompt``, ``chosen``, ``rejected``, strings or chat
messages) with TRL's optional ``margin`` column; the algorithm keys follow TRL's ``RewardConfig``
(``center_rewards_coefficient``), the LoRA keys the RL actor's (``lora_rank``, ``lora_alpha``,
``target_modules``), the optim and trainer keys those of ``tearless sft``/``dpo``. With no data and no
model, ``tearless rm`` trains on the pairs ``tearless dpo`` makes from the embedded task's warm-up model
(correct vs incorrect answers), starting from that model's backbone under a new scalar head. Each
checkpoint's ``reward_model/`` is what ``reward_model.model.path`` takes.
"""

# ruff: noqa: RUF009  (doc() returns a dataclasses.field carrying the help text; RUF009 cannot see that)

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tearless.config.dpo import DPOTaskConfig, validate_pair_task
from tearless.config.errors import fail, one_of, positive
from tearless.config.schema import doc
from tearless.config.sft import OfflineModelConfig, OfflineOptimConfig, OfflineTrainerConfig, validate_common


@dataclass
class RMDataConfig:
    train_files: Any = doc(
        None,
        "parquet/JSONL file(s) of preference rows (prompt, chosen, rejected; optional margin), the "
        "files tearless dpo reads; null = pairs made from the embedded task's warm-up model",
    )
    val_files: Any = doc(
        None,
        "held-out preference rows for val/* (pair accuracy, reward gap, loss); null = none (the "
        "embedded task: its held-out pairs)",
    )
    prompt_key: str = doc("prompt", "prompt column: a string or a list of chat messages")
    chosen_key: str = doc("chosen", "preferred response column: a string or a list of messages")
    rejected_key: str = doc("rejected", "dispreferred response column: a string or a list of messages")
    margin_key: str = doc(
        "margin",
        "TRL's optional margin column m (a number per pair; the loss is -log σ(r_c - r_r - m)). A file "
        "without it trains with m = 0; in a file with it every row needs one",
    )
    max_length: int = doc(1024, "longest prompt + response in tokens")
    truncation: str = doc(
        "error",
        "longer sequences: error | left (keep the last max_length tokens, as reward_model.max_length "
        "does when the model scores)",
    )
    train_batch_size: int = doc(16, "preference pairs per optimizer step")
    micro_batch_size_per_gpu: Any = doc(
        None,
        "pairs per forward/backward (the loss is still the step's mean over pairs); null = all of a step's "
        "pairs at once (validation: 64 at a time)",
    )
    shuffle: bool = doc(True, "shuffle training pairs each epoch (seeded by data.seed)")
    seed: Any = doc(None, "shuffle seed; null = trainer.seed")
    max_response_length: int = doc(
        16, "the embedded task's pairs: cap on the tokens of each sampled answer (as tearless dpo)"
    )
    val_max_samples: int = doc(-1, "use at most this many validation pairs (-1 = all)")


@dataclass
class RMAlgorithmConfig:
    center_rewards_coefficient: float | None = doc(
        None,
        "c of TRL's RewardConfig: adds c · mean((r_c + r_r)^2) to the loss, pulling rewards towards "
        "mean zero (Eisenstein et al. 2023); null = no term (TRL's default; it recommends 0.01)",
    )


@dataclass
class RMModelConfig(OfflineModelConfig):
    path: Any = doc(
        None,
        "local Hugging Face model directory or Hub ID: a causal LM (its backbone gets a new scalar head) "
        "or a one-label sequence-classification model; null = the embedded task's warmed-up model",
    )
    lora_rank: int = doc(0, "LoRA rank r through peft (0 = full fine-tuning); the scalar head trains whole")
    lora_alpha: float = doc(16, "LoRA scale numerator: the update is (lora_alpha / lora_rank) · B A")
    target_modules: Any = doc(
        "all-linear", "LoRA target modules: all-linear or a list/comma-separated string of module names"
    )


@dataclass
class RMOptimConfig(OfflineOptimConfig):
    lr: float = doc(
        3e-4,
        "AdamW learning rate, tuned for the embedded tiny model; a pretrained model.path gets TRL's 1e-5 "
        "(1e-4 with LoRA) unless set",
    )
    lr_scheduler: str = doc("constant", "after warm-up: constant | cosine")


@dataclass
class RMTrainerConfig(OfflineTrainerConfig):
    total_epochs: int = doc(4, "passes over the training pairs")
    experiment_name: str = doc("rm", "experiment name (run directory and loggers)")
    log_freq: int = doc(20, "print a metrics table every N steps")


@dataclass
class RMConfig:
    data: RMDataConfig = field(default_factory=RMDataConfig)
    model: RMModelConfig = field(default_factory=RMModelConfig)
    algorithm: RMAlgorithmConfig = field(default_factory=RMAlgorithmConfig)
    optim: RMOptimConfig = field(default_factory=RMOptimConfig)
    trainer: RMTrainerConfig = field(default_factory=RMTrainerConfig)
    task: DPOTaskConfig = field(default_factory=DPOTaskConfig)

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first wrong key and the fix (called by ``load_config``)."""
        validate_common(self.data, self.model, self.optim)
        one_of("data.truncation", self.data.truncation, ("error", "left"))
        self.trainer.validate()
        coeff = self.algorithm.center_rewards_coefficient
        if coeff is not None:
            positive("algorithm.center_rewards_coefficient", coeff, allow_zero=True)
        positive("model.lora_rank", self.model.lora_rank, allow_zero=True)
        if self.model.lora_rank > 0:
            positive("model.lora_alpha", self.model.lora_alpha)
        if self.data.train_files is None:
            if self.data.val_files is not None:
                fail(
                    "data.val_files",
                    "is set but data.train_files is null (the embedded task's pairs)",
                    "Set data.train_files too, or drop data.val_files.",
                )
            validate_pair_task(self.task)
