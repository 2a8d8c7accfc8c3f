"""The images of multimodal rows, in veRL's format, and the prompts that read them.

A multimodal row has an ``images`` column (``data.image_key``): a list with one entry per image, each
``{"bytes": <encoded image>}`` (what ``datasets`` writes into parquet), ``{"path": <file>}`` or a path
string; its prompt messages hold one ``<image>`` placeholder per image, in order (veRL's convention).
Every image is decoded when the dataset is built, so a bad one stops the run before training with one
line naming the file, the row and the image: undecodable bytes, a missing file, an image larger than
:data:`MAX_IMAGE_PIXELS`, or a count of images that differs from the count of placeholders.

The prompt is rendered by the processor's chat template (each message's content cut at its
placeholders into veRL's ``[{"type": "image"}, {"type": "text", "text": …}]`` parts) or, when the
processor has none, by the tokenizer's over the text with its ``<image>`` placeholders; the processor
then expands each placeholder into the image's tokens (:func:`tearless.models.vision.prompt_inputs`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

from tearless.data.rows import DataError

IMAGE_PLACEHOLDER = "<image>"
# Larger images are refused rather than decoded: 4096 × 4096, four times a 2048² chart; a processor
# shrinks any image to its own maximum size anyway.
MAX_IMAGE_PIXELS = 4096 * 4096


def row_images(row: dict, where: str, image_key: str = "images") -> list[Any] | None:
    """The decoded RGB images of ``row`` (PIL), or None for a text-only row (no ``image_key`` column
    or an empty list); :class:`DataError` naming ``where`` and the image for a bad one, or when the
    prompt's ``<image>`` placeholders do not match the images one for one."""
    entries = row.get(image_key)
    if entries is None:
        return None
    if isinstance(entries, (str, bytes, dict)) or not isinstance(entries, Sequence):
        entries = [entries]
    if len(entries) == 0:
        return None
    images = [decode_image(entry, f"{where}: {image_key}[{k}]") for k, entry in enumerate(entries)]
    placeholders = sum(
        m["content"].count(IMAGE_PLACEHOLDER) for m in row["prompt"] if isinstance(m.get("content"), str)
    )
    if placeholders != len(images):
        raise DataError(
            f"{where}: the prompt holds {placeholders} {IMAGE_PLACEHOLDER} placeholders for {len(images)} "
            f"images; put one {IMAGE_PLACEHOLDER} in the messages where each image goes, in order "
            "(veRL's format)"
        )
    return images


def decode_image(entry: Any, where: str) -> Any:
    """One image entry (``{"bytes": …}``, ``{"path": …}``, a path string or a PIL image) decoded to an
    RGB PIL image; :class:`DataError` naming ``where`` (and the file) when it cannot be."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(entry, Image.Image):
        return _checked(entry, where).convert("RGB")
    name, source = _source(entry, where)
    try:
        with Image.open(source) as image:
            _checked(image, f"{where} ({name})")
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        why = (
            "no image format recognised"
            if isinstance(e, UnidentifiedImageError)
            else f"{type(e).__name__}: {e}"
        )
        raise DataError(
            f"{where} ({name}) is not a decodable image ({why[:120]}); fix or drop the row"
        ) from None


def _source(entry: Any, where: str) -> tuple[str, Any]:
    """(how the image is named in messages, what ``Image.open`` reads) of one entry."""
    if isinstance(entry, dict):
        if entry.get("bytes") is not None:
            return "its bytes", io.BytesIO(entry["bytes"])
        entry = entry.get("path")
    if isinstance(entry, bytes):
        return "its bytes", io.BytesIO(entry)
    if not isinstance(entry, str) or not entry:
        raise DataError(
            f"{where}: an image entry must be {{'bytes': ...}}, {{'path': ...}} or a path string, got "
            f"{type(entry).__name__}"
        )
    path = entry[len("file://") :] if entry.startswith("file://") else entry
    if not os.path.isfile(path):
        raise DataError(
            f"{where}: image file {path!r} does not exist (paths are read from the working directory)"
        )
    return path, path


def _checked(image: Any, where: str) -> Any:
    """``image`` unless it has more than :data:`MAX_IMAGE_PIXELS` pixels (read from its header)."""
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise DataError(
            f"{where} is {width}x{height} pixels, more than the {MAX_IMAGE_PIXELS:,} tearless decodes; "
            "downscale it (the processor shrinks it to its own size anyway)"
        )
    return image


def image_messages(messages: Sequence[dict]) -> list[dict]:
    """veRL's structured messages: each string content cut at its ``<image>`` placeholders into
    ``{"type": "image"}`` and ``{"type": "text", "text": …}`` parts (empty text parts left out)."""
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str):
            out.append(dict(message))
            continue
        parts: list[dict] = []
        for k, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if k:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        out.append({**message, "content": parts})
    return out


def render_image_prompt(
    processor: Any,
    tokenizer: Any,
    messages: Sequence[dict],
    *,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> str:
    """The prompt's text with one ``<image>``-style placeholder per image, before the processor expands
    them: the processor's chat template over :func:`image_messages`, else (no processor template, or
    ``chat_template`` given) the tokenizer's over the messages as they are."""
    kwargs = dict(add_generation_prompt=True, tokenize=False, **(template_kwargs or {}))
    if chat_template is None and getattr(processor, "chat_template", None):
        return processor.apply_chat_template(image_messages(messages), **kwargs)
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            "the prompts are chat messages with images but neither the processor nor the tokenizer has a "
            "chat template; give one with data.chat_template"
        )
    return tokenizer.apply_chat_template(list(messages), chat_template=chat_template, **kwargs)
