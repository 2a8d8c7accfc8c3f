"""Supervised fine-tuning data: chat conversations tokenised with the loss on assistant tokens only.

A row holds either

- ``messages`` (``data.messages_key``): a list of chat messages ``{"role", "content"}`` with at least
  one assistant message; or
- ``prompt`` (a string or a list of messages) and ``response`` (a string): the same as
  ``messages = prompt + [{"role": "assistant", "content": response}]``.

The conversation is rendered with the tokenizer's chat template. Assistant message ``i`` covers the
characters between ``template(messages[:i], add_generation_prompt=True)`` and
``template(messages[:i+1])``, end-of-turn marker included (the model must learn to stop); the
loss mask is 1 on exactly the tokens that start there. A template that does not render each turn as
a prefix of the next (one that rewrites earlier turns) is refused with the row named. A tokenizer
without a chat template renders the conversation as :func:`render_plain`
does and trains on its final assistant message followed by EOS.

Batches are padded (each row one sequence, right padding) or packed (several sequences per row,
positions restarting at 0 and a ``segment_ids`` tensor from which the trainer builds a
block-diagonal causal mask, so packed sequences never attend to each other).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from tearless.data.prompts import TRUNCATION_MODES, render_prompt, truncate
from tearless.data.rows import BuiltItems, DataError, chat_messages, located_rows


def read_records(path: str | os.PathLike) -> list[tuple[str, dict]]:
    """Every row of one ``.parquet``/``.jsonl``/``.json`` file as ``(where, row)``, unchecked.

    ``where`` names the row in error messages (``"f.jsonl: row 3 (line 5)"``). An empty file, a
    missing file and an unknown suffix raise :class:`DataError`.
    """
    out = []
    for where, row in located_rows(path):
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object with columns, got {type(row).__name__}")
        out.append((where, row))
    return out


def read_many(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[tuple[str, dict]]:
    """:func:`read_records` of one path or a list of paths, concatenated in order."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise DataError("no data files given; set data.train_files to a path or a list of paths")
    return [record for path in paths for record in read_records(path)]


def located(records: Sequence[tuple[str, dict]] | Sequence[dict], source: str) -> list[tuple[str, dict]]:
    """The dataset classes' ``records`` as ``(where, row)``: a pair from :func:`read_many` as it is, a
    plain row named ``"{source}: row {i}"`` in error messages. No records at all raise :class:`DataError`.
    """
    if not records:
        raise DataError(f"{source} has no rows")
    return [r if isinstance(r, tuple) else (f"{source}: row {i}", r) for i, r in enumerate(records)]


def as_messages(value: Any, *, where: str, column: str, role: str) -> list[dict]:
    """A string becomes one ``role`` message; a list must hold ``{"role", "content"}`` strings.

    Keys whose value is ``None`` are dropped (parquet structs fill absent keys with nulls).
    """
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    example = f'"..." or [{{"role": "{role}", "content": "..."}}]'
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: column {column!r} must be {example}, got {value!r:.80}")
    return chat_messages(value, where=where, column=column)


def require(row: dict, column: str, *, where: str, needs: str) -> Any:
    """``row[column]``, or a :class:`DataError` naming the row, the column and what rows need."""
    if row.get(column) is None:
        raise DataError(f"{where}: missing column {column!r}; the row has columns {sorted(row)}. {needs}")
    return row[column]


def row_messages(
    row: dict,
    *,
    where: str,
    messages_key: str = "messages",
    prompt_key: str = "prompt",
    response_key: str = "response",
) -> list[dict]:
    """The conversation of one SFT row (see the module docstring for the two layouts)."""
    needs = (
        f"An SFT row needs {messages_key!r} (chat messages) or {prompt_key!r} and {response_key!r} "
        "(data.messages_key / data.prompt_key / data.response_key)"
    )
    if row.get(messages_key) is not None:
        messages = as_messages(row[messages_key], where=where, column=messages_key, role="user")
    else:
        prompt = require(row, prompt_key, where=where, needs=needs)
        response = require(row, response_key, where=where, needs=needs)
        if not isinstance(response, str):
            raise DataError(f"{where}: column {response_key!r} must be a string, got {response!r:.80}")
        messages = as_messages(prompt, where=where, column=prompt_key, role="user")
        messages.append({"role": "assistant", "content": response})
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant message, so nothing to train on")
    return messages


