"""veRL keys that tearless has no field for: one table says, for each, what happens to it.

veRL's ``ppo_trainer.yaml`` and its example scripts set keys that only concern veRL's own machinery
(Hydra targets, profilers, engine tuning, worker implementations). So that those scripts run
unchanged, every such key is in :data:`RULES` with one of three fates:

- **alias**: the value goes to the tearless key that means the same thing
  (``actor.optim.clip_grad`` → ``actor.grad_clip``);
- **notice**: accepted, with a one-line note saying why it has no effect here;
- **refused**: the value asks for something tearless does not have; the error names the key, why,
  and what to use instead. A rule with ``accept`` values takes those values with a notice (they are
  veRL's defaults, or ask for what tearless does anyway) and refuses the others.

A value that is an interpolation (``${oc.select:...}``) is veRL's own wiring of defaults and is always
taken with a notice. ``docs/verl-compat.md`` lists every key and its fate; a test checks that every key
of veRL's ``ppo_trainer.yaml`` is either a tearless key or matched here.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

ANY = None  # Rule.accept: every value is taken with a notice


@dataclass(frozen=True)
class Rule:
    """The fate of the veRL keys matching ``pattern`` (an fnmatch glob over the dotted key).

    ``accept``: values taken with a notice (``None`` = every value); other values are refused.
    ``alias``: the tearless key that receives the value instead (then there is no notice).
    ``refuse``: for a key tearless has, the veRL values it refuses with this rule's reason.
    """

    pattern: str
    why: str
    accept: tuple | None = ANY
    instead: str = ""
    alias: str | None = None
    refuse: tuple = ()


ARR = "actor_rollout_ref"
_ENGINE = "tuning of veRL's vLLM/SGLang server; tearless's rollout engines size themselves"
_PROFILER = "veRL's Nsight/NPU/torch profiler hooks; tearless logs timing_s/* metrics every step"
_TARGET = "the Hydra class veRL instantiates for the section; tearless's schema is fixed"
_COMPILE = "veRL's torch.compile switch of this worker; tearless's is actor.use_torch_compile"
_SP = "Ulysses sequence parallelism is not implemented"
_SP_INSTEAD = "leave it at 1; shorten sequences or use data-parallel workers (trainer.n_gpus_per_node)"


def _fsdp_rules(prefix: str) -> list[Rule]:
    """veRL's ``fsdp_config`` keys without a tearless field (FSDP2 is wrapped per decoder block)."""
    return [
        Rule(
            f"{prefix}.fsdp_config.dtype",
            "FSDP2 mixed-precision compute dtype",
            alias=f"{prefix}.fsdp_config.param_dtype",
        ),
        Rule(
            f"{prefix}.fsdp_config.mixed_precision.param_dtype",
            "mixed-precision compute dtype",
            alias=f"{prefix}.fsdp_config.param_dtype",
        ),
        Rule(
            f"{prefix}.fsdp_config.mixed_precision.*",
            "gradient reductions and buffers are float32",
            accept=("fp32", "float32"),
            instead="float32 (the only reduce/buffer dtype)",
        ),
        Rule(f"{prefix}.fsdp_config.wrap_policy.*", "tearless's FSDP2 shards each decoder block"),
        Rule(f"{prefix}.fsdp_config.offload_policy", "CPU offload is param_offload/optimizer_offload here"),
        Rule(
            f"{prefix}.fsdp_config.fsdp_size",
            "every worker of the pool shards the model (fsdp_size=-1)",
            accept=(-1,),
            instead="trainer.nnodes × trainer.n_gpus_per_node sets the shard group",
        ),
        Rule(f"{prefix}.fsdp_config.forward_prefetch", "an FSDP1 prefetch option; FSDP2 prefetches itself"),
        Rule(
            f"{prefix}.fsdp_config.model_dtype",
            "master weights are kept in float32",
            instead="actor_rollout_ref.model.dtype",
        ),
        Rule(f"{prefix}.fsdp_config.use_orig_params", "an FSDP1 option; FSDP2 keeps the original parameters"),
        Rule(f"{prefix}.fsdp_config.seed", "initialisation and sampling are seeded by trainer.seed"),
        Rule(f"{prefix}.fsdp_config.full_determinism", "sampling is keyed by (seed, step, prompt, sample)"),
        Rule(f"{prefix}.fsdp_config.ulysses_sequence_parallel_size", _SP, accept=(1,), instead=_SP_INSTEAD),
        *_entropy_rules(prefix, f"{prefix}.fsdp_config"),
        Rule(f"{prefix}.fsdp_config.use_torch_compile", _COMPILE),
        Rule(f"{prefix}.fsdp_config.forward_only", "set by veRL itself for the reference worker"),
        Rule(
            f"{prefix}.fsdp_config.strategy",
            "tearless shards with FSDP2",
            accept=("fsdp", "fsdp2"),
            instead="no Megatron backend: use strategy=fsdp",
        ),
    ]


