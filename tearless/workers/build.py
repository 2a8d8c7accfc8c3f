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

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tearless.config import Config
from tearless.distributed.fsdp import shard_from_rank0
from tearless.envs import EnvLoop, ProgramLoop, env_factory, load_agent
from tearless.models.hub import local_model_path
from tearless.models.loading import load_causal_lm, resolve_dtype
from tearless.models.lora import add_lora, load_lora
from tearless.models.precision import compute_dtype, set_compute_dtype
from tearless.models.value import load_value_model
from tearless.models.weights import hf_weights
from tearless.rewards import load_reward_function, make_reward_manager
from tearless.rollout.agent import AgentLoop, AgentSettings
from tearless.rollout.engine import engine_capabilities
from tearless.rollout.hf import HFRollout
from tearless.tools import load_tools
from tearless.workers.spec import RankSpec


def rollout_dtype(cfg: Config, device: str) -> str:
    """The dtype a separate rollout engine holds the policy in: ``rollout.dtype``, or bfloat16 on GPU
    and float32 on CPU."""
    name = cfg.actor_rollout_ref.rollout.dtype
    return name if name else ("bfloat16" if device == "cuda" else "float32")


def role_key(role: str) -> str:
    """The ``param_dtype`` config key of ``role`` (for messages)."""
    prefix = "critic.model" if role == "critic" else f"actor_rollout_ref.{role}"
    return f"{prefix}.fsdp_config.param_dtype"


def hybrid_rollout_dtype(cfg: Config, device: str, *, warn: bool = True) -> torch.dtype:
    """The compute dtype of the built-in engine sampling from the trained weights (hybrid placement):
    ``rollout.dtype``, or the actor's ``param_dtype`` when it is null."""
    name = cfg.actor_rollout_ref.rollout.dtype
    if name is not None:
        return compute_dtype(name, device, "actor_rollout_ref.rollout.dtype", warn=warn)
    return compute_dtype(
        cfg.actor_rollout_ref.actor.fsdp_config.param_dtype, device, role_key("actor"), warn=warn
    )


def precision_mismatch(cfg: Config, device: str) -> bool:
    """Whether the hybrid built-in engine computes in another dtype than the actor's log-prob forward."""
    rollout = cfg.actor_rollout_ref.rollout
    if engine_capabilities(rollout.name).holds_own_weights or rollout.nnodes > 0:
        return False
    actor = compute_dtype(
        cfg.actor_rollout_ref.actor.fsdp_config.param_dtype, device, role_key("actor"), warn=False
    )
    return hybrid_rollout_dtype(cfg, device, warn=False) != actor


