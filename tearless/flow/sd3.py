"""Flow-GRPO on a diffusers Stable Diffusion 3 pipeline: the velocity adapter, the schedule, a prompt task.

- :class:`SD3Velocity` wraps the pipeline's ``SD3Transformer2DModel`` as ``velocity(x_t, t, cond)``.
- :func:`scheduler_sigmas` reads the schedule (shift included) from its ``FlowMatchEulerDiscreteScheduler``.
- :class:`SD3PromptTask` encodes a list of prompts once with the pipeline's text encoders, decodes
  latents with its VAE and scores the images with your reward ``fn(images, prompts) -> (B,)``
  (images (B, 3, H, W) in [0, 1], prompts a list of strings).

diffusers is imported only here, and only when used.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

ImageRewardFn = Callable[[Tensor, list[str]], Tensor]


class SD3Velocity(nn.Module):
    """Adapter of a diffusers ``SD3Transformer2DModel`` to ``velocity(x_t, t, cond)``.

    ``cond`` is a dict with ``prompt_embeds`` (B, L, D) and ``pooled_prompt_embeds`` (B, P), what
    ``StableDiffusion3Pipeline.encode_prompt`` returns; x_t are latents (B, C, H, W); t ∈ [0, 1] is
    the scheduler's sigma, passed to the transformer as timestep = t · num_train_timesteps exactly as
    the SD3 pipeline does. The transformer predicts v = ε − x_0, this package's convention.
    """

    def __init__(self, transformer: nn.Module, num_train_timesteps: int = 1000):
        super().__init__()
        self.transformer = transformer
        self.num_train_timesteps = num_train_timesteps

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        return self.transformer(
            hidden_states=x,
            timestep=t * self.num_train_timesteps,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_prompt_embeds"],
            return_dict=False,
        )[0]

    def lora_targets(self) -> list[str]:
        """Flow-GRPO's LoRA targets on the SD3 attention projections."""
        return ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Save the transformer as a diffusers directory (what checkpoints hold, LoRA merged)."""
        self.transformer.save_pretrained(path)


def scheduler_sigmas(scheduler: Any, num_steps: int) -> Tensor:
    """The T + 1 sigmas (shift included, ending at 0) of a ``FlowMatchEulerDiscreteScheduler``."""
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.detach().float().cpu()


def _diffusers() -> Any:
    try:
        import diffusers
    except ImportError as e:
        raise ImportError("the SD3 adapter needs diffusers: pip install 'tearless[diffusers]'") from e
    return diffusers


def load_sd3(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> tuple[SD3Velocity, Any]:
    """The transformer and scheduler of a local SD3-style pipeline directory, as (velocity model, scheduler).

    Reads ``<path>/transformer`` and ``<path>/scheduler`` (the layout ``save_pretrained`` of a
    ``StableDiffusion3Pipeline`` writes).
    """
    diffusers = _diffusers()
    root = Path(path)
    for sub in ("transformer", "scheduler"):
        if not (root / sub).is_dir():
            raise FileNotFoundError(
                f"{root} has no {sub}/ folder; point at a diffusers SD3 pipeline directory"
            )
    transformer = diffusers.SD3Transformer2DModel.from_pretrained(root, subfolder="transformer", dtype=dtype)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(root, subfolder="scheduler")
    return SD3Velocity(transformer, scheduler.config.num_train_timesteps), scheduler


def load_sd3_pipeline(
    path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, **components: Any
) -> Any:
    """A local ``StableDiffusion3Pipeline`` directory, offline; ``components`` override parts of it
    (e.g. ``text_encoder_3=None, tokenizer_3=None`` for a pipeline saved without T5)."""
    diffusers = _diffusers()
    defaults = {"feature_extractor": None, "image_encoder": None}
    return diffusers.StableDiffusion3Pipeline.from_pretrained(
        path, dtype=dtype, local_files_only=True, **{**defaults, **components}
    )


class SD3PromptTask:
    """A Flow-GRPO task over an SD3 pipeline: prompt i is ``prompts[i]``; samples are latents.

    The prompts (and the negative prompt, the null condition of CFG) are encoded once. ``reward``
    decodes the latents with the VAE (``latents / scaling_factor + shift_factor``, as the pipeline
    does) and calls ``reward_fn(images, prompts)``.
    """

    name = "sd3"

    def __init__(
        self,
        pipeline: Any,
        prompts: list[str],
        reward_fn: ImageRewardFn,
        *,
        height: int | None = None,
        width: int | None = None,
        negative_prompt: str = "",
        max_sequence_length: int = 256,
    ):
        if not prompts:
            raise ValueError("SD3PromptTask needs at least one prompt")
        self.pipeline, self.prompts, self.reward_fn = pipeline, list(prompts), reward_fn
        self.num_prompts = len(self.prompts)
        with torch.no_grad():
            embeds, null, pooled, null_pooled = pipeline.encode_prompt(
                self.prompts,
                None,
                None,
                do_classifier_free_guidance=True,
                negative_prompt=[negative_prompt] * self.num_prompts,
                max_sequence_length=max_sequence_length,
            )
        self.table = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        self.null = {"prompt_embeds": null, "pooled_prompt_embeds": null_pooled}
        scale = pipeline.vae_scale_factor
        size = pipeline.default_sample_size * scale
        channels = pipeline.transformer.config.in_channels
        self.sample_shape = (channels, (height or size) // scale, (width or size) // scale)

    def prompt_names(self) -> list[str]:
        return list(self.prompts)

    def _rows(self, table: dict[str, Tensor], ids: Tensor) -> dict[str, Tensor]:
        return {k: v[ids.to(v.device)].to(ids.device) for k, v in table.items()}

    def cond(self, prompt_ids: Tensor) -> dict[str, Tensor]:
        return self._rows(self.table, prompt_ids)

    def uncond(self, prompt_ids: Tensor) -> dict[str, Tensor]:
        return self._rows(self.null, prompt_ids)

    @torch.no_grad()
    def to_images(self, latents: Tensor) -> Tensor:
        """VAE-decoded images (B, 3, H, W) in [0, 1]."""
        vae = self.pipeline.vae
        z = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        return (vae.decode(z, return_dict=False)[0] / 2 + 0.5).clamp(0, 1).float()

    def reward(self, latents: Tensor, prompt_ids: Tensor) -> Tensor:
        images = self.to_images(latents)
        return self.reward_fn(images, [self.prompts[int(i)] for i in prompt_ids]).float()

    def metrics(self, latents: Tensor, prompt_ids: Tensor) -> dict[str, float]:
        return {"reward": float(self.reward(latents, prompt_ids).mean())}
