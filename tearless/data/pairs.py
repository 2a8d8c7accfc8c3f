r"""Preference data: pairs for DPO (a prompt, a chosen and a rejected response) and unpaired
examples for KTO (a prompt, a response and a desirable/undesirable label).

A row holds ``prompt`` (a string, or a list of chat messages) and ``chosen`` and ``rejected``, each a
string (one assistant message) or a list of messages that continue the conversation (TRL's
conversational format, e.g. ``[{"role": "assistant", "content": "..."}]``). The column names are
``data.prompt_key`` / ``data.chosen_key`` / ``data.rejected_key``; other columns (``data_source``,
``reward_model``, …) are kept. Each side is tokenised as prompt + side with the chat template, and
its mask covers the side's assistant tokens only (see :func:`~tearless.data.sft.tokenize_conversation`),
so a response's log-probability is :math:`\sum_t m_t \log\pi(x_t \mid x_{<t})` over exactly its tokens.

An unpaired row (TRL's unpaired preference format) holds ``prompt``, ``completion`` and ``label`` (true
= desirable); a paired row given to :class:`UnpairedDataset` becomes two examples, its chosen side
desirable and its rejected side undesirable (TRL's ``unpair_preference_dataset``).
"""

from __future__ import annotations

import random
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


def collate_pairs(
    items: Sequence[dict], *, pad_token_id: int, sides: Sequence[str] = ("chosen", "rejected")
) -> dict[str, torch.Tensor]:
    """One right-padded batch of ``len(sides)`` × P sequences, side by side: with the default sides,
    rows 0 … P−1 the chosen sides and P … 2P−1 the rejected ones, in the same pair order (see
    :func:`~tearless.data.sft.pad_batch` for the keys)."""
    rows = [{"input_ids": it[f"{s}_ids"], "loss_mask": it[f"{s}_mask"]} for s in sides for it in items]
    return pad_batch(rows, pad_token_id=pad_token_id)


def side_lengths(items: Sequence[dict], side: str) -> torch.Tensor:
    """(P,) trained-token count of one side of each item (the tokens its log-probability sums)."""
    return torch.tensor([sum(it[f"{side}_mask"]) for it in items], dtype=torch.long)


def _label(value: Any, *, where: str, column: str) -> bool:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise DataError(
        f"{where}: column {column!r} is {value!r}; a KTO label is true (desirable) or false (undesirable)"
    )


class UnpairedDataset:
    """Unpaired examples tokenised once, each with a mismatched partner for KTO's KL estimate.

    ``dataset[i]`` has ``completion_ids``/``completion_mask`` (prompt + its response), ``kl_ids``/
    ``kl_mask`` (the same prompt followed by another example's response), ``label`` (True =
    desirable) and ``index``. The partners follow one seeded cycle through all examples (example
    ``order[j]`` borrows the response of ``order[j+1]``), fixed for the run, so the reference's
    log-probabilities of the KL sequences can be computed once, like those of the responses.

    Args:
        records: ``(where, row)`` pairs or plain rows, unpaired (``completion_key``, ``label_key``) or
            paired (``chosen_key``, ``rejected_key``: two examples each).
        kl_seed: seed of the partner cycle.
        Other arguments as :class:`PairDataset`.
    """

    def __init__(
        self,
        records: Sequence[tuple[str, dict]] | Sequence[dict],
        tokenizer: Any,
        *,
        max_length: int = 1024,
        truncation: str = "error",
        prompt_key: str = "prompt",
        completion_key: str = "completion",
        label_key: str = "label",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        kl_seed: int = 0,
        source: str = "<rows>",
    ) -> None:
        if not records:
            raise DataError(f"{source} has no rows")
        examples: list[tuple[str, list[dict], list[dict], bool]] = []
        for index, record in enumerate(records):
            where, row = record if isinstance(record, tuple) else (f"{source}: row {index}", record)
            if completion_key in row or label_key in row:
                needs = (
                    f"An unpaired row needs {prompt_key!r}, {completion_key!r} and {label_key!r} "
                    "(data.prompt_key / data.completion_key / data.label_key)"
                )
                prompt = as_messages(
                    require(row, prompt_key, where=where, needs=needs),
                    where=where,
                    column=prompt_key,
                    role="user",
                )
                completion = as_messages(
                    require(row, completion_key, where=where, needs=needs),
                    where=where,
                    column=completion_key,
                    role="assistant",
                )
                label = _label(
                    require(row, label_key, where=where, needs=needs), where=where, column=label_key
                )
                examples.append((where, prompt, completion, label))
            else:
                prompt, chosen, rejected = pair_messages(
                    row, where=where, prompt_key=prompt_key, chosen_key=chosen_key, rejected_key=rejected_key
                )
                examples += [
                    (f"{where} (chosen)", prompt, chosen, True),
                    (f"{where} (rejected)", prompt, rejected, False),
                ]
        if len(examples) < 2:
            raise DataError(
                f"{source}: KTO needs at least 2 examples (its KL term pairs prompts with other responses)"
            )
        order = list(range(len(examples)))
        random.Random(kl_seed).shuffle(order)
        partner = {order[j]: order[(j + 1) % len(order)] for j in range(len(order))}

        def encode(prompt: list[dict], response: list[dict], where: str) -> dict[str, list[int]]:
            return encode_example(
                tokenizer,
                prompt + response,
                max_length=max_length,
                truncation=truncation,
                train_from=len(prompt),
                where=where,
            )

        self._items = []
        for i, (where, prompt, completion, label) in enumerate(examples):
            enc = encode(prompt, completion, where)
            other = examples[partner[i]]
            kl = encode(prompt, other[2], f"{where} (KL pair with {other[0]})")
            self._items.append(
                {
                    "index": i,
                    "label": label,
                    "completion_ids": enc["input_ids"],
                    "completion_mask": enc["loss_mask"],
                    "kl_ids": kl["input_ids"],
                    "kl_mask": kl["loss_mask"],
                }
            )

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict:
        return self._items[i]