def _optim_rules(prefix: str, grad_clip: str) -> list[Rule]:
    return [
        Rule(
            f"{prefix}.optim.optimizer",
            "the optimizer is AdamW",
            accept=("AdamW",),
            instead="AdamW (the only optimizer)",
        ),
        Rule(
            f"{prefix}.optim.optimizer_impl",
            "torch.optim.AdamW is used",
            accept=("torch.optim",),
            instead="torch.optim",
        ),
        Rule(f"{prefix}.optim.total_training_steps", "set from trainer.total_training_steps by the trainer"),
        Rule(f"{prefix}.optim.clip_grad", "max global gradient norm", alias=grad_clip),
        Rule(
            f"{prefix}.optim.warmup_style",
            "veRL's old name of the schedule",
            alias=f"{prefix}.optim.lr_scheduler_type",
        ),
        Rule(
            f"{prefix}.optim.override_optimizer_config",
            "no extra optimizer arguments",
            accept=(None,),
            instead=f"{prefix}.optim.betas / weight_decay",
        ),
    ]


def _entropy_rules(role: str, section: str) -> list[Rule]:
    """veRL's two entropy memory keys under ``section`` of ``role``: the actor's keys
    (``actor.entropy_from_logits_with_chunking`` / ``entropy_checkpointing``) where they are the
    actor's, the reference following the actor's, the critic having no vocabulary."""
    keys = ("entropy_from_logits_with_chunking", "entropy_checkpointing")
    if role == f"{ARR}.actor":
        return [Rule(f"{section}.{k}", "the actor's key", alias=f"{ARR}.actor.{k}") for k in keys]
    why = (
        "the reference's log-probs follow actor_rollout_ref.actor.entropy_from_logits_with_chunking"
        if role == f"{ARR}.ref"
        else "the critic computes no log-probs or entropy"
    )
    return [Rule(f"{section}.{k}", why) for k in keys]


def _worker_rules(prefix: str) -> list[Rule]:
    """Keys shared by veRL's actor, ref and critic worker sections."""
    return [
        Rule(f"{prefix}.profiler.*", _PROFILER),
        Rule(
            f"{prefix}.router_replay.*",
            "MoE router replay; tearless has no MoE-specific path",
            accept=("disabled", None),
            instead="leave router_replay.mode=disabled",
        ),
        Rule(f"{prefix}.rollout_n", "veRL's copy of actor_rollout_ref.rollout.n"),
        Rule(
            f"{prefix}.strategy",
            "tearless shards with FSDP2",
            accept=("fsdp", "fsdp2"),
            instead="no Megatron backend: use strategy=fsdp",
        ),
        *([Rule(f"{prefix}.use_torch_compile", _COMPILE)] if prefix == "critic" else []),
        Rule(f"{prefix}.ulysses_sequence_parallel_size", _SP, accept=(1,), instead=_SP_INSTEAD),
        *([] if prefix == f"{ARR}.actor" else _entropy_rules(prefix, prefix)),
        Rule(f"{prefix}.data_loader_seed", "the data order is seeded by data.seed / trainer.seed"),
        Rule(
            f"{prefix}.checkpoint.async_save",
            "checkpoints are written atomically, synchronously",
            accept=(False,),
            instead="leave it false",
        ),
        Rule(f"{prefix}.checkpoint.*", "checkpoints always hold the model, the optimizer and the run state"),
    ]


