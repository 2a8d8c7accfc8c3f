"""The memory estimate of a run's training rank from its config (:mod:`tearless.models.memory`), and,
before any weight is loaded, the one-line refusal when a GPU cannot hold the rank's state, or the
one warning line when only the activations' or KV cache's upper bound exceeds it."""

from __future__ import annotations

import math
from typing import Any

from tearless.config.derived import world_size
from tearless.config.errors import ConfigError
from tearless.config.plan import ROLES, RunPlan, build_plan
from tearless.config.schema import Config
from tearless.config.user_model import is_user_model
from tearless.devices import device_defaults
from tearless.models.memory import GIB, MemoryEstimate, ModelShape, critic_part, estimate

ARR = "actor_rollout_ref"


def run_estimate(
    cfg: Config,
    model_config: Any,
    device: str,
    teacher_config: Any = None,
    *,
    plan: RunPlan | None = None,
    critic_config: Any = None,
) -> MemoryEstimate:
    """The actor rank's estimate (with the reference's weights when it is a separate model, the
    teacher's, of ``teacher_config``'s shape, when the run distils one, and a critic's, of
    ``critic_config``'s shape (default the actor's), when it trains one on the same ranks):
    micro-batches of ``ppo_max_token_len_per_gpu`` tokens under ``use_dynamic_bsz``, else of
    ``ppo_micro_batch_size_per_gpu`` (or the whole mini-batch of ``ppo_mini_batch_size × n``)
    sequences of ``max_prompt_length`` + the response cap; the rollout caching the rank's share of
    ``train_batch_size × n`` such sequences; bf16 compute on CUDA or where ``param_dtype`` asks for
    a 16-bit type, else float32. Activations and KV cache are upper bounds in the lengths: every
    sequence at its cap, and a group's prompt counted once per response although
    ``share_prompt_forward`` forwards it once. Compute copies and a LoRA base held in bf16 count only
    where the models are not sharded (:meth:`RunPlan.sharded`: a group of ranks, or a role offloading
    on one GPU, computes through FSDP2's mixed precision); with Ray's ``trainer.colocate=false`` the
    reference, teacher and critic are on GPUs of their own and left out. The response cap, the roles
    and the actor's ``param_dtype`` are ``plan``'s (the trainer's, ``auto`` measured; default
    :func:`build_plan`'s)."""
    plan = plan or build_plan(cfg)
    arr, data = cfg.actor_rollout_ref, cfg.data
    actor, n, world = arr.actor, arr.rollout.n, world_size(cfg)
    shape = ModelShape.from_config(model_config)
    seq = data.max_prompt_length + plan.response_length
    micro_tokens = _micro_tokens(actor, n, seq)
    compute = _compute_bytes(plan, "actor", device)
    rollout_dtype = arr.rollout.dtype
    rollout = compute if rollout_dtype is None else (2 if rollout_dtype in ("bfloat16", "float16") else 4)
    chunk = max(1, (1 << 24) // shape.vocab)
    chunking = actor.entropy_from_logits_with_chunking
    auto = device_defaults(device).chunk_logits and micro_tokens > chunk
    fused = arr.model.use_fused_kernels and arr.model.use_remove_padding
    unsharded = not plan.sharded(device, world)
    held = {r: unsharded and plan.holds_copies(r, device) for r in ROLES}
    own_pools = plan.uses_ray and not cfg.trainer.colocate  # each role's ranks its own GPUs
    return estimate(
        shape,
        world=world,
        lora_rank=arr.model.lora_rank,
        compute_bytes=compute,
        micro_tokens=micro_tokens,
        rollout_tokens=math.ceil(data.train_batch_size * n / world) * seq,
        rollout_bytes=rollout,
        checkpointing=arr.model.enable_gradient_checkpointing,
        chunked=fused or (auto if chunking is None else chunking),
        param_offload=actor.fsdp_config.param_offload,
        optimizer_offload=actor.fsdp_config.optimizer_offload,
        reference="ref" in plan.roles and not own_pools,
        teacher=None if teacher_config is None or own_pools else ModelShape.from_config(teacher_config),
        teacher_offload=arr.teacher.fsdp_config.param_offload,
        copy_bytes=2 if held["actor"] else 0,
        reference_bytes=2 if held["ref"] else 4,
        teacher_bytes=2 if held["teacher"] else 4,
        base_bytes=2 if unsharded and plan.holds_base_in_copies(device) else 4,
        critic=None
        if own_pools
        else _critic(cfg, plan, critic_config or model_config, device, seq, copies=held["critic"]),
        frees_gradients=device_defaults(device).free_gradients,
    )


def _micro_tokens(section: Any, n: int, seq: int) -> int:
    """Tokens of one micro-batch of a trained role's ``section`` (the actor's, or the critic's as
    :attr:`RunPlan.critic_section` resolves it): ``ppo_max_token_len_per_gpu`` under
    ``use_dynamic_bsz`` (one sequence of ``seq`` at least: a longer row is a micro-batch of its own),
    else ``ppo_micro_batch_size_per_gpu`` (or the mini-batch's ``n`` responses per prompt) sequences
    of ``seq`` tokens."""
    if section.use_dynamic_bsz:
        return max(section.ppo_max_token_len_per_gpu, seq)
    return (section.ppo_micro_batch_size_per_gpu or section.ppo_mini_batch_size * n) * seq


def _compute_bytes(plan: RunPlan, role: str, device: str) -> int:
    """Bytes of ``role``'s compute dtype: 2 on CUDA or where its ``param_dtype`` names a 16-bit type."""
    dtype = plan.param_dtype(role)
    return 2 if device == "cuda" or dtype in ("bfloat16", "bf16", "float16", "fp16") else 4


def _critic(
    cfg: Config, plan: RunPlan, config: Any, device: str, seq: int, *, copies: bool
) -> dict[str, int] | None:
    """The critic's parts of the actor rank's estimate (:func:`~tearless.models.memory.critic_part`)
    when the run trains one (on the actor's ranks: the caller leaves out Ray's pools of their own), else None:
    its micro-batches as :attr:`RunPlan.critic_section` resolves them, its dtype, ``copies``,
    checkpointing and offloads its own."""
    if "critic" not in plan.roles:
        return None
    fsdp = cfg.critic.model.fsdp_config
    return critic_part(
        ModelShape.from_config(config),
        world=world_size(cfg),
        compute_bytes=_compute_bytes(plan, "critic", device),
        micro_tokens=_micro_tokens(plan.critic_section, cfg.actor_rollout_ref.rollout.n, seq),
        checkpointing=cfg.critic.model.enable_gradient_checkpointing,
        param_offload=fsdp.param_offload,
        optimizer_offload=fsdp.optimizer_offload,
        copy_bytes=2 if copies else 0,
    )


def check_memory(est: MemoryEstimate, total_bytes: int, device: str) -> str | None:
    """Refuse, in one line naming the keys that shrink it, a run whose state alone (parameters,
    gradients, optimizer, reference: exact to the biases) exceeds the device's ``total_bytes``. When
    the state fits but the peak does not, the activations or the KV cache pushed it over: they are
    upper bounds (every sequence at its cap, :mod:`tearless.models.memory`), so the run may fit;
    return one warning line naming the keys that shrink the part(s) over the card. None when the
    peak fits."""
    g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    if est.state > total_bytes:
        ref = f", reference {g(est.reference)}" if est.reference else ""
        ref += f", teacher {g(est.teacher)}" if est.teacher else ""
        ref += f", critic {g(est.critic + est.critic_gradients)}" if est.critic else ""
        critic = " (critic.model.fsdp_config's too)" if est.critic else ""
        raise ConfigError(
            f"the actor's rank holds ~{g(est.state)} GiB of weights, gradients and optimizer state "
            f"(parameters {g(est.parameters)}, gradients {g(est.gradients)}, optimizer {g(est.optimizer)}"
            f"{ref}) but this {device} has {g(total_bytes)} GiB: set {ARR}.actor.fsdp_config."
            f"optimizer_offload=true / param_offload=true{critic} or {ARR}.model.lora_rank, or add GPUs "
            f"(trainer.n_gpus_per_node)"
        )
    if est.peak <= total_bytes:
        return None
    phases = est.phases
    over = []
    if phases["update"] > total_bytes:
        over.append(
            f"activations up to {g(est.activations)} GiB ({est.micro_tokens} tokens a micro-batch): lower "
            f"{ARR}.actor.ppo_max_token_len_per_gpu (use_dynamic_bsz) or ppo_micro_batch_size_per_gpu, "
            f"or set {ARR}.model.enable_gradient_checkpointing=true"
        )
    if phases["critic_update"] > total_bytes:
        over.append(
            f"the critic's activations up to {g(est.critic_activations)} GiB: lower "
            "critic.ppo_max_token_len_per_gpu (use_dynamic_bsz) or ppo_micro_batch_size_per_gpu, or set "
            "critic.model.enable_gradient_checkpointing=true"
        )
    if phases["rollout"] > total_bytes:
        over.append(
            f"KV cache up to {g(est.kv_cache)} GiB ({est.rollout_tokens} tokens): lower "
            f"data.train_batch_size or {ARR}.rollout.n"
        )
    return (
        f"warning: the actor's rank may need up to ~{g(est.peak)} GiB, over this {device}'s "
        f"{g(total_bytes)} GiB, every sequence counted at its cap; if it runs out of memory: "
        + "; ".join(over)
    )


def announce_memory(
    cfg: Config,
    model_path: str,
    device: str,
    log,
    teacher_path: str | None = None,
    *,
    plan: RunPlan | None = None,
) -> MemoryEstimate | None:
    """At start, before any weight loads: on CUDA log the estimate, refuse a run whose state cannot
    fit the GPU's memory and log the warning when only the activations' or KV cache's upper bound
    does not (:func:`check_memory`); on CPU log it for a pretrained model only (the embedded tiny
    models need a few MiB, and the default run's output stays as it was). A model whose config does
    not give a decoder's sizes (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``) has
    no estimate.

    ``device`` is the driver's: with ``trainer.device=auto`` it is what the process calling this
    sees (the trainer's), not what the Ray workers see. A driver without a GPU (a CPU head node whose
    workers have GPUs) checks nothing against their memory, and a driver with one checks its own
    card's, not theirs. ``plan`` as in :func:`run_estimate`."""
    plan = plan or build_plan(cfg)
    from transformers import AutoConfig  # heavy: imported by the trainer anyway, kept out of config's import

    def decoder(path: str) -> Any:
        config = AutoConfig.from_pretrained(path)
        text = getattr(config, "text_config", None) or config
        sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads")
        return config if all(hasattr(text, k) for k in sizes) else None

    model_config = decoder(model_path)
    if model_config is None:
        return None
    # A teacher of no known shape (not a decoder's config) is left out of the estimate.
    teacher = decoder(teacher_path) if teacher_path and "teacher" in plan.roles else None
    critic_path = plan.files.critic_path if plan.files else cfg.critic.model.path
    critic = decoder(critic_path) if critic_path and "critic" in plan.roles else None
    est = run_estimate(cfg, model_config, device, teacher, plan=plan, critic_config=critic)
    if device == "cuda":
        import torch  # heavy: only a GPU run asks for its memory

        log(est.line("the actor's rank"))
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        warning = check_memory(est, total, "GPU")
        if warning:
            log(warning)
    elif is_user_model(model_path):
        log(est.line("the actor's rank"))
    return est