class ModelBuilder:
    """Builds the models of rank ``rank`` of ``world`` (``mesh`` the ranks' device mesh, or None)."""

    def __init__(self, spec: RankSpec, rank: int, world: int, mesh: Any, device: torch.device) -> None:
        self.spec, self.rank, self.world, self.mesh, self.device = spec, rank, world, mesh, device

    def fsdp(self, role: str):
        """The FSDP settings of ``role``'s model."""
        cfg = self.spec.cfg
        if role == "critic":
            return cfg.critic.model.fsdp_config
        return getattr(cfg.actor_rollout_ref, role).fsdp_config

    def shard(self, build: Callable[[bool], torch.nn.Module], role: str) -> torch.nn.Module:
        """``build(real)`` as this rank's model: loaded as is without a mesh, else sharded from rank 0;
        marked to compute in ``role``'s ``param_dtype`` under autocast when that is a reduced dtype, on
        CPU and on one GPU (sharded GPU models compute in it through FSDP2's mixed precision). A
        model the spec holds for ``role`` (:attr:`RankSpec.models`) replaces ``build``'s."""
        given = self.spec.models.get(role)
        model = self._shard(build if given is None else (lambda real: given), role)
        if self.device.type == "cpu" or self.mesh is None:
            dtype = compute_dtype(self.fsdp(role).param_dtype, self.device, role_key(role))
            if dtype != torch.float32:
                set_compute_dtype(model, dtype)
        return model

    def _shard(self, build: Callable[[bool], torch.nn.Module], role: str) -> torch.nn.Module:
        if self.mesh is None:
            return build(True).to(self.device)

        fsdp, cuda = self.fsdp(role), self.device.type == "cuda"
        dtype = compute_dtype(fsdp.param_dtype, self.device, role_key(role), warn=False)
        model = shard_from_rank0(
            build,
            self.mesh,
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
        return "float32" if trained and self.mesh is not None else self.spec.cfg.actor_rollout_ref.model.dtype

    def causal_lm(self, role: str, *, trained: bool) -> torch.nn.Module:
        """``role``'s causal LM: the checkpoint's (resume) or the base weights, with LoRA adapters for
        a LoRA actor (new, or the checkpoint's), frozen unless ``trained``."""
        m, spec = self.spec.cfg.actor_rollout_ref.model, self.spec
        dtype = self.master_dtype(trained)
        checkpointing = m.enable_gradient_checkpointing and trained
        resume = Path(spec.resume_dir) / "actor" if spec.resume_dir and role == "actor" else None
        lora = m.lora_rank > 0 and role == "actor"

        def build(real: bool) -> torch.nn.Module:
            path = resume if resume is not None and not lora else spec.model_path
            model = load_causal_lm(path, dtype=dtype, gradient_checkpointing=checkpointing, meta=not real)
            if not trained:
                model.requires_grad_(False)
            if not lora:
                return model

            adapter = resume or (
                local_model_path(m.lora_adapter_path, "actor_rollout_ref.model.lora_adapter_path")
                if m.lora_adapter_path
                else None
            )
            if adapter is not None and real:
                return load_lora(model, adapter, gradient_checkpointing=checkpointing)
            if not real:
                torch.manual_seed(0)  # the skeleton's init is discarded; keep it cheap and fixed
            kw = dict(rank=m.lora_rank, alpha=m.lora_alpha, target_modules=m.target_modules)
            if adapter is not None:  # the skeleton of a saved adapter has that adapter's shape
                saved = json.loads((Path(adapter) / "adapter_config.json").read_text())
                kw.update(alpha=saved["lora_alpha"], target_modules=saved["target_modules"])
            return add_lora(model, gradient_checkpointing=checkpointing, **kw)

        return self.shard(build, role)

    def value_model(self) -> torch.nn.Module:
        """The critic's value model: the checkpoint's, ``critic.model.path``'s or the actor's weights."""
        cfg, spec = self.spec.cfg, self.spec
        path = (
            Path(spec.resume_dir) / "critic"
            if spec.resume_dir
            else (cfg.critic.model.path or spec.model_path)
        )

        def build(real: bool) -> torch.nn.Module:
            return load_value_model(
                path,
                dtype=self.master_dtype(True),
                gradient_checkpointing=cfg.critic.model.enable_gradient_checkpointing,
                meta=not real,
            )

        return self.shard(build, "critic")


def build_rollout(spec: RankSpec, tokenizer: Any, device: torch.device, trained: torch.nn.Module | None):
    """A generating rank's engine, reward manager and agent loop (multi-turn, else None).

    The built-in engine samples from ``trained`` (the rank's own actor, hybrid placement) or, on a
    separate rollout rank, from a plain copy in ``rollout.dtype`` that the first weight broadcast
    fills; a vLLM engine always holds its own copy.
    """
    cfg = spec.cfg
    arr = cfg.actor_rollout_ref
    eos = {tokenizer.eos_token_id}
    from transformers import GenerationConfig

    try:
        gen_eos = GenerationConfig.from_pretrained(spec.model_path).eos_token_id
    except OSError:
        gen_eos = None
    eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if arr.rollout.name == "vllm":
        # vLLM is an optional dependency, imported only when the run asks for it.
        from tearless.rollout.vllm import VLLMRollout

        dtype = rollout_dtype(cfg, spec.device)
        response = arr.rollout.response_length or cfg.data.max_response_length
        context = cfg.data.max_prompt_length + response
        reload = None
        if trained is not None:  # hybrid: the engine sleeps, and its weights come from `trained`

            def reload():
                return hf_weights(trained, resolve_dtype(dtype))

        engine = VLLMRollout(
            spec.model_path,
            arr.rollout,
            dtype=dtype,
            eos_token_ids=sorted(eos),
            pad_token_id=tokenizer.pad_token_id,
            seed=cfg.trainer.seed,
            device=spec.device,
            reload=reload,
            kv_tokens=cfg.data.train_batch_size * arr.rollout.n * context,
            # Multi-turn prompts carry earlier turns and a chat template: room beyond `context`.
            max_model_len=max(context, 4096),
            distributed=torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1,
            # enforce_eager=false leaves vLLM its default: CUDA graphs on GPU, eager on CPU.
            enforce_eager=True if arr.rollout.enforce_eager else None,
        )
    else:
        model = trained
        if model is None:
            model = load_causal_lm(spec.model_path, dtype=rollout_dtype(cfg, spec.device)).to(device)
            model.requires_grad_(False)
        # Sampling from the trained weights (hybrid): autocast in the rollout's precision on CPU.
        precision = hybrid_rollout_dtype(cfg, spec.device) if trained is not None else None
        engine = HFRollout(
            model,
            eos_token_ids=sorted(eos),
            pad_token_id=tokenizer.pad_token_id,
            compute_dtype=precision,
            cuda_graphs=not arr.rollout.enforce_eager,
        )

    crf = cfg.custom_reward_function
    reward_fn = spec.reward_fn
    if reward_fn is None and crf.path:
        reward_fn = load_reward_function(crf.path, crf.name)
    reward = make_reward_manager(
        cfg.reward_model,
        reward_fn,
        dict(crf.reward_kwargs),
        max_response_length=arr.rollout.response_length or cfg.data.max_response_length,
        device=str(device),
    )
    agent = None
    mt = arr.rollout.multi_turn
    if mt.enable and (mt.env is not None or mt.agent is not None):
        settings = AgentSettings.from_config(mt)
        if mt.env is not None:
            factory = env_factory(mt.env, dict(mt.env_kwargs))
            timeout, family = mt.env_timeout_s, mt.tool_family
            agent = EnvLoop(engine, tokenizer, factory, settings, env_timeout_s=timeout, tool_family=family)
        else:
            agent = ProgramLoop(
                engine,
                tokenizer,
                load_agent(mt.agent),
                settings,
                timeout_s=mt.env_timeout_s,
                tool_family=mt.tool_family,
            )
    elif mt.enable:
        agent = AgentLoop(
            engine,
            tokenizer,
            load_tools(mt.tool_config_path or spec.tool_config),
            AgentSettings.from_config(mt),
        )
    return engine, reward, agent