RULES: list[Rule] = [
    # Hydra and veRL-wide sections.
    Rule("defaults", "Hydra's composition list; tearless merges its own defaults"),
    Rule("*._target_", _TARGET),
    Rule("global_profiler.*", _PROFILER),
    Rule(
        "transfer_queue.enable",
        "veRL's experimental TransferQueue data plane",
        accept=(False,),
        instead="leave it false",
    ),
    Rule("ray_kwargs.ray_init.num_cpus", "CPUs of a local Ray cluster", alias="ray_init.num_cpus"),
    Rule("ray_kwargs.timeline_json_file", "Ray timelines are not dumped; timing_s/* metrics are logged"),
    Rule("reward_manager.name", "the reward manager", alias="reward_model.reward_manager"),
    Rule(
        "reward_manager.source",
        "reward managers are tearless's own (naive | batch | prime | dapo)",
        accept=("register",),
        instead="custom_reward_function.path for your own scorer",
    ),
    Rule(
        "reward_manager.module.*",
        "no custom reward-manager modules",
        accept=(None, "custom_reward_manager"),
        instead="custom_reward_function.path with reward_model.reward_manager=batch",
    ),
    Rule(
        f"{ARR}.hybrid_engine",
        "the training workers generate (hybrid engine)",
        accept=(True,),
        instead="actor_rollout_ref.rollout.nnodes / n_gpus_per_node for separate rollout workers",
    ),
    Rule(f"{ARR}.nccl_timeout", "collective timeouts follow trainer.worker_timeout_s"),
    # The model.
    *[
        Rule(f"{ARR}.model.{k}", why)
        for k, why in [
            ("use_shm", "models are read from local directories, not copied to shared memory"),
            ("use_liger", "Liger kernels are a speed option; tearless uses torch's own kernels"),
            ("fused_kernel_options.*", "fused log-prob kernels are a speed option; the maths is the same"),
            ("tiled_mlp.*", "tiled MLP is a memory option of veRL's Megatron/FSDP workers"),
        ]
    ],
    Rule(
        f"{ARR}.model.custom_chat_template", "a chat template given by the user", alias="data.chat_template"
    ),
    Rule(
        f"{ARR}.model.hf_config_path",
        "the model directory's own config.json is used",
        accept=(None,),
        instead="edit config.json in a copy of the model directory",
    ),
    Rule(
        f"{ARR}.model.trust_remote_code",
        "models load without remote code",
        accept=(False,),
        instead="a model architecture transformers ships",
    ),
    Rule(
        f"{ARR}.model.override_config",
        "the model's config is used as saved",
        accept=({},),
        instead="edit config.json in a copy of the model directory",
    ),
    Rule(
        f"{ARR}.model.enable_activation_offload",
        "activation offload is not implemented",
        accept=(False,),
        instead="actor_rollout_ref.model.enable_gradient_checkpointing=true",
    ),
    Rule(
        f"{ARR}.model.exclude_modules",
        "LoRA adapters go on model.target_modules",
        accept=(None,),
        instead="list the wanted layers in actor_rollout_ref.model.target_modules",
    ),
    Rule(
        f"{ARR}.model.mtp.enable*",
        "multi-token-prediction heads are not implemented",
        accept=(False,),
        instead="leave mtp disabled",
    ),
    Rule(f"{ARR}.model.mtp.*", "settings of the multi-token-prediction heads (mtp.enable=false)"),
    # The actor and reference workers.
    *_worker_rules(f"{ARR}.actor"),
    *_worker_rules(f"{ARR}.ref"),
    *_optim_rules(f"{ARR}.actor", f"{ARR}.actor.grad_clip"),
    *_fsdp_rules(f"{ARR}.actor"),
    *_fsdp_rules(f"{ARR}.ref"),
    Rule(
        f"{ARR}.actor.ppo_micro_batch_size",
        "veRL's deprecated global micro-batch size",
        accept=(None,),
        instead="actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    ),
    Rule(
        f"{ARR}.actor.use_prefix_grouper",
        "prompt sharing is actor_rollout_ref.model.share_prompt_forward (on by default)",
    ),
    Rule(
        f"{ARR}.actor.use_fused_kernels", "fused log-prob kernels are a speed option; the maths is the same"
    ),
    Rule(f"{ARR}.actor.use_remove_padding", "veRL's copy of actor_rollout_ref.model.use_remove_padding"),
    Rule(
        f"{ARR}.actor.calculate_sum_pi_squared",
        "the Σπ² diagnostic is not computed",
        accept=(False,),
        instead="leave it false",
    ),
    Rule(f"{ARR}.actor.sum_pi_squared_checkpointing", "the Σπ² diagnostic is not computed"),
    Rule(
        f"{ARR}.ref.log_prob_micro_batch_size",
        "veRL's deprecated global micro-batch size",
        accept=(None,),
        instead="actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    ),
    Rule(
        f"{ARR}.ref.log_prob_use_dynamic_bsz",
        "reference forwards are batched by rows (ref.log_prob_micro_batch_size_per_gpu)",
    ),
    Rule(
        f"{ARR}.ref.log_prob_max_token_len_per_gpu",
        "reference forwards are batched by rows (ref.log_prob_micro_batch_size_per_gpu)",
    ),
    # The rollout.
    Rule(
        f"{ARR}.rollout.name",
        "tearless's engines are hf (built in) and vllm; there is no sglang or TensorRT-LLM backend",
        refuse=("sglang", "trtllm"),
        instead="actor_rollout_ref.rollout.name=vllm on a GPU, or hf",
    ),
    Rule(
        f"{ARR}.rollout.mode",
        "veRL's async mode serves generation through its agent-loop server; the samples and the "
        "on-policy update are the same as tearless's in-process generation",
        accept=("sync", "async"),
        instead="sync or async",
    ),
    Rule(f"{ARR}.rollout.prompt_length", "veRL's copy of data.max_prompt_length"),
    Rule(
        f"{ARR}.rollout.ignore_eos",
        "generation stops at EOS",
        accept=(False,),
        instead="leave it false; raise data.max_response_length for longer answers",
    ),
    Rule(
        f"{ARR}.rollout.do_sample",
        "training rollouts are sampled",
        accept=(True,),
        instead="a low actor_rollout_ref.rollout.temperature",
    ),
    Rule(
        f"{ARR}.rollout.calculate_log_probs", "rollout_corr/* metrics compare rollout and trainer log-probs"
    ),
    Rule(
        f"{ARR}.rollout.over_sample_rate",
        "every requested response is generated",
        accept=(0, 0.0),
        instead="leave it at 0",
    ),
    Rule(
        f"{ARR}.rollout.log_prob_micro_batch_size",
        "veRL's deprecated global micro-batch size",
        accept=(None,),
        instead="actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    ),
    Rule(
        f"{ARR}.rollout.log_prob_use_dynamic_bsz",
        "old-log-prob forwards are batched by rows (rollout.log_prob_micro_batch_size_per_gpu)",
    ),
    Rule(
        f"{ARR}.rollout.log_prob_max_token_len_per_gpu",
        "old-log-prob forwards are batched by rows (rollout.log_prob_micro_batch_size_per_gpu)",
    ),
    Rule(
        f"{ARR}.rollout.quantization",
        "rollout quantization is not implemented",
        accept=(None,),
        instead="actor_rollout_ref.rollout.dtype=bfloat16",
    ),
    Rule(
        f"{ARR}.rollout.quantization_config_file",
        "rollout quantization is not implemented",
        accept=(None,),
        instead="actor_rollout_ref.rollout.dtype=bfloat16",
    ),
    Rule(
        f"{ARR}.rollout.data_parallel_size",
        "each worker runs its own engine (data-parallel rollout)",
        accept=(1,),
        instead="more workers: trainer.n_gpus_per_node",
    ),
    Rule(
        f"{ARR}.rollout.expert_parallel_size", "no expert parallelism", accept=(1,), instead="leave it at 1"
    ),
    Rule(
        f"{ARR}.rollout.pipeline_model_parallel_size",
        "no pipeline parallelism",
        accept=(1,),
        instead="leave it at 1",
    ),
    Rule(f"{ARR}.rollout.skip_rollout", "every step generates", accept=(False,), instead="leave it false"),
    Rule(f"{ARR}.rollout.skip_dump_dir", "every step generates"),
    Rule(
        f"{ARR}.rollout.enable_rollout_routing_replay",
        "MoE router replay is not implemented",
        accept=(False,),
        instead="leave it false",
    ),
    Rule(f"{ARR}.rollout.mtp", "veRL's copy of actor_rollout_ref.model.mtp"),
    Rule(
        f"{ARR}.rollout.multi_turn.interaction_config_path",
        "no simulated-user interactions",
        accept=(None,),
        instead="tools: actor_rollout_ref.rollout.multi_turn.tool_config_path",
    ),
    Rule(
        f"{ARR}.rollout.multi_turn.use_inference_chat_template",
        "the agent loop renders every turn with the tokenizer's chat template",
    ),
    Rule(
        f"{ARR}.rollout.multi_turn.tokenization_sanity_check_mode",
        "the agent loop builds token ids turn by turn and checks them itself",
    ),
    Rule(
        f"{ARR}.rollout.multi_turn.num_repeat_rollouts",
        "responses per prompt are rollout.n",
        accept=(None,),
        instead="actor_rollout_ref.rollout.n",
    ),
    Rule(f"{ARR}.rollout.agent.*", "the agent loop runs in the rollout worker (no agent-loop server pool)"),
    Rule(f"{ARR}.rollout.checkpoint_engine.*", "weights go to the engine by tearless's own weight sync"),
    Rule(f"{ARR}.rollout.trace.*", "rollouts are recorded in RUN_DIR/rollouts.jsonl.gz (tearless samples)"),
    Rule(f"{ARR}.rollout.prometheus.*", "no Prometheus exporter; metrics go to trainer.logger"),
    Rule(f"{ARR}.rollout.profiler.*", _PROFILER),
    *[
        Rule(f"{ARR}.rollout.{k}", _ENGINE)
        for k in (
            "cudagraph_capture_sizes",
            "max_num_batched_tokens",
            "max_model_len",
            "max_num_seqs",
            "enable_chunked_prefill",
            "enable_prefix_caching",
            "logprobs_mode",
            "scheduling_policy",
            "disable_log_stats",
            "multi_stage_wake_up",
            "skip_tokenizer_init",
            "engine_kwargs.*",
            "engine_kwargs",
        )
    ],
    Rule(
        f"{ARR}.rollout.load_format",
        "how veRL's engine first loads weights; tearless's engines get the actor's weights directly",
    ),
    Rule(
        f"{ARR}.rollout.layered_summon",
        "veRL gathers LoRA weights layer by layer for its vLLM server; tearless's engines take the "
        "policy's weights through its own weight sync",
    ),
    # The critic.
    *_worker_rules("critic"),
    *_optim_rules("critic", "critic.grad_clip"),
    *_fsdp_rules("critic.model"),
    Rule(
        "critic.ppo_micro_batch_size",
        "veRL's deprecated global micro-batch size",
        accept=(None,),
        instead="critic.ppo_micro_batch_size_per_gpu",
    ),
    Rule("critic.forward_micro_batch_size", "veRL's deprecated global micro-batch size"),
    Rule(
        "critic.forward_max_token_len_per_gpu",
        "value forwards are batched by rows (critic.forward_micro_batch_size_per_gpu)",
    ),
    *[
        Rule(f"critic.model.{k}", why, accept=acc, instead=inst)
        for k, why, acc, inst in [
            (
                "override_config",
                "the model's config is used as saved",
                ({},),
                "a copy of the model directory",
            ),
            ("external_lib", "every process imports actor_rollout_ref.model.external_lib's modules", ANY, ""),
            ("trust_remote_code", "models load without remote code", ANY, ""),
            ("use_shm", "models are read from local directories", ANY, ""),
            (
                "enable_activation_offload",
                "activation offload is not implemented",
                (False,),
                "critic.model.enable_gradient_checkpointing=true",
            ),
            ("tiled_mlp.*", "tiled MLP is a memory option of veRL's workers", ANY, ""),
            (
                "lora_rank",
                "the critic is trained in full",
                (0,),
                "LoRA on the actor: actor_rollout_ref.model.lora_rank",
            ),
            ("lora_alpha", "the critic is trained in full (critic.model.lora_rank=0)", ANY, ""),
            ("target_modules", "the critic is trained in full (critic.model.lora_rank=0)", ANY, ""),
        ]
    ],
    # The reward model and data.
    *[
        Rule(f"reward_model.{k}", why, accept=acc, instead=inst)
        for k, why, acc, inst in [
            (
                "enable_resource_pool",
                "the reward model runs in the trainer's workers",
                (False,),
                "leave it false",
            ),
            ("n_gpus_per_node", "the reward model runs in the trainer's workers", ANY, ""),
            ("nnodes", "the reward model runs in the trainer's workers", ANY, ""),
            ("strategy", "the reward model runs in the trainer's workers", ANY, ""),
            (
                "model.input_tokenizer",
                "responses are re-tokenised with the reward model's own tokenizer",
                ANY,
                "",
            ),
            (
                "model.external_lib",
                "every process imports actor_rollout_ref.model.external_lib's modules",
                ANY,
                "",
            ),
            (
                "model.trust_remote_code",
                "models load without remote code",
                (False,),
                "a transformers architecture",
            ),
            (
                "model.override_config",
                "the model's config is used as saved",
                ({},),
                "a copy of the model directory",
            ),
            ("model.use_shm", "models are read from local directories", ANY, ""),
            ("model.use_remove_padding", "reward-model forwards are small and padded", ANY, ""),
            ("model.use_fused_kernels", "a speed option", ANY, ""),
            ("model.fsdp_config.*", "the reward model is not sharded", ANY, ""),
            (
                "micro_batch_size",
                "veRL's deprecated global micro-batch size",
                (None,),
                "reward_model.micro_batch_size_per_gpu",
            ),
            ("use_dynamic_bsz", "reward-model forwards are batched by pairs", ANY, ""),
            ("forward_max_token_len_per_gpu", "reward-model forwards are batched by pairs", ANY, ""),
            ("reward_loop_source", "tearless's reward managers score in a worker pool", ANY, ""),
            ("reward_loop_module_path", "no custom reward loops", (None,), "custom_reward_function.path"),
            ("reward_loop_class_name", "no custom reward loops", (None,), "custom_reward_function.path"),
            ("launch_reward_fn_async", "scoring runs in reward_model.num_workers processes", ANY, ""),
            ("use_reward_loop", "scoring runs in reward_model.num_workers processes", ANY, ""),
            (
                "sandbox_fusion.url",
                "code runs in tearless's own sandbox (data_source codecontests etc.)",
                (None,),
                "leave it null",
            ),
            ("sandbox_fusion.*", "code runs in tearless's own sandbox", ANY, ""),
            ("profiler.*", _PROFILER, ANY, ""),
            ("ulysses_sequence_parallel_size", _SP, (1,), _SP_INSTEAD),
            (
                "rollout.*",
                "generative reward models are not implemented; this section is then unused",
                ANY,
                "",
            ),
        ]
    ],
    Rule("data.tokenizer", "the tokenizer directory", alias=f"{ARR}.model.tokenizer_path"),
    *[
        Rule(f"data.{k}", why, accept=acc, instead=inst)
        for k, why, acc, inst in [
            ("use_shm", "data files are read from local paths", ANY, ""),
            (
                "reward_fn_key",
                "scorers are chosen by the data_source column",
                ("data_source",),
                "put the scorer's name in data_source",
            ),
            ("tool_config_path", "veRL's copy of rollout.multi_turn.tool_config_path", ANY, ""),
            ("return_raw_input_ids", "rows keep both their messages and token ids", ANY, ""),
            (
                "return_raw_chat",
                "rows always keep their chat messages (raw_prompt) next to the templated ids",
                ANY,
                "",
            ),
            ("return_full_prompt", "rollout records hold the full prompt text", ANY, ""),
            ("dataloader_num_workers", "prompts are tokenised once, before training", ANY, ""),
            ("filter_overlong_prompts_workers", "prompts are tokenised once, before training", ANY, ""),
            (
                "validation_shuffle",
                "validation runs over every prompt in file order",
                (False,),
                "leave it false",
            ),
            ("image_patch_size", "the model's processor sizes its image patches", ANY, ""),
            ("video_key", "video inputs are not read (images are: data.image_key)", ANY, ""),
            (
                "return_multi_modal_inputs",
                "an image row's pixel inputs always travel with its prompt",
                ANY,
                "",
            ),
            ("trust_remote_code", "tokenizers load without remote code", ANY, ""),
            ("custom_cls.*", "no custom dataset classes", (None,), "write the rows in veRL's parquet schema"),
            (
                "sampler.*",
                "prompts are drawn by tearless's loader (data.shuffle, data.seed)",
                (None,),
                "data.shuffle / data.seed",
            ),
            ("datagen.*", "no dynamic data generation", (None,), "tearless data make TASK writes parquet"),
        ]
    ],
    # The algorithm and trainer.
    Rule(
        "algorithm.use_pf_ppo",
        "PF-PPO reweighting is not implemented",
        accept=(False,),
        instead="leave it false",
    ),
    Rule("algorithm.pf_ppo.*", "PF-PPO reweighting is not implemented (algorithm.use_pf_ppo=false)"),
    *[
        Rule(
            f"algorithm.rollout_correction.{k}",
            why,
            accept=acc,
            instead="algorithm.rollout_correction.rollout_is",
        )
        for k, why, acc in [
            ("loss_type", "the importance weight multiplies the PPO-clip loss", ("ppo_clip",)),
            ("rollout_is_batch_normalize", "importance weights are not renormalised per batch", (False,)),
        ]
    ],
    *[
        Rule(f"trainer.{k}", why, accept=acc, instead=inst)
        for k, why, acc, inst in [
            (
                "use_legacy_worker_impl",
                "chooses between veRL's two worker implementations; tearless has one",
                ANY,
                "",
            ),
            (
                "balance_batch",
                "balances tokens across data-parallel ranks; tearless's update schedule "
                "normalises every mini-batch globally",
                ANY,
                "",
            ),
            ("log_val_generations", "validation and rollout samples: tearless samples RUN_DIR", ANY, ""),
            ("rollout_data_dir", "rollouts are written to RUN_DIR/rollouts.jsonl.gz", ANY, ""),
            ("validation_data_dir", "validation metrics are written to RUN_DIR/metrics.jsonl", ANY, ""),
            ("esi_redundant_time", "checkpoints are saved on trainer.save_freq", ANY, ""),
            ("default_hdfs_dir", "no HDFS upload", (None,), "copy trainer.default_local_dir yourself"),
            (
                "del_local_ckpt_after_load",
                "checkpoints are kept (trainer.max_actor_ckpt_to_keep prunes)",
                (False,),
                "trainer.max_actor_ckpt_to_keep",
            ),
            (
                "max_critic_ckpt_to_keep",
                "one checkpoint holds actor and critic (trainer.max_actor_ckpt_to_keep)",
                ANY,
                "",
            ),
            ("ray_wait_register_center_timeout", "worker waits follow trainer.worker_timeout_s", ANY, ""),
        ]
    ],
]


# veRL's SFT trainer (fsdp_sft_trainer.yaml) names the model to fine-tune model.partial_pretrain.
SFT_RULES: list[Rule] = [
    Rule("model.partial_pretrain", "veRL SFT's name of the model directory", alias="model.path"),
]


def rules_for(schema_name: str) -> list[Rule]:
    """The table for a config schema: the RL trainer's (``Config``), SFT's, or none (DPO)."""
    return {"Config": RULES, "SFTConfig": SFT_RULES}.get(schema_name, [])


def rule_for(key: str, rules: list[Rule] | None = None) -> Rule | None:
    """The first rule whose pattern matches ``key`` (a ``*`` glob may span dots)."""
    for rule in RULES if rules is None else rules:
        if fnmatch.fnmatchcase(key, rule.pattern):
            return rule
    return None


def _same(value: Any, accepted: Any) -> bool:
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    if accepted is None:
        return value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~"))
    return bool(value == accepted)


def _interpolation(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("${")


class Refused(ValueError):
    """A veRL key whose value asks for something tearless does not have."""


def translate(
    tree: dict,
    known: Callable[[str], str | None],
    source: str,
    notify: Callable[[str], None],
    rules: list[Rule] = RULES,
) -> dict:
    """``tree`` (a nested dict of one config layer) with veRL-only keys taken out.

    ``known(key)`` is ``"leaf"`` for a tearless key, ``"section"`` for a tearless section and ``None``
    otherwise; tearless keys stay. For every other key matched by :data:`RULES`: an alias moves the
    value to the tearless key, an accepted value is dropped after ``notify`` receives its one-line
    note, and any other value raises :class:`Refused`. Keys matched by no rule stay, so the schema
    reports them as unknown (with its spelling suggestions).
    """
    out: dict = {}
    for key, value in _walk(tree, known, rules):
        rule = rule_for(key, rules)
        if known(key) and rule is not None and any(_same(value, r) for r in rule.refuse):
            raise _refused(key, value, source, rule)
        if known(key) or rule is None:
            _put(out, key, value)
        elif rule.alias is not None:
            # veRL's null and its interpolations mean "the default", which the tearless key has.
            if value is not None and not _interpolation(value):
                _put(out, rule.alias, value)
        elif rule.accept is ANY or _interpolation(value) or any(_same(value, a) for a in rule.accept):
            notify(f"{key}={_show(value)} has no effect here: {rule.why}")
        else:
            raise _refused(key, value, source, rule)
    return out


def _refused(key: str, value: Any, source: str, rule: Rule) -> Refused:
    return Refused(
        f"config key {key!r}={_show(value)} (from {source}) is not supported: {rule.why}. "
        f"Instead: {rule.instead or 'remove the key'}"
    )


def _walk(
    tree: dict, known: Callable[[str], str | None], rules: list[Rule], prefix: str = ""
) -> Iterator[tuple[str, Any]]:
    """The leaves of ``tree`` as (dotted key, value). A tearless key holding a dict (reward_kwargs)
    is one leaf, and so is a dict matched by a rule (engine_kwargs)."""
    for k, v in tree.items():
        key = f"{prefix}{k}"
        kind = known(key)
        if (
            isinstance(v, dict)
            and v
            and (kind == "section" or (kind is None and rule_for(key, rules) is None))
        ):
            yield from _walk(v, known, rules, key + ".")
        else:
            yield key, v


def _put(tree: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[last] = value


def _show(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= 60 else text[:57] + "..."
