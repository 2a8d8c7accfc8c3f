"""Configuration of ``tearless dpo``: offline preference optimisation (DPO and its family, CPO,
SimPO, ORPO on pairs; KTO on unpaired examples).

veRL has no DPO trainer, so the algorithm keys follow TRL's ``DPOConfig`` (``beta``, ``loss_type``,
``label_smoothing``, ``reference_free``, ``f_divergence_type``, ``discopop_tau``), ``CPOConfig``
(``cpo_alpha``, ``simpo_gamma``) and ``KTOConfig`` (``desirable_weight``, ``undesirable_weight``)
under ``algorithm``; data, model, optim and trainer keys are those of ``tearless sft``. With no data
and no model, ``tearless dpo`` starts from the embedded task's warmed-up model and trains on
preference pairs made from its own samples (correct vs incorrect answers, judged by the task's
verifier), cached next to the task; KTO reads each pair as two unpaired examples.
"""

# ruff: noqa: RUF009  (doc() returns a dataclasses.field carrying the help text; RUF009 cannot see that)

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tearless.config.errors import fail, in_range, one_of, positive
from tearless.config.schema import CustomRewardConfig, TaskConfig, doc
from tearless.config.sft import (
    NOT_IN,
    OfflineModelConfig,
    OfflineOptimConfig,
    OfflineTrainerConfig,
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
    completion_key: str = doc(
        "completion", "KTO: response column of an unpaired row (TRL's format: prompt, completion, label)"
    )
    label_key: str = doc(
        "label", "KTO: label column of an unpaired row, true = desirable (a paired row gives two examples)"
    )
    max_length: int = doc(1024, "longest prompt + response in tokens")
    truncation: str = doc(
        "error", "longer sequences: error | left (keep the end) | right (keep the start) | middle"
    )
    train_batch_size: int = doc(32, "preference pairs per optimizer step")
    micro_batch_size_per_gpu: Any = doc(
        None,
        "pairs (KTO: examples) per forward/backward (the loss is still the step's mean); null = all. "
        "aot and aot_unpaired sort the whole step's pairs, so they need null",
    )
    shuffle: bool = doc(True, "shuffle training pairs each epoch (seeded by data.seed)")
    seed: Any = doc(None, "shuffle seed; null = trainer.seed")
    max_response_length: int = doc(16, "cap on generated tokens in the greedy accuracy check")
    val_max_samples: int = doc(-1, "use at most this many validation pairs and prompts (-1 = all)")


LOSS_TYPE_DOC = (
    "the loss (formulas in tearless.algos.dpo / .preference). Pairs, TRL's DPO loss types: sigmoid "
    "(DPO) | hinge (SLiC) | ipo (per-token, as TRL) | exo_pair | nca_pair | robust (rDPO) | bco_pair | "
    "sppo_hard | aot | aot_unpaired | apo_zero | apo_down | discopop | sft | sigmoid_norm; tearless "
    "extras: cdpo (conservative DPO, TRL <= 0.28's sigmoid + label_smoothing) | ipo_sum (IPO on summed "
    "log-ratios); reference-free: cpo | simpo | orpo. Unpaired: kto | apo_zero_unpaired | implicit_prm "
    "(PRIME's outcome-label cross-entropy, which trains an implicit process reward model)"
)


@dataclass
class DPOAlgorithmConfig:
    loss_type: str = doc("sigmoid", LOSS_TYPE_DOC)
    beta: float = doc(
        2.0,
        "β (> 0): the strength of the implicit KL to the reference; for ipo/ipo_sum the paper's τ, for "
        "orpo the weight λ of the odds-ratio term (TRL's ORPOConfig.beta), for simpo the reward scale. "
        "2.0 is tuned for the embedded tiny model's DPO (TRL: 0.1; with 0.1 chosen log-probs fall and "
        "greedy accuracy barely moves)",
    )
    label_smoothing: float = doc(
        0.0,
        "ε in [0, 0.5): the share of labels assumed flipped, for robust, cdpo, aot, aot_unpaired, cpo, "
        "simpo, and EXO's ε for exo_pair (needs > 0; the paper: 1e-3). TRL >= 0.29 ignores it for "
        "sigmoid; here a nonzero value with any other loss type is an error",
    )
    reference_free: bool = doc(
        False,
        "DPO family: score against a uniform reference (log π_ref = 0) instead of the initial model "
        "(cpo, simpo and orpo never use a reference)",
    )
    f_divergence_type: str = doc(
        "reverse_kl",
        "f-DPO (Wang et al. 2023, TRL's key): the divergence whose f' maps log-ratios to scores, "
        "reverse_kl (DPO) | forward_kl | js_divergence | alpha_divergence; DPO family only",
    )
    f_alpha_divergence_coef: float = doc(0.5, "α of alpha_divergence (TRL's key)")
    discopop_tau: float = doc(0.05, "τ of discopop, the temperature of its blend weight (> 0; TRL's key)")
    simpo_gamma: float = doc(0.5, "γ of simpo, the target reward margin (TRL's CPOConfig.simpo_gamma)")
    cpo_alpha: Any = doc(
        None,
        "weight of the NLL (behaviour cloning) term of cpo and simpo; null = 1.0 for cpo (TRL's "
        "default), 0 for simpo (the paper's SimPO; TRL's CPOTrainer uses 1.0 there too, i.e. CPO-SimPO)",
    )
    desirable_weight: float = doc(1.0, "kto/apo_zero_unpaired: λ_D, the weight of desirable examples (> 0)")
    undesirable_weight: float = doc(
        1.0, "kto/apo_zero_unpaired: λ_U, the weight of undesirable examples (> 0)"
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
    # The reward function of the held-out greedy accuracy on data.val_prompt_files (as in tearless train).
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first wrong key and the fix (called by ``load_config``)."""
        validate_common(self.data, self.model, self.optim, self.custom_reward_function)
        self.trainer.validate()
        validate_algorithm(self.algorithm, self.data, self.model)
        if self.data.train_files is None:
            validate_pair_task(self.task)


def validate_pair_task(task: DPOTaskConfig) -> None:
    """The ``task`` keys that make the embedded task's preference pairs (``tearless dpo`` and ``rm``)."""
    one_of("task.name", task.name, ("arithmetic",))
    for key in ("num_train", "num_val", "warmup_steps", "samples_per_prompt"):
        positive(f"task.{key}", getattr(task, key))
    positive("task.temperature", task.temperature)
    if task.samples_per_prompt < 2:
        fail(
            "task.samples_per_prompt", "must be >= 2 to find a correct and an incorrect answer", "Use e.g. 8."
        )


def validate_algorithm(alg: DPOAlgorithmConfig, data: DPODataConfig, model: DPOModelConfig) -> None:
    """The ``algorithm`` keys against each other and against the batch and model settings."""
    import inspect

    # torch: ``import tearless.config`` (``config show``, ``--help``) stays torch-free
    from tearless.algos import DPO_LOSSES, F_DIVERGENCES, KTO_LOSSES, REFERENCE_FREE

    kind = alg.loss_type
    one_of("algorithm.loss_type", kind, tuple(sorted(DPO_LOSSES)) + tuple(sorted(KTO_LOSSES)))
    positive("algorithm.beta", alg.beta)
    positive("algorithm.discopop_tau", alg.discopop_tau)
    positive("algorithm.desirable_weight", alg.desirable_weight)
    positive("algorithm.undesirable_weight", alg.undesirable_weight)
    one_of("algorithm.f_divergence_type", alg.f_divergence_type, tuple(F_DIVERGENCES))
    if alg.cpo_alpha is not None:
        positive("algorithm.cpo_alpha", alg.cpo_alpha, allow_zero=True)
    in_range(
        "algorithm.label_smoothing",
        alg.label_smoothing,
        0,
        0.5,
        "Use e.g. 0.1.",
        high_open=True,
        problem=NOT_IN,
    )
    takes = sorted(k for k, f in DPO_LOSSES.items() if "label_smoothing" in inspect.signature(f).parameters)
    if alg.label_smoothing and kind not in takes:
        fix = (
            "TRL >= 0.29 ignores it for sigmoid: use algorithm.loss_type=robust (robust DPO) or cdpo "
            "(conservative DPO, TRL <= 0.28's sigmoid with label smoothing)."
            if kind == "sigmoid"
            else f"Set it to 0 or use a loss type that takes it: {', '.join(takes)}."
        )
        fail("algorithm.label_smoothing", f"is not defined for loss_type={kind}", fix)
    if kind == "exo_pair" and alg.label_smoothing == 0:
        fail("algorithm.label_smoothing", "exo_pair needs ε > 0", "The EXO paper uses 1e-3.")
    no_reference = kind in REFERENCE_FREE
    if alg.f_divergence_type != "reverse_kl" and (no_reference or kind in KTO_LOSSES):
        fail(
            "algorithm.f_divergence_type",
            f"applies to the DPO family, not loss_type={kind}",
            "Leave it at reverse_kl.",
        )
    if alg.reference_free and (no_reference or kind in KTO_LOSSES):
        what = "never uses a reference" if no_reference else "needs its reference"
        fail("algorithm.reference_free", f"loss_type={kind} {what}", "Leave it at false.")
    if (alg.reference_free or no_reference) and model.ref_path is not None:
        fail("model.ref_path", f"is set but loss_type={kind} here uses no reference", "Drop model.ref_path.")
    micro = data.micro_batch_size_per_gpu
    if kind in ("aot", "aot_unpaired") and micro is not None and micro < data.train_batch_size:
        fail(
            "data.micro_batch_size_per_gpu",
            f"{kind} sorts the margins of the whole step, so its pairs cannot be split into micro-batches",
            "Set it to null.",
        )
