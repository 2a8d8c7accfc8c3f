"""Prompt datasets: rows rendered with the tokenizer's chat template, with a length policy.

The policy mirrors veRL's ``data.max_prompt_length``, ``data.truncation`` and
``data.filter_overlong_prompts``: an overlong prompt is an error by default, because silently cutting
a question usually cuts the part the reward depends on.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from tearless.data.rows import DataError, normalize_row

TRUNCATION_MODES = ("error", "left", "right", "middle")


def render_prompt(
    tokenizer: Any,
    messages: str | Sequence[dict],
    *,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of a prompt, as TRL and veRL feed it to the model.

    A plain-text prompt (a string) is encoded as it is, with the tokenizer's usual special tokens (a
    BOS token, for tokenizers that add one): no template is invented around it. Chat messages go
    through ``apply_chat_template(messages, add_generation_prompt=True)`` with ``chat_template`` (the
    user's ``data.chat_template``) or else the tokenizer's own, and ``template_kwargs``
    (``data.apply_chat_template_kwargs``). Messages for a tokenizer without a chat template raise
    :class:`DataError`: a base model has no conversation format to guess.
    """
    if isinstance(messages, str):
        return list(tokenizer.encode(messages))
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            "the prompts are chat messages but the tokenizer has no chat template. Give one with "
            "data.chat_template='<jinja template>' (veRL: actor_rollout_ref.model.custom_chat_template), "
            "use a chat model, or write the prompt column as plain text (a string per row), which is fed "
            "to the model as it is"
        )
    # transformers 5 returns a BatchEncoding unless return_dict=False; 4.x returns the list already.
    ids = tokenizer.apply_chat_template(
        list(messages),
        chat_template=chat_template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **(template_kwargs or {}),
    )
    return list(ids)


def truncate(ids: list[int], max_length: int, mode: str) -> list[int]:
    """Cut ``ids`` to ``max_length``: ``left`` keeps the tail, ``right`` the head, ``middle`` both ends.

    ``middle`` keeps the first ``max_length // 2`` tokens and the last ``max_length - max_length // 2``,
    so the instruction at the start and the question at the end both survive.
    """
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[len(ids) - max_length :]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head) :]
    raise DataError(f"data.truncation={mode!r} cannot cut a prompt; use one of left, right, middle")


class PromptDataset:
    """Rows tokenised once at construction; ``dataset[i]`` is a fresh dict for prompt ``i``.

    Each item has ``input_ids`` (list[int], no padding), ``raw_prompt`` (the chat messages),
    ``data_source``, ``ground_truth`` (``reward_model.ground_truth``), ``extra_info`` (dict, ``{}``
    when the row has none), ``ability`` (``None`` when absent) and ``index``: the row's number in
    ``rows``, which stays the same when overlong rows are filtered out.

    Args:
        rows: rows in veRL's schema (see :mod:`tearless.data.rows`); checked again here, so rows built
            in memory get the same errors as rows read from a file.
        tokenizer: a Hugging Face tokenizer; see :func:`render_prompt`, which also takes
            ``chat_template`` and ``template_kwargs``. ``num_unknown`` counts the prompts whose ids hold
            the tokenizer's unknown token.
        max_prompt_length: the longest prompt in tokens (``data.max_prompt_length``).
        truncation: what to do with a longer prompt (``data.truncation``): ``error`` (raise),
            ``left``, ``right`` or ``middle`` (see :func:`truncate`).
        filter_overlong_prompts: drop overlong rows instead (``data.filter_overlong_prompts``); how
            many were dropped is in ``num_filtered``.
        source: names the rows in error messages, e.g. the file they came from.
    """

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer: Any,
        *,
        max_prompt_length: int = 512,
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        source: str = "<rows>",
        chat_template: str | None = None,
        template_kwargs: dict | None = None,
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise DataError(f"data.truncation={truncation!r} is not one of {', '.join(TRUNCATION_MODES)}")
        if (
            isinstance(max_prompt_length, bool)
            or not isinstance(max_prompt_length, int)
            or max_prompt_length < 1
        ):
            raise DataError(f"data.max_prompt_length must be a positive integer, got {max_prompt_length!r}")
        if not rows:
            raise DataError(f"{source} has no rows")
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.num_filtered = 0
        # Prompts holding the tokenizer's unknown token (the text has characters its vocabulary lacks).
        self.num_unknown = 0
        unk = getattr(tokenizer, "unk_token_id", None)
        self._items: list[dict] = []
        for index, row in enumerate(rows):
            # A string prompt is plain text, fed as is; normalize_row makes it a user message for the
            # rest of the pipeline (rewards, records) and keeps the text in prompt_text.
            row = normalize_row(row, where=f"{source}: row {index}")
            ids = render_prompt(
                tokenizer,
                row.get("prompt_text") or row["prompt"],
                chat_template=chat_template,
                template_kwargs=template_kwargs,
            )
            self.num_unknown += unk is not None and unk in ids
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if truncation == "error":
                    raise DataError(
                        f"{source}: row {index} has a prompt of {len(ids)} tokens, longer than "
                        f"data.max_prompt_length={max_prompt_length}. Raise data.max_prompt_length, set "
                        "data.truncation=left|right|middle to cut it, or data.filter_overlong_prompts=true "
                        "to drop such rows"
                    )
                ids = truncate(ids, max_prompt_length, truncation)
            self._items.append(
                {
                    "input_ids": ids,
                    "raw_prompt": row["prompt"],
                    "data_source": row["data_source"],
                    "ground_truth": row["reward_model"]["ground_truth"],
                    "extra_info": row.get("extra_info") or {},
                    "ability": row.get("ability"),
                    "index": index,
                }
            )
        if not self._items:
            raise DataError(
                f"{source}: all {len(rows)} rows are longer than data.max_prompt_length={max_prompt_length} "
                "tokens and were filtered out; raise data.max_prompt_length or set "
                "data.filter_overlong_prompts=false with a data.truncation mode"
            )

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict:
        item = self._items[i]
        # A copy, so a caller that edits a batch in place (appending response ids, say) cannot change
        # what the next epoch sees; strings are immutable and need no copying.
        return {
            **item,
            "input_ids": list(item["input_ids"]),
            "raw_prompt": [dict(m) for m in item["raw_prompt"]],
            "ground_truth": copy.deepcopy(item["ground_truth"]),
            "extra_info": copy.deepcopy(item["extra_info"]),
        }
