"""Configuration of ``tearless sft``: supervised fine-tuning with the loss on assistant tokens only.

Key names follow veRL's SFT trainer (``data.train_batch_size``, ``data.micro_batch_size_per_gpu``,
``data.max_length``, ``data.truncation``, ``data.messages_key``, ``optim.warmup_steps_ratio``,
``optim.clip_grad``, ``trainer.*``). The defaults reproduce the embedded task's warm-up: with no
data and no model, ``tearless sft`` trains a fresh tiny Llama on the flawed teacher's
demonstrations, exactly as the RL trainer's cached warm-up model was trained. The model, optim and
trainer sections are shared with ``tearless dpo``.
"""

# ruff: noqa: RUF009  (doc() returns a dataclasses.field carrying the help text; RUF009 cannot see that)

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tearless.config.errors import DEVICES, RESUME_MODES, SCHEDULERS, fail, in_range, one_of, positive
from tearless.config.schema import KEEP_FREED_MEMORY_DOC, CustomRewardConfig, doc
from tearless.run.tracking import LOGGERS

# The offline configs word a value out of its interval as "<value> is not in [a, b)".
NOT_IN = "{value} is not in {interval}"


@dataclass
class SFTDataConfig:
    train_files: Any = doc(
        None,
        "parquet/JSONL file(s) of SFT rows (messages, or prompt + response); null = the embedded "
        "task's flawed-teacher demonstrations",
    )
    val_files: Any = doc(
        None,
        "held-out SFT rows for val/loss; null = none (the embedded task: demonstrations on its "
        "held-out prompts)",
    )
    val_prompt_files: Any = doc(
        None,
        "veRL-schema prompt rows (data_source, prompt, reward_model.ground_truth) whose greedy "
        "accuracy is measured at validation; null = none (the embedded task: its held-out prompts)",
    )
    messages_key: str = doc("messages", "column of chat messages (veRL: data.multiturn.messages_key)")
    prompt_key: str = doc("prompt", "prompt column (string or messages), for rows without messages")
    response_key: str = doc("response", "response column (string), for rows without messages")
    max_length: int = doc(1024, "longest sequence (prompt + response) in tokens")
    truncation: str = doc(
        "error", "longer sequences: error | left (keep the end) | right (keep the start) | middle"
    )
    packing: bool = doc(
        False, "pack each micro-batch's sequences into rows of max_length (block-diagonal attention)"
    )
    train_batch_size: int = doc(128, "sequences per optimizer step")
    micro_batch_size_per_gpu: Any = doc(
        None, "sequences per forward/backward (the loss is still the step's token mean); null = all"
    )
    shuffle: bool = doc(True, "shuffle training rows each epoch (seeded by data.seed)")
    seed: Any = doc(None, "shuffle seed; null = trainer.seed")
    max_response_length: int = doc(16, "cap on generated tokens in the greedy accuracy check")
    val_max_samples: int = doc(-1, "use at most this many validation rows and prompts (-1 = all)")


@dataclass
class OfflineModelConfig:
    path: Any = doc(
        None,
        "local Hugging Face model directory (veRL SFT: model.partial_pretrain); null = the embedded "
        "task's model (sft: a fresh tiny Llama; dpo: the warmed-up one)",
    )
    tokenizer_path: Any = doc(None, "tokenizer directory; null = model.path")
    dtype: str = doc("float32", "parameter dtype: float32 | bfloat16 | float16 (fp32 on CPU)")
    enable_gradient_checkpointing: bool = doc(False, "recompute activations in backward to save memory")


@dataclass
class OfflineOptimConfig:
    lr: float = doc(
        3e-3, "AdamW learning rate (tuned for the embedded tiny model; veRL's SFT default is 1e-5)"
    )
    betas: list = doc([0.9, 0.999], "AdamW betas")
    weight_decay: float = doc(0.0, "AdamW weight decay")
    warmup_steps_ratio: float = doc(0.1, "linear lr warm-up as a fraction of the total steps")
    lr_scheduler: str = doc("cosine", "after warm-up: constant | cosine")
    min_lr_ratio: float = doc(0.05, "cosine floor as a fraction of lr")
    clip_grad: float = doc(1.0, "max global gradient norm (a non-finite norm skips the step)")


