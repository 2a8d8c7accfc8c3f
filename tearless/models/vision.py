"""Vision-language policies: image-text-to-text models loaded with their processor, the vision tower
frozen, and the pixel inputs of a batch.

A model directory is a vision-language model when its ``config.json`` has a ``vision_config``. The
architectures taken (:data:`SUPPORTED_TYPES`) are Idefics3 and SmolVLM, whose language model reads
ordinary one-dimensional positions, and Qwen2-VL and Qwen2.5-VL, which place their tokens with
three-dimensional rotary positions (M-RoPE) that :mod:`tearless.models.mrope` computes. In both the
image's features replace its image tokens in the prompt's embeddings and everything after them is a
causal LM, so the log-prob pass's explicit positions (M-RoPE's: the prompt's the model's own, every
later token its text position plus the prompt's rope delta), its prompt forwarded once into a KV cache
for a group's responses, and the rollout engine's prefill-then-decode loop all hold; only the forwards
that read the prompt take the pixels. Others are refused (:func:`check_supported`).

The pixel inputs of one prompt (:func:`prompt_pixels`) are the image processor's tensors with the
batch dimension taken off: Idefics3's ``pixel_values`` (images, channels, height, width) and
``pixel_attention_mask`` (images, height, width); Qwen2-VL's flat ``pixel_values`` (patches,
C·T·P·P), every image's patches one after the other, and ``image_grid_thw`` (images, 3), each image's
grid of patches. :func:`stack_pixels` pads a batch of them to one shape with zeros, as the processor
pads a batch; Idefics3 drops the all-zero padding images, and :func:`forward_pixels` unstacks
Qwen2-VL's exactly (a padding grid is all zeros, a row's patches are as many as its grids hold).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tearless.models.compat import base_model

VISION_KEYS = ("pixel_values", "pixel_attention_mask", "image_grid_thw")
# The linear layers of the language model (Llama- and Qwen2-style) that "all-linear" means.
LANGUAGE_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The language model's module under the model (Idefics3/SmolVLM: text_model; Qwen2-VL: language_model).
LANGUAGE_MODULES = ("text_model", "language_model")
SUPPORTED_TYPES = ("idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl")
KEY = "actor_rollout_ref.model.path"


def vision_model_type(path: str | os.PathLike | None) -> str | None:
    """The ``model_type`` of the vision-language model in directory ``path``, or None when it is a
    text-only model (no ``vision_config`` in its ``config.json``) or not a local directory."""
    if path is None:
        return None
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "vision_config" not in config:
        return None
    return str(config.get("model_type"))


def text_head_dim(path: str | os.PathLike) -> int | None:
    """The attention head width of the language model of the vision-language model in ``path``
    (``text_config.head_dim``, else ``hidden_size / num_attention_heads``), or None when unreadable."""
    try:
        text = json.loads((Path(path) / "config.json").read_text())["text_config"]
        return int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def check_supported(model_type: str, key: str = KEY) -> None:
    """Raise ``ValueError`` (one line naming ``key``) unless ``model_type`` is one whose passes tearless
    computes (:data:`SUPPORTED_TYPES`)."""
    if model_type in SUPPORTED_TYPES:
        return
    raise ValueError(
        f"{key}: the vision-language model type {model_type!r} is not supported: tearless has not checked "
        "its image-token layout and positions against its log-prob pass and rollout engine. Supported: "
        f"{', '.join(SUPPORTED_TYPES)} (e.g. HuggingFaceTB/SmolVLM-256M-Instruct, Qwen/Qwen2-VL-2B-Instruct)"
    )


def load_vision_lm(path: str | os.PathLike, *, dtype: torch.dtype, meta: bool = False) -> torch.nn.Module:
    """``AutoModelForImageTextToText`` from directory ``path`` in ``dtype`` (on the meta device, no
    weights read, with ``meta``); the caller has checked the type with :func:`check_supported`."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    if meta:
        with torch.device("meta"):
            return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(str(path)), dtype=dtype)
    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype)


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The image encoder of a vision-language model (Idefics3/SmolVLM's ``model.vision_model``, the
    connector that projects its features into the language model not part of it; Qwen2-VL's
    ``model.visual``, its patch merger included, as veRL freezes it)."""
    inner = base_model(model).model
    return inner.visual if hasattr(inner, "visual") else inner.vision_model


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The language model of a vision-language model (the :data:`LANGUAGE_MODULES` one under it:
    Idefics3/SmolVLM's ``model.text_model``, Qwen2-VL's ``model.language_model``)."""
    inner = base_model(model).model
    return next(getattr(inner, name) for name in LANGUAGE_MODULES if hasattr(inner, name))


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop gradients into the vision tower (veRL's ``freeze_vision_tower``): its parameters'
    ``requires_grad`` off, so the optimizer never holds them. Returns how many parameters were frozen."""
    tower = vision_tower(model)
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def load_processor(path: str | os.PathLike, key: str = KEY) -> Any:
    """The model's processor (``AutoProcessor``: its tokenizer and image processor). A Qwen2-VL or
    Qwen2.5-VL processor is loaded without its video processor (:func:`image_only_processor`):
    tearless reads no video, and that one needs torchvision."""
    from transformers import AutoProcessor

    kind = vision_model_type(path)
    try:
        if kind in QWEN_PROCESSORS:
            return image_only_processor(kind).from_pretrained(str(path))
        return AutoProcessor.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        first = next(iter(str(e).strip().splitlines()), "")
        raise ValueError(
            f"{key}={path!s}: cannot load the vision-language model's processor ({first[:200]}); save it "
            "beside the weights with processor.save_pretrained"
        ) from None


# The processor class of each model type whose processor also holds a video processor.
QWEN_PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}


@functools.cache
def image_only_processor(model_type: str) -> type:
    """The processor class of ``model_type`` (:data:`QWEN_PROCESSORS`) without its video processor: its
    ``__init__`` takes the image processor and the tokenizer only, so ``from_pretrained`` loads no
    video processor (which needs torchvision). It bears its parent's name, so the processor it saves
    names the parent's class in its ``processor_config.json``."""
    import transformers

    parent = getattr(transformers, QWEN_PROCESSORS[model_type])

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # The parent passes (image, tokenizer, None) on; ProcessorMixin pairs them with the two
        # attributes this signature names, so the None is dropped.
        parent.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def __reduce__(self):
        # pickle rebuilds it through a module function: the class is made here, not importable by its name
        return _make_image_only, (model_type, self.image_processor, self.tokenizer, self.chat_template)

    return type(
        parent.__name__,
        (parent,),
        {"__init__": __init__, "__reduce__": __reduce__, "__module__": parent.__module__},
    )


def _make_image_only(model_type: str, image_processor: Any, tokenizer: Any, chat_template: Any) -> Any:
    return image_only_processor(model_type)(image_processor, tokenizer, chat_template=chat_template)


def prompt_inputs(
    processor: Any, text: str, images: Sequence[Any]
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The token ids of one rendered prompt ``text`` (each ``<image>`` expanded into the image's tokens)
    and its pixel inputs (:func:`prompt_pixels`), from the processor."""
    enc = processor(text=[text], images=[list(images)], return_tensors="pt")
    return enc["input_ids"][0].tolist(), _one_prompt(enc)


def prompt_pixels(processor: Any, images: Sequence[Any]) -> dict[str, torch.Tensor]:
    """One prompt's pixel inputs from its images (the image processor's, batch dimension taken off)."""
    return _one_prompt(processor.image_processor(images=[list(images)], return_tensors="pt"))


def _one_prompt(enc: Any) -> dict[str, torch.Tensor]:
    """The :data:`VISION_KEYS` of an encoding of one prompt: Idefics3's with the batch dimension taken
    off; Qwen2-VL's flat patches (patches, C·T·P·P) and grids (images, 3) as they are (they have none)."""
    flat = "image_grid_thw" in enc
    return {k: enc[k] if flat else enc[k][0] for k in VISION_KEYS if k in enc}


def stack_pixels(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The pixel inputs of ``rows`` (one dict per prompt or response) as one batch: each tensor padded
    with zeros to the largest number of images and the largest height and width, then stacked."""
    out = {}
    for key in rows[0]:
        tensors = [row[key] for row in rows]
        shape = [max(t.shape[d] for t in tensors) for d in range(tensors[0].dim())]
        batch = tensors[0].new_zeros((len(tensors), *shape))
        for i, t in enumerate(tensors):
            batch[(i, *(slice(0, n) for n in t.shape))] = t
        out[key] = batch
    return out


def pixel_kwargs(source: Any) -> dict[str, torch.Tensor]:
    """The pixel inputs a forward takes from ``source`` (a batch's TensorDict or a dict): the
    :data:`VISION_KEYS` it holds, nothing for a text-only batch."""
    return {k: source[k] for k in VISION_KEYS if k in source.keys()}


def forward_pixels(pixels: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the model's forward takes for the stacked pixel inputs ``pixels`` (:func:`stack_pixels`, one
    row per prompt or response). Idefics3's as they are (it drops the all-zero padding images). Qwen2-VL's
    unstacked exactly: each row's grids but the all-zero padding ones (a real grid is at least 1 × 1 × 1)
    and its first t·h·w patches per grid (the rest is padding), concatenated over the rows in order."""
    if "image_grid_thw" not in pixels:
        return pixels
    grids, patches = [], []
    for grid, values in zip(pixels["image_grid_thw"], pixels["pixel_values"], strict=True):
        grid = grid[grid.prod(-1) > 0]
        grids.append(grid)
        patches.append(values[: int(grid.prod(-1).sum())])
    return {"pixel_values": torch.cat(patches), "image_grid_thw": torch.cat(grids)}


def image_features(model: torch.nn.Module, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
    """(image tokens, hidden) the features of the stacked ``pixels``' images, in the order of their
    image tokens (row by row), as the model's own forward computes them."""
    features = base_model(model).model.get_image_features(**forward_pixels(pixels)).pooler_output
    return torch.cat(list(features)) if isinstance(features, (list, tuple)) else features


def image_embeddings(
    model: torch.nn.Module, ids: torch.Tensor, pixels: dict[str, torch.Tensor], prompt_width: int
) -> torch.Tensor:
    """The language model's input embeddings of ``ids`` (B, L), each row's image features in place of
    the image tokens among its first ``prompt_width`` columns (its prompt). What the model's own
    merge does, except that an image token the policy sampled in a response stays a token, as it is
    in the engine's decode steps (the model's merge would count it as one more image position)."""
    embeds = base_model(model).model.get_input_embeddings()(ids)
    features = image_features(model, pixels)
    columns = torch.arange(ids.shape[1], device=ids.device)
    where = (ids == base_model(model).config.image_token_id) & (columns < prompt_width)
    if int(where.sum()) != features.shape[0]:
        raise ValueError(
            f"the prompts hold {int(where.sum())} image tokens but their images give {features.shape[0]} "
            "features: the prompt ids were not made by this model's processor"
        )
    return embeds.masked_scatter(where[..., None], features.to(embeds.dtype))


def language_lora_targets(names: Sequence[str] | str) -> str:
    """peft's ``target_modules`` for LoRA on the language model only: a regular expression (peft matches
    a string whole against each module's name) over the modules named ``names`` under the language
    model (:data:`LANGUAGE_MODULES`), ``all-linear`` meaning :data:`LANGUAGE_LINEAR`. The vision tower
    and the connector get no adapter."""
    chosen = LANGUAGE_LINEAR if names == "all-linear" else names
    return rf".*\.({'|'.join(LANGUAGE_MODULES)})\..*\.({'|'.join(map(re.escape, chosen))})"


@contextlib.contextmanager
def images_placed(
    model: torch.nn.Module, pixels: dict[str, torch.Tensor], prompt_width: int
) -> Iterator[None]:
    """Within it, a forward of ``model`` given ``input_ids`` reads them as :func:`image_embeddings` of
    ``pixels`` and ``prompt_width``: a pre-hook on the inner model (under the causal-LM head) turns its
    ``input_ids`` into those ``inputs_embeds``. The same numbers as passing the embeddings, made inside
    the model's own forward, where an FSDP2-sharded model has gathered its root's parameters (the
    embeddings, the connector) and reduces their gradients after the backward went through them. Made
    outside, they read sharded weights (an error); made after gathering the root by hand, FSDP2
    reduced the root's gradients as soon as the backward reached ``inputs_embeds`` (an input of the
    forward), before the embedding's and the connector's were added, which were lost (measured on 2
    gloo ranks: 19 of the 21 trained tensors had gradients)."""

    def place(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs["inputs_embeds"] = image_embeddings(model, kwargs.pop("input_ids"), pixels, prompt_width)
        return args, kwargs

    handle = base_model(model).model.register_forward_pre_hook(place, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
