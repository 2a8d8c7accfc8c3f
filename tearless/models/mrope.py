"""Three-dimensional rotary positions (M-RoPE) of a Qwen2-VL or Qwen2.5-VL policy's sequences.

Such a model rotates each attention head's dimensions in three sections (temporal, height, width),
each by its own position. Row b's prompt positions are the model's own (``get_rope_index``, over the
row's attended tokens only, so left padding changes nothing): a text token has one position s in all
three sections, s running on from the segment before it; an image of a (t, h, w) grid of merged
patches that starts at s puts its token at grid coordinates (i, j, k) at (s + i, s + j, s + k), and
the text after it starts at s + max(h, w). The prompt's n_b tokens thus span positions up to some
m_b − 1 ≠ n_b − 1, and its rope delta is

    δ_b = m_b − n_b.

Every token after the prompt, whose one-dimensional (text) position is p = n_b + k for the k-th
response token, is at p + δ_b in all three sections: what the model's own forward over the whole
sequence computes (its image tokens are the prompt's only), and what its ``generate`` uses for the
decode steps. A model without ``get_rope_index`` (Idefics3, text models) reads the text positions.
"""

from __future__ import annotations

import inspect

import torch

from tearless.models.compat import base_model
from tearless.models.vision import forward_pixels


def prompt_rope(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    pixels: dict[str, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(positions (3, B, P), delta (B, 1))`` of left-padded prompts ``prompt_ids`` (B, P) whose images
    are the stacked ``pixels`` (one row per row), from the model's ``get_rope_index`` (padding at 0);
    None when the model reads one-dimensional positions or the rows have no pixels."""
    inner = getattr(base_model(model), "model", None)
    if pixels is None or not hasattr(inner, "get_rope_index"):
        return None
    kwargs = {"image_grid_thw": forward_pixels(pixels)["image_grid_thw"], "attention_mask": prompt_mask}
    if "mm_token_type_ids" in inspect.signature(inner.get_rope_index).parameters:  # transformers 5
        kwargs["mm_token_type_ids"] = (prompt_ids == base_model(model).config.image_token_id).int()
    return inner.get_rope_index(prompt_ids, **kwargs)


def sequence_positions(
    text: torch.Tensor, prompt_width: int, rope: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    """The positions a forward takes for sequences whose first ``prompt_width`` columns are the prompts
    of :func:`prompt_rope`'s ``rope``: ``text`` (B, L), the one-dimensional positions, when ``rope`` is
    None; else (3, B, L), the prompt columns the model's and every later column p + δ_b."""
    if rope is None:
        return text
    positions, delta = rope
    out = (text + delta).expand(3, *text.shape).clone()
    out[:, :, :prompt_width] = positions
    return out