@dataclass
class OfflineTrainerConfig:
    total_epochs: int = doc(1, "passes over the training rows")
    total_training_steps: Any = doc(None, "stop after this many steps; null = epochs × batches per epoch")
    project_name: str = doc("tearless", "project name (run directory and loggers)")
    experiment_name: str = doc("sft", "experiment name (run directory and loggers)")
    logger: list = doc(["console", "jsonl"], "loggers: console | jsonl | tensorboard | wandb")
    default_local_dir: str = doc(
        "runs/${trainer.project_name}/${trainer.experiment_name}",
        "run directory: metrics.jsonl and global_step_N checkpoints",
    )
    save_freq: int = doc(
        -1, "checkpoint every N steps; -1 = no intermediate checkpoint (the final one: save_final_checkpoint)"
    )
    save_final_checkpoint: bool = doc(
        True, "write a checkpoint after the last step; false = none unless save_freq asks"
    )
    test_freq: int = doc(-1, "validate every N steps (and at the end); -1 = only at the end")
    val_before_train: bool = doc(True, "validate before the first step")
    resume_mode: str = doc("auto", "auto (latest complete checkpoint) | disable | resume_path")
    resume_from_path: Any = doc(None, "a global_step_N directory, with resume_mode=resume_path")
    max_ckpt_to_keep: Any = doc(3, "keep only the newest N checkpoints; null = all")
    seed: int = doc(1, "seed of every random choice (shuffling, the embedded model's initialisation)")
    device: str = doc("auto", "auto | cpu | cuda")
    num_threads: int = doc(0, "torch CPU threads; 0 = torch's default")
    keep_freed_memory: bool = doc(True, KEEP_FREED_MEMORY_DOC)
    log_freq: int = doc(50, "print a metrics table every N steps")

    def validate(self) -> None:
        positive("trainer.total_epochs", self.total_epochs)
        if self.total_training_steps is not None:
            positive("trainer.total_training_steps", self.total_training_steps)
        for name in self.logger:
            one_of("trainer.logger", name, LOGGERS)
        one_of("trainer.device", self.device, DEVICES)
        one_of("trainer.resume_mode", self.resume_mode, RESUME_MODES)
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            fail(
                "trainer.resume_from_path",
                "is null but trainer.resume_mode=resume_path",
                "Point it at a global_step_N directory.",
            )
        positive("trainer.num_threads", self.num_threads, allow_zero=True)


@dataclass
class SFTTaskConfig:
    name: str = doc("arithmetic", "embedded task used when data.train_files is null: arithmetic")
    num_train: int = doc(2000, "generated training prompts")
    num_val: int = doc(200, "generated held-out prompts")
    warmup_steps: int = doc(
        300, "teacher demonstrations = warmup_steps × data.train_batch_size (one epoch = the warm-up)"
    )
    forget_carry: float = doc(0.7, "how often the flawed teacher drops a units carry")
    hidden_size: int = doc(128, "hidden size of the fresh tiny Llama (when model.path is null)")
    num_layers: int = doc(2, "layers of the fresh tiny Llama (when model.path is null)")


def validate_common(data: Any, model: OfflineModelConfig, optim: OfflineOptimConfig, crf: Any = None) -> None:
    """Checks shared by the SFT and DPO configs."""
    import os

    # torch: ``import tearless.config`` (``config show``, ``--help``) stays torch-free
    from tearless.data.prompts import TRUNCATION_MODES
    from tearless.models.loading import DTYPES

    if crf is not None and crf.path is not None and not os.path.isfile(os.path.expanduser(crf.path)):
        fail(
            "custom_reward_function.path",
            f"{crf.path!r} is not a file",
            "Point it at the .py file of your scorer.",
        )

    positive("data.train_batch_size", data.train_batch_size)
    if data.micro_batch_size_per_gpu is not None:
        positive("data.micro_batch_size_per_gpu", data.micro_batch_size_per_gpu)
        if data.micro_batch_size_per_gpu > data.train_batch_size:
            fail(
                "data.micro_batch_size_per_gpu",
                f"{data.micro_batch_size_per_gpu} > data.train_batch_size={data.train_batch_size}",
                "Lower it (or leave it null for one forward per step).",
            )
    positive("data.max_length", data.max_length)
    positive("data.max_response_length", data.max_response_length)
    one_of("data.truncation", data.truncation, TRUNCATION_MODES)
    one_of("model.dtype", model.dtype, tuple(DTYPES))
    positive("optim.lr", optim.lr)
    positive("optim.weight_decay", optim.weight_decay, allow_zero=True)
    positive("optim.clip_grad", optim.clip_grad)
    one_of("optim.lr_scheduler", optim.lr_scheduler, SCHEDULERS)
    in_range(
        "optim.warmup_steps_ratio",
        optim.warmup_steps_ratio,
        0,
        1,
        "Use e.g. 0.1.",
        high_open=True,
        problem=NOT_IN,
    )
    in_range("optim.min_lr_ratio", optim.min_lr_ratio, 0, 1, "Use e.g. 0.05.", problem=NOT_IN)


@dataclass
class SFTConfig:
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: OfflineModelConfig = field(default_factory=OfflineModelConfig)
    optim: OfflineOptimConfig = field(default_factory=OfflineOptimConfig)
    trainer: OfflineTrainerConfig = field(default_factory=OfflineTrainerConfig)
    task: SFTTaskConfig = field(default_factory=SFTTaskConfig)
    # The reward function of the held-out greedy accuracy on data.val_prompt_files (as in tearless train).
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first wrong key and the fix (called by ``load_config``)."""
        validate_common(self.data, self.model, self.optim, self.custom_reward_function)
        self.trainer.validate()
        if self.data.train_files is None:
            one_of("task.name", self.task.name, ("arithmetic",))
            for key in ("num_train", "num_val", "warmup_steps", "hidden_size", "num_layers"):
                positive(f"task.{key}", getattr(self.task, key))
            in_range("task.forget_carry", self.task.forget_carry, 0, 1, "Use e.g. 0.7.", problem=NOT_IN)
