r"""Preference pairs for DPO: a prompt, a chosen (preferred) and a rejected response.

A row holds ``prompt`` (a string, or a list of chat messages) and ``chosen`` and ``rejected``, each a
string (one assistant message) or a list of messages that continue the conversation (TRL's
conversational format, e.g. ``[{"role": "assistant", "content": "..."}]``). The column names are
``data.prompt_key`` / ``data.chosen_key`` / ``data.rejected_key``; other columns (``data_source``,
``reward_model``, …) are kept. Each side is tokenised as prompt + side with the chat template, and
its mask covers the side's assistant tokens only (see :func:`~tearless.data.sft.tokenize_conversation`),
so a response's log-probability is :math:`\sum_t m_t \log\pi(x_t \mid x_{<t})` over exactly its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tearless.data.rows import DataError
from tearless.data.sft import as_messages, encode_example, pad_batch, require


def pair_messages(
    row: dict,
    *,
    where: str,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
) -> tuple[list[dict], list[dict], list[dict]]:
    """``(prompt, chosen, rejected)`` messages of one row, with errors naming the row and column."""
    needs = (
        f"A preference row needs {prompt_key!r}, {chosen_key!r} and {rejected_key!r}, each a string or a "
        "list of chat messages (data.prompt_key / data.chosen_key / data.rejected_key)"
    )
    prompt = as_messages(
        require(row, prompt_key, where=where, needs=needs), where=where, column=prompt_key, role="user"
    )
    sides = []
    for key in (chosen_key, rejected_key):
        side = as_messages(
            require(row, key, where=where, needs=needs), where=where, column=key, role="assistant"
        )
        if not any(m["role"] == "assistant" for m in side):
            raise DataError(f"{where}: column {key!r} has no assistant message, so no response to score")
        sides.append(side)
    return prompt, sides[0], sides[1]


class PairDataset:
    """Preference rows tokenised once; ``dataset[i]`` has ``chosen_ids``, ``chosen_mask``,
    ``rejected_ids``, ``rejected_mask`` (lists of ints) and ``index`` (the row's number).

    Args:
        records: ``(where, row)`` pairs (from :func:`~tearless.data.sft.read_many`) or plain rows.
        tokenizer: a Hugging Face tokenizer with a chat template (or a base tokenizer: plain text).
        max_length: the longest prompt + response in tokens (``data.max_length``); longer sides are
            handled by ``truncation`` (``error`` | ``left`` | ``right`` | ``middle``).
    """

    def __init__(
        self,
        records: Sequence[tuple[str, dict]] | Sequence[dict],
        tokenizer: Any,
        *,
        max_length: int = 1024,
        truncation: str = "error",
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        source: str = "<rows>",
    ) -> None:
        if not records:
            raise DataError(f"{source} has no rows")
        self._items = []
        for index, record in enumerate(records):
            where, row = record if isinstance(record, tuple) else (f"{source}: row {index}", record)
            prompt, chosen, rejected = pair_messages(
                row, where=where, prompt_key=prompt_key, chosen_key=chosen_key, rejected_key=rejected_key
            )
            item: dict[str, Any] = {"index": index}
            for name, side in (("chosen", chosen), ("rejected", rejected)):
                enc = encode_example(
                    tokenizer,
                    prompt + side,
                    max_length=max_length,
                    truncation=truncation,
                    train_from=len(prompt),
                    where=f"{where} ({name})",
                )
                item[f"{name}_ids"], item[f"{name}_mask"] = enc["input_ids"], enc["loss_mask"]
            self._items.append(item)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict:
        return self._items[i]


def collate_pairs(items: Sequence[dict], *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """One right-padded batch of 2P sequences: rows 0 … P−1 the chosen sides, P … 2P−1 the rejected
    ones, in the same pair order (see :func:`~tearless.data.sft.pad_batch` for the keys)."""
    sides = [
        {"input_ids": it[f"{s}_ids"], "loss_mask": it[f"{s}_mask"]}
        for s in ("chosen", "rejected")
        for it in items
    ]
    return pad_batch(sides, pad_token_id=pad_token_id)
