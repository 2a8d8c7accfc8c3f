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

:class:`RewardPairDataset` reads the same pair rows for a reward model (``tearless rm``), each side
rendered as the ``reward_model`` role renders what it scores, with TRL's optional ``margin`` column.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import torch

from tearless.data.rows import BuiltItems, DataError
from tearless.data.sft import as_messages, encode_example, located, pad_batch, require
from tearless.rewards.model import conversation_ids


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


class PairDataset(BuiltItems):
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
        self._items = []
        for index, (where, row) in enumerate(located(records, source)):
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


class UnpairedDataset(BuiltItems):
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
        examples: list[tuple[str, list[dict], list[dict], bool]] = []
        for where, row in located(records, source):
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


def _margin(row: dict, *, where: str, column: str) -> float:
    value = row.get(column)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(
            f"{where}: column {column!r} is {value!r}; when a file has a margin column every row needs a "
            "finite number there (data.margin_key)"
        )
    return float(value)


class RewardPairDataset(BuiltItems):
    """Preference rows tokenised as a reward model scores them, for ``tearless rm``.

    Each side is prompt + side rendered by :func:`~tearless.rewards.model.conversation_ids`, the
    rendering of the ``reward_model`` role, so the trained model is scored at use on the token ids it
    was trained on. ``dataset[i]`` has ``chosen_ids``/``rejected_ids``, ``chosen_mask``/
    ``rejected_mask`` (1 on the last token only: the reward is the head's output there), ``margin``
    (TRL's optional ``margin`` column, ``data.margin_key``; 0.0 when the file has none) and ``index``.

    A side longer than ``max_length`` tokens is an error with ``truncation="error"``; with ``"left"``
    it keeps its last ``max_length`` tokens, as the ``reward_model`` role does at use
    (``reward_model.max_length``). Other arguments as :class:`PairDataset`.
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
        margin_key: str = "margin",
        source: str = "<rows>",
    ) -> None:
        rows = located(records, source)
        if truncation not in ("error", "left"):
            raise DataError(f"data.truncation={truncation!r}: a reward model's pairs take error or left")
        with_margin = any(row.get(margin_key) is not None for _, row in rows)
        self._items = []
        for index, (where, row) in enumerate(rows):
            prompt, chosen, rejected = pair_messages(
                row, where=where, prompt_key=prompt_key, chosen_key=chosen_key, rejected_key=rejected_key
            )
            margin = _margin(row, where=where, column=margin_key) if with_margin else 0.0
            item: dict[str, Any] = {"index": index, "margin": margin}
            for name, side in (("chosen", chosen), ("rejected", rejected)):
                ids = conversation_ids(tokenizer, prompt + side)
                if len(ids) > max_length:
                    if truncation == "error":
                        raise DataError(
                            f"{where} ({name}): {len(ids)} tokens, longer than data.max_length={max_length}; "
                            "raise data.max_length or set data.truncation=left (keep the end, as the "
                            "reward_model role does)"
                        )
                    ids = ids[len(ids) - max_length :]
                item[f"{name}_ids"], item[f"{name}_mask"] = ids, [0] * (len(ids) - 1) + [1]
            self._items.append(item)
