"""Reward-model scoring: a Hugging Face sequence-classification model scores (prompt, response) pairs.

The model is loaded from a local directory (or a Hub ID, :mod:`tearless.models.hub`) with
``AutoModelForSequenceClassification`` and must have one output (``num_labels=1``): its logit at the
last non-padding token is the reward. Each pair is rendered as a conversation ending in the
assistant's response: with the tokenizer's chat template when it has one, else as
``"role: content"`` lines followed by ``"assistant: <response>"`` (the same plain rendering
:func:`tearless.data.render_prompt` uses). A pair longer than ``max_length`` tokens keeps its last
``max_length`` tokens, since the response's end is what the model judges.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tearless.models.hub import local_model_path


def conversation_ids(tokenizer: Any, messages: Sequence[dict]) -> list[int]:
    """The token ids a reward model scores for ``messages`` (the last one the response): the chat
    template's rendering, else ``"role: content"`` lines with the last message unterminated. ``tearless
    rm`` trains on exactly these ids, so a trained reward model is scored on what it learned from."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False))
    *context, last = messages
    text = "".join(f"{m['role']}: {m['content']}\n" for m in context)
    return list(tokenizer.encode(f"{text}{last['role']}: {last['content']}"))


class RewardModelScorer:
    """Scores pairs in micro-batches of ``micro_batch_size`` (``None``: all at once).

    Args:
        path: local directory or Hub ID of the model and its tokenizer (``reward_model.model.path``).
        micro_batch_size: pairs per forward pass (``reward_model.micro_batch_size_per_gpu``).
        max_length: longest pair in tokens (``reward_model.max_length``); ``None`` = no limit.
        device: where the model runs.
    """

    def __init__(
        self,
        path: str,
        *,
        micro_batch_size: int | None = None,
        max_length: int | None = None,
        device: str = "cpu",
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"reward_model.micro_batch_size_per_gpu must be >= 1, got {micro_batch_size}")
        if max_length is not None and max_length < 2:
            raise ValueError(f"reward_model.max_length must be >= 2 tokens, got {max_length}")
        local = local_model_path(path, "reward_model.model.path")
        self.tokenizer = AutoTokenizer.from_pretrained(local)
        self.model = AutoModelForSequenceClassification.from_pretrained(local, dtype=torch.float32)
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward_model.model.path={path!r} has {self.model.config.num_labels} outputs; "
                "a reward model "
                "has one (num_labels=1)"
            )
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # The model finds each row's last real token by looking for padding.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device).eval().requires_grad_(False)
        self.device = device
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length

    def encode(self, prompt: str | Sequence[dict], response: str) -> list[int]:
        """Token ids of the conversation ``prompt`` + the assistant's ``response``."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        ids = conversation_ids(self.tokenizer, [*messages, {"role": "assistant", "content": response}])
        if self.max_length is not None and len(ids) > self.max_length:
            ids = ids[len(ids) - self.max_length :]
        return ids

    def score(self, prompts: Sequence[Any], responses: Sequence[str]) -> list[float]:
        """One reward per pair, in order."""
        import torch

        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        encoded = [self.encode(p, r) for p, r in zip(prompts, responses, strict=True)]
        size = self.micro_batch_size or max(len(encoded), 1)
        scores: list[float] = []
        pad = self.tokenizer.pad_token_id
        for start in range(0, len(encoded), size):
            chunk = encoded[start : start + size]
            width = max(len(ids) for ids in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, ids in enumerate(chunk):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                mask[row, : len(ids)] = 1
            with torch.no_grad():
                logits = self.model(
                    input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)
                ).logits
            scores.extend(logits[:, 0].float().cpu().tolist())
        return scores
