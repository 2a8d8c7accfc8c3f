"""What a rank builds: its models (plain, or sharded from rank 0's copy) and its rollout side.

:class:`ModelBuilder` loads a role's model without a device mesh as transformers does, and with one
reads the weights on rank 0 only and broadcasts them into every rank's FSDP2 shards
(:func:`tearless.distributed.fsdp.shard_from_rank0`), the other ranks building the architecture on
the meta device. Sharded trained weights are float32 masters; on GPU forward and backward run in
``fsdp_config.param_dtype`` (FSDP2 mixed precision), on CPU under autocast when it is bfloat16
(:mod:`tearless.models.precision`). :func:`build_rollout` makes a generating rank's engine, reward
manager and agent loop.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tearless.config.plan import role_key
from tearless.distributed.fsdp import decoder_layers, shard_from_rank0
from tearless.envs import EnvLoop, ProgramLoop, env_factory, load_agent
from tearless.models.compiled import compile_layers
from tearless.models.copies import attach, hold_in
from tearless.models.loading import load_causal_lm, resolve_dtype
from tearless.models.lora import add_lora, is_lora, load_lora
from tearless.models.precision import compute_dtype, set_compute_dtype
from tearless.models.value import load_value_model
from tearless.models.vision import freeze_vision_tower, language_model, vision_model_type, vision_tower
from tearless.models.weights import hf_weights
from tearless.rewards import load_reward_function, make_reward_manager
from tearless.rollout.agent import AgentLoop, AgentSettings
from tearless.rollout.hf import HFRollout
from tearless.tools import load_tools
from tearless.workers.spec import RankSpec


class ModelBuilder:
    """Builds the models of rank ``rank`` of ``world`` (``mesh`` the ranks' device mesh, or None)."""

    def __init__(self, spec: RankSpec, rank: int, world: int, mesh: Any, device: torch.device) -> None:
        self.spec, self.rank, self.world, self.mesh, self.device = spec, rank, world, mesh, device

    def fsdp(self, role: str):
        """The FSDP settings of ``role``'s model as the user gave them (its dtype is the plan's:
        ``param_dtype`` here may still read ``auto``)."""
        return self.spec.sections.fsdp(role)

    def shard(self, build: Callable[[bool], torch.nn.Module], role: str) -> torch.nn.Module:
        """``build(real)`` as this rank's model: loaded as is without a mesh, else sharded from rank 0;
        set to compute in ``role``'s ``param_dtype`` (:meth:`reduce`), and its layers compiled where
        ``use_torch_compile`` says. A model the spec holds for ``role`` (:attr:`RankSpec.models`)
        replaces ``build``'s."""
        given = self.spec.models.get(role)
        model = self._shard(build if given is None else (lambda real: given), role)
        if self.device.type == "cpu" or self.mesh is None:
            self.reduce(model, role)
        if self.spec.sections.compiles(role):
            vision = getattr(model.config, "vision_config", None) is not None
            compile_layers(model, language_model(model) if vision else None)
        return model

    def reduce(self, model: torch.nn.Module, role: str) -> None:
        """A model on CPU or on one GPU computing in a reduced ``param_dtype``: from compute copies
        (``fsdp_config.compute_copies``, unsharded only: bf16 copies of a trained model's float32
        masters, or a frozen model's parameters held in bf16; :mod:`tearless.models.copies`), else
        marked for autocast (float16 always). Sharded GPU models compute in it through FSDP2's mixed
        precision. A frozen actor (``tearless eval``'s, which only the built-in engine forwards) is held
        in bf16 only when that engine samples in bf16; otherwise it stays float32, as a trained actor's
        engine then samples from its float32 masters."""
        dtype = compute_dtype(self.spec.plan.param_dtype(role), self.device, role_key(role))
        if dtype == torch.float32:
            return
        if self.mesh is not None or not self.spec.plan.holds_copies(role, self.device.type):
            set_compute_dtype(model, dtype)
        elif any(p.requires_grad for p in model.parameters()):
            held = role == "actor" and self.spec.plan.holds_base_in_copies(self.device.type)
            attach(model, dtype, hold_frozen=held)
        elif role != "actor" or self.spec.plan.hybrid_rollout_dtype(self.device.type, warn=False) == dtype:
            hold_in(model, dtype)

    def _shard(self, build: Callable[[bool], torch.nn.Module], role: str) -> torch.nn.Module:
        if self.mesh is None:
            return build(True).to(self.device)

        fsdp, cuda = self.fsdp(role), self.device.type == "cuda"
        dtype = compute_dtype(self.spec.plan.param_dtype(role), self.device, role_key(role), warn=False)
        model = shard_from_rank0(
            build,
            self.mesh,
            blocks=fsdp_blocks,
            rank=self.rank,
            device="cpu" if fsdp.param_offload and cuda else self.device,
            param_offload=fsdp.param_offload and cuda,
            param_dtype=dtype if cuda else None,
            reshard_after_forward=fsdp.reshard_after_forward,
        )
        if cuda:
            model.tearless_compute_device = self.device
        return model

    def master_dtype(self, trained: bool) -> str:
        """Sharded trained weights stay float32 (FSDP's mixed precision computes in param_dtype);
        an unsharded model keeps ``model.dtype``."""
        return "float32" if trained and self.mesh is not None else self.spec.sections.model.dtype

    def causal_lm(self, role: str, *, trained: bool) -> torch.nn.Module:
        """``role``'s causal LM: the checkpoint's (resume) or the base weights (the teacher's own for
        ``teacher``), with LoRA adapters for a LoRA actor (new, or the checkpoint's), frozen unless
        ``trained``."""
        m, spec = self.spec.sections.model, self.spec
        dtype = self.master_dtype(trained)
        checkpointing = m.enable_gradient_checkpointing and trained
        resume = Path(spec.resume_dir) / "actor" if spec.resume_dir and role == "actor" else None
        lora = m.lora_rank > 0 and role == "actor"

        def build(real: bool) -> torch.nn.Module:
            path = resume if resume is not None and not lora else spec.model_path
            if role == "teacher":  # forward-only like the reference, from its own weights
                path = spec.plan.files.teacher_path
            model = load_causal_lm(path, dtype=dtype, gradient_checkpointing=checkpointing, meta=not real)
            vision = vision_model_type(path) is not None
            if not trained:
                model.requires_grad_(False)
            elif spec.sections.actor.freeze_vision_tower and vision:
                freeze_vision_tower(model)
            if not lora:
                return model

            adapter = resume or (spec.plan.files.lora_adapter_path if spec.plan.files else None)
            if adapter is not None and real:
                return load_lora(model, adapter, gradient_checkpointing=checkpointing)
            if not real:
                torch.manual_seed(0)  # the skeleton's init is discarded; keep it cheap and fixed
            # A vision-language policy's adapters go on its language model only.
            kw = dict(rank=m.lora_rank, alpha=m.lora_alpha, target_modules=m.target_modules)
            kw["language_only"] = vision
            if adapter is not None:  # the skeleton of a saved adapter has that adapter's shape
                saved = json.loads((Path(adapter) / "adapter_config.json").read_text())
                kw.update(alpha=saved["lora_alpha"], target_modules=saved["target_modules"])
            return add_lora(model, gradient_checkpointing=checkpointing, **kw)

        return self.shard(build, role)

    def value_model(self) -> torch.nn.Module:
        """The critic's value model: the checkpoint's, ``critic.model.path``'s (the plan's
        ``files.critic_path``) or the actor's weights."""
        spec = self.spec
        critic = spec.sections.critic.model
        files = spec.plan.files
        start = (files.critic_path if files else None) or spec.model_path
        path = Path(spec.resume_dir) / "critic" if spec.resume_dir else start

        def build(real: bool) -> torch.nn.Module:
            return load_value_model(
                path,
                dtype=self.master_dtype(True),
                gradient_checkpointing=critic.enable_gradient_checkpointing,
                meta=not real,
            )

        return self.shard(build, "critic")


def fsdp_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 shards as units of ``model`` (before its root): the transformer blocks
    (:func:`~tearless.distributed.fsdp.decoder_layers`); for a vision-language model, its language
    model's blocks and its vision tower's. A frozen tower's units are gathered for its forward and
    freed after it, and take no part in the backward."""
    if getattr(model.config, "vision_config", None) is None:
        return decoder_layers(model)
    return decoder_layers(language_model(model)) + decoder_layers(vision_tower(model))


def build_rollout(spec: RankSpec, tokenizer: Any, device: torch.device, trained: torch.nn.Module | None):
    """A generating rank's engine, reward manager and agent loop (multi-turn, else None).

    The built-in engine samples from ``trained`` (the rank's own actor, hybrid placement) or, on a
    separate rollout rank, from a plain copy in ``rollout.dtype`` that the first weight broadcast
    fills; a vLLM engine always holds its own copy.
    """
    eos = eos_token_ids(spec.model_path, tokenizer)
    if spec.sections.rollout.name == "vllm":
        engine = _vllm_engine(spec, tokenizer, eos, device, trained)
    else:
        engine = _builtin_engine(spec, tokenizer, eos, device, trained)
    return engine, _reward_manager(spec, device), _agent_loop(spec, engine, tokenizer)


def eos_token_ids(model_path: str, tokenizer: Any) -> list[int]:
    """The tokens that end a response, sorted: the tokenizer's EOS and those of the model's
    ``generation_config.json`` (one ID or a list; none when the model has no such file)."""
    from transformers import GenerationConfig

    eos = {tokenizer.eos_token_id}
    try:
        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        gen_eos = None
    eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    return sorted(eos)


def _vllm_engine(
    spec: RankSpec, tokenizer: Any, eos: list[int], device: torch.device, trained: torch.nn.Module | None
):
    """A vLLM engine over its own copy of the policy in the rollout dtype. In the hybrid placement
    (``trained`` given) it sleeps during the update and reloads from ``trained``; its KV cache holds
    a whole batch of ``train_batch_size × n`` sequences of ``max_prompt_length + response_length``."""
    # vLLM is an optional dependency, imported only when the run asks for it.
    from tearless.rollout.vllm import VLLMRollout

    sections = spec.sections
    dtype = spec.plan.rollout_dtype(spec.device)
    context = sections.data.max_prompt_length + spec.plan.response_length
    reload = None
    # Adapter-only sync: the engine keeps the frozen base, so what it reloads after a sleep is the
    # base alone (the adapter comes back from its directory).
    adapters = (
        trained is not None and serves_adapter(trained) and spec.plan.lora_sync(device.type) == "adapter"
    )
    if trained is not None:  # hybrid: the engine sleeps, and its weights come from `trained`

        def reload():
            return hf_weights(trained, resolve_dtype(dtype), merged=not adapters)

    return VLLMRollout(
        spec.model_path,
        sections.rollout,
        dtype=dtype,
        eos_token_ids=eos,
        pad_token_id=tokenizer.pad_token_id,
        seed=sections.trainer.seed,
        device=spec.device,
        reload=reload,
        kv_tokens=sections.data.train_batch_size * sections.rollout.n * context,
        # Multi-turn prompts carry earlier turns and a chat template: room beyond `context`.
        max_model_len=max(context, 4096),
        distributed=torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1,
        # enforce_eager=false leaves vLLM its default: CUDA graphs on GPU, eager on CPU.
        enforce_eager=True if sections.rollout.enforce_eager else None,
        lora_rank=sections.model.lora_rank if adapters else 0,
    )


def _builtin_engine(
    spec: RankSpec, tokenizer: Any, eos: list[int], device: torch.device, trained: torch.nn.Module | None
) -> HFRollout:
    """The built-in engine: over ``trained`` (hybrid: under autocast in the rollout's precision on
    CPU), else over a frozen copy of the base weights in the rollout dtype."""
    model = trained
    if model is None:
        model = load_causal_lm(spec.model_path, dtype=spec.plan.rollout_dtype(spec.device)).to(device)
        model.requires_grad_(False)
    precision = spec.plan.hybrid_rollout_dtype(spec.device) if trained is not None else None
    return HFRollout(
        model,
        eos_token_ids=eos,
        pad_token_id=tokenizer.pad_token_id,
        compute_dtype=precision,
        cuda_graphs=not spec.sections.rollout.enforce_eager,
    )


def _reward_manager(spec: RankSpec, device: torch.device, reward_model: Any = None):
    """The reward manager of the ``reward_model`` section (None: the spec's): the spec's reward function
    (a Python caller's), else ``custom_reward_function``'s, else the data source's default scorer."""
    crf = spec.sections.custom_reward_function
    reward_fn = spec.reward_fn
    if reward_fn is None and crf.path:
        reward_fn = load_reward_function(crf.path, crf.name)
    return make_reward_manager(
        reward_model or spec.sections.reward_model,
        reward_fn,
        dict(crf.reward_kwargs),
        max_response_length=spec.plan.response_length,
        device=str(device),
    )


def rule_reward_manager(spec: RankSpec, device: torch.device):
    """The rule scorers of :func:`_reward_manager` without the reward model or the judge: what validation
    scores with when they are the training reward (``reward_model.rule_weight=0``), so that held-out
    accuracy is the task's scorer's (as veRL validates: with rule-based rewards only)."""
    rm = spec.sections.reward_model
    judge = dataclasses.replace(rm.judge, enable=False)
    rules = dataclasses.replace(rm, enable=False, judge=judge, rule_weight=0.0)
    return _reward_manager(spec, device, rules)


def _agent_loop(spec: RankSpec, engine: Any, tokenizer: Any):
    """The multi-turn loop over ``engine``, None for a single-turn run: an environment's
    (``multi_turn.env``), an agent program's (``multi_turn.agent``), else the tool loop over
    ``multi_turn.tool_config_path`` (or the embedded task's tools, a file of the plan's)."""
    mt = spec.sections.rollout.multi_turn
    if not mt.enable:
        return None
    settings = AgentSettings.from_config(mt)
    if mt.env is not None:
        factory = env_factory(mt.env, dict(mt.env_kwargs))
        timeout, family = mt.env_timeout_s, mt.tool_family
        return EnvLoop(engine, tokenizer, factory, settings, env_timeout_s=timeout, tool_family=family)
    if mt.agent is not None:
        return ProgramLoop(
            engine,
            tokenizer,
            load_agent(mt.agent),
            settings,
            timeout_s=mt.env_timeout_s,
            tool_family=mt.tool_family,
        )
    return AgentLoop(engine, tokenizer, load_tools(mt.tool_config_path or spec.plan.files.tools), settings)


def serves_adapter(model: torch.nn.Module) -> bool:
    """A LoRA model whose only trained weights are its adapters (no module trained whole), which an
    engine can serve as base + adapter instead of merged weights."""
    if not is_lora(model):
        return False
    return not getattr(model.peft_config[model.active_adapter], "modules_to_save", None)