def render_plain(tokenizer: Any, messages: Sequence[dict]) -> list[int]:
    """SFT's rendering of a conversation for a tokenizer without a chat template: one
    ``"role: content"`` line per message, then ``"assistant: "`` (``"user: 1+2=\\nassistant: "``).
    SFT writes this format into a base model, so its accuracy check prompts it the same way; the RL
    trainer does not invent it (it feeds plain-text prompts as they are)."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return list(tokenizer.encode(text))


def sft_prompt(tokenizer: Any, messages: Sequence[dict]) -> list[int]:
    """A prompt as SFT trained it: the chat template if the tokenizer has one, else :func:`render_plain`."""
    if getattr(tokenizer, "chat_template", None) is None:
        return render_plain(tokenizer, messages)
    return render_prompt(tokenizer, messages)


def tokenize_conversation(
    tokenizer: Any, messages: Sequence[dict], *, train_from: int = 0, where: str = "<row>"
) -> tuple[list[int], list[int]]:
    """Token ids of ``messages`` and a 0/1 loss mask over them.

    The mask is 1 on the tokens of assistant messages with index ``>= train_from`` (DPO passes the
    prompt's length, so assistant turns inside a multi-turn prompt are context). Example with the
    embedded char tokenizer, ``[user "1+2=", assistant "3"]`` → ``<|user|>1+2=<|end|><|assistant|>3<|end|>``
    with mask ``0 0 0 0 0 0 0 1 1``: the answer and the end-of-turn token.
    """
    messages = list(messages)
    if getattr(tokenizer, "chat_template", None) is None:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        if last < train_from:
            raise DataError(f"{where}: no assistant message after the prompt")
        prompt = render_plain(tokenizer, messages[:last])
        answer = list(tokenizer.encode(messages[last]["content"], add_special_tokens=False))
        answer.append(tokenizer.eos_token_id)
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)

    def render(msgs: list[dict], generation: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation)

    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < train_from:
            continue
        start, end = render(messages[:i], True) if i else "", render(messages[: i + 1], False)
        if not (end.startswith(start) and text.startswith(end)):
            raise DataError(
                f"{where}: the chat template does not render message {i} as a continuation of the "
                "earlier ones (it rewrites past turns), so assistant tokens cannot be located; use a "
                "template that renders each turn as a prefix of the next"
            )
        spans.append((len(start), len(end)))
    if not spans:
        raise DataError(f"{where}: no assistant message after the prompt")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def encode_example(
    tokenizer: Any,
    messages: Sequence[dict],
    *,
    max_length: int,
    truncation: str = "error",
    train_from: int = 0,
    where: str = "<row>",
) -> dict[str, list[int]]:
    """``{"input_ids", "loss_mask"}`` of one conversation, cut to ``max_length`` by ``truncation``.

    The first token never carries loss (nothing predicts it), so packing can restart sequences
    anywhere. A sequence that loses every trained token to truncation is an error.
    """
    if truncation not in TRUNCATION_MODES:
        raise DataError(f"data.truncation={truncation!r} is not one of {', '.join(TRUNCATION_MODES)}")
    ids, mask = tokenize_conversation(tokenizer, messages, train_from=train_from, where=where)
    if len(ids) > max_length:
        if truncation == "error":
            raise DataError(
                f"{where}: {len(ids)} tokens, longer than data.max_length={max_length}; raise "
                "data.max_length or set data.truncation=left|right|middle"
            )
        ids, mask = truncate(ids, max_length, truncation), truncate(mask, max_length, truncation)
    mask = [0, *mask[1:]]
    if not any(mask):
        raise DataError(
            f"{where}: no assistant token is left after data.truncation={truncation} to "
            f"data.max_length={max_length}"
        )
    return {"input_ids": ids, "loss_mask": mask}


class SFTDataset(BuiltItems):
    """SFT rows tokenised once; ``dataset[i]`` is ``{"input_ids", "loss_mask", "index"}``.

    Identical conversations are tokenised once (generated data repeats them a lot).

    Args:
        records: ``(where, row)`` pairs, e.g. from :func:`read_many`, or plain rows.
        tokenizer: a Hugging Face tokenizer; see :func:`tokenize_conversation`.
        max_length: the longest sequence in tokens (``data.max_length``).
        truncation: ``error`` (raise), ``left``, ``right`` or ``middle`` (``data.truncation``).
        messages_key, prompt_key, response_key: the columns read (see the module docstring).
    """

    def __init__(
        self,
        records: Sequence[tuple[str, dict]] | Sequence[dict],
        tokenizer: Any,
        *,
        max_length: int = 1024,
        truncation: str = "error",
        messages_key: str = "messages",
        prompt_key: str = "prompt",
        response_key: str = "response",
        source: str = "<rows>",
    ) -> None:
        cache: dict[str, dict[str, list[int]]] = {}
        self._items = []
        for index, (where, row) in enumerate(located(records, source)):
            messages = row_messages(
                row, where=where, messages_key=messages_key, prompt_key=prompt_key, response_key=response_key
            )
            key = json.dumps(messages, sort_keys=True)
            if key not in cache:
                cache[key] = encode_example(
                    tokenizer, messages, max_length=max_length, truncation=truncation, where=where
                )
            self._items.append({**cache[key], "index": index})


def pad_batch(items: Sequence[dict], *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask``, ``position_ids``, ``loss_mask``, each (B, L)."""
    width = max(len(it["input_ids"]) for it in items)
    ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(items), width), dtype=torch.long)
    loss = torch.zeros((len(items), width), dtype=torch.long)
    for i, it in enumerate(items):
        n = len(it["input_ids"])
        ids[i, :n] = torch.tensor(it["input_ids"])
        attention[i, :n] = 1
        loss[i, :n] = torch.tensor(it["loss_mask"])
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attention, "position_ids": positions, "loss_mask": loss}


def pack_batch(items: Sequence[dict], *, pad_token_id: int, max_length: int) -> dict[str, torch.Tensor]:
    """Pack sequences into rows of at most ``max_length`` tokens (first fit, longest first).

    Returns ``input_ids``, ``position_ids`` (restarting at 0 in each sequence), ``loss_mask`` and
    ``segment_ids`` (R, L): 1, 2, … per sequence in a row, 0 on padding. E.g. lengths 3, 2, 2 with
    ``max_length=4`` → rows ``[a a a -]`` and ``[b b c c]``, segment ids ``[1 1 1 0]`` and ``[1 1 2 2]``.
    """
    rows: list[list[dict]] = []
    used: list[int] = []
    for it in sorted(items, key=lambda it: -len(it["input_ids"])):
        n = len(it["input_ids"])
        slot = next((r for r, u in enumerate(used) if u + n <= max_length), None)
        if slot is None:
            rows.append([])
            used.append(0)
            slot = len(rows) - 1
        rows[slot].append(it)
        used[slot] += n
    width = max(used)
    out = {
        "input_ids": torch.full((len(rows), width), pad_token_id, dtype=torch.long),
        "position_ids": torch.zeros((len(rows), width), dtype=torch.long),
        "loss_mask": torch.zeros((len(rows), width), dtype=torch.long),
        "segment_ids": torch.zeros((len(rows), width), dtype=torch.long),
    }
    for r, row in enumerate(rows):
        start = 0
        for s, it in enumerate(row, start=1):
            n = len(it["input_ids"])
            out["input_ids"][r, start : start + n] = torch.tensor(it["input_ids"])
            out["position_ids"][r, start : start + n] = torch.arange(n)
            out["loss_mask"][r, start : start + n] = torch.tensor(it["loss_mask"])
            out["segment_ids"][r, start : start + n] = s
            start += n
    return out
