r"""Process reward model (PRM) scoring: a Hugging Face model scores every reasoning step of a response.

Three kinds, chosen by ``reward_model.step_reward.prm.kind``:

- ``token_classification`` (TRL's PRM format, what its ``PRMTrainer`` trains): an
  ``AutoModelForTokenClassification`` read at the last token of each step; with two labels the step
  score is :math:`P(\text{label } 1)` (softmax), with one label :math:`\sigma(\text{logit})`.
- ``causal_lm`` (Math-Shepherd's format): an ``AutoModelForCausalLM``, with ``step_tag`` written
  after every step; the step score is the probability of the good token against the bad one at the
  tag, :math:`e^{z_+} / (e^{z_+} + e^{z_-})`.
- ``implicit`` (PRIME, Cui et al. 2025; Yuan et al. 2024): a causal LM :math:`\pi_\phi` trained on
  outcome labels only (``tearless dpo algorithm.loss_type=implicit_prm``) against its reference
  :math:`\pi_{ref}` (``prm.ref_path``) gives every token the reward
  :math:`\beta\log\frac{\pi_\phi(y_t|y_{<t})}{\pi_{ref}(y_t|y_{<t})}`; a step's score is the sum over its
  tokens (from the token after the previous step's end to its own last token).

A pair is encoded as the policy saw it: the prompt rendered with the chat template and the
generation prompt (or plain ``role: content`` lines without one), then the response's tokens. Steps
are cut by the configured separator (:func:`tearless.rewards.steps.split_steps`) and found in the
tokens by :func:`tearless.rewards.steps.char_ends_to_tokens`, so each step's score comes back with its
character end and lands on the policy's matching token. A pair longer than ``max_length`` tokens keeps
its last ``max_length``; steps cut off with the front get no score.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tearless.models.hub import local_model_path
from tearless.rewards.steps import char_ends_to_tokens, split_steps

PRM_KINDS = ("token_classification", "causal_lm", "implicit")


def prompt_token_ids(tokenizer: Any, prompt: str | Sequence[dict]) -> list[int]:
    """Token ids of the prompt as the policy saw it: the chat template with the generation prompt, or
    plain ``role: content`` lines and ``assistant: `` without a template."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if getattr(tokenizer, "chat_template", None):
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return list(tokenizer.encode(f"{text}assistant: "))


def encode_steps(
    tokenizer: Any,
    prompt: str | Sequence[dict],
    response: str,
    *,
    separator: str = "\n",
    regex: bool = False,
    step_tag: str | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """``(input ids, positions, step ends)`` of a pair: the prompt's ids then the response's, the
    position of each step's last token (of the ``step_tag`` written after it, when given) and each
    step's character end in ``response``."""
    ends = split_steps(response, separator, regex=regex)
    text, marks = response, ends
    if step_tag is not None:
        cuts = [0, *ends, len(response)]
        text = "".join(
            response[a:b] + (step_tag if i < len(ends) else "")
            for i, (a, b) in enumerate(itertools.pairwise(cuts))
        )
        marks = [e + (j + 1) * len(step_tag) for j, e in enumerate(ends)]
    head = prompt_token_ids(tokenizer, prompt)
    body = list(tokenizer.encode(text, add_special_tokens=False))
    tokens = char_ends_to_tokens(marks, body, tokenizer.decode, text) if marks else []
    return head + body, [len(head) + k for k in tokens], ends


class ProcessRewardScorer:
    """Scores the steps of (prompt, response) pairs in micro-batches of ``micro_batch_size``.

    Args:
        path: local directory or Hub ID of the model and tokenizer (``reward_model.step_reward.prm.path``).
        kind: ``token_classification`` or ``causal_lm`` (see the module docs).
        separator, separator_regex: what cuts a response into steps.
        good_token, bad_token, step_tag: the ``causal_lm`` reading (each token one vocabulary entry).
        ref_path, beta: the ``implicit`` kind's reference model and β.
        micro_batch_size: pairs per forward pass; ``None`` = all at once.
        max_length: longest pair in tokens (keeps the end); ``None`` = no limit.
        device: where the model runs.
    """

    def __init__(
        self,
        path: str,
        *,
        kind: str = "token_classification",
        separator: str = "\n",
        separator_regex: bool = False,
        good_token: str = "+",
        bad_token: str = "-",
        step_tag: str = "ки",
        ref_path: str | None = None,
        beta: float = 0.05,
        micro_batch_size: int | None = None,
        max_length: int | None = None,
        device: str = "cpu",
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

        if kind not in PRM_KINDS:
            raise ValueError(
                f"reward_model.step_reward.prm.kind={kind!r} is not one of {', '.join(PRM_KINDS)}"
            )
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"the PRM micro-batch size must be >= 1, got {micro_batch_size}")
        path = local_model_path(path, "reward_model.step_reward.prm.path")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        loader = AutoModelForTokenClassification if kind == "token_classification" else AutoModelForCausalLM
        self.model = loader.from_pretrained(path, dtype=torch.float32)
        if kind == "token_classification" and self.model.config.num_labels not in (1, 2):
            raise ValueError(
                f"reward_model.step_reward.prm.path={path!r} has {self.model.config.num_labels} labels; a "
                "token-classification PRM has 2 (bad, good) or 1 (a logit)"
            )
        self.ref = None
        if kind == "implicit":
            if not ref_path:
                raise ValueError(
                    "reward_model.step_reward.prm.ref_path: the implicit PRM needs its reference model"
                )
            ref_path = local_model_path(ref_path, "reward_model.step_reward.prm.ref_path")
            self.ref = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32)
            self.ref.to(device).eval().requires_grad_(False)
        self.beta = beta
        if kind == "causal_lm":
            self.good_bad = [
                self._single_token(t, key) for t, key in ((good_token, "good"), (bad_token, "bad"))
            ]
            if not step_tag:
                raise ValueError(
                    "reward_model.step_reward.prm.step_tag is empty; a causal_lm PRM is read after it"
                )
        self.model.to(device).eval().requires_grad_(False)
        self.kind, self.separator, self.regex, self.step_tag = kind, separator, separator_regex, step_tag
        self.micro_batch_size, self.max_length, self.device = micro_batch_size, max_length, device
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.tokenizer.eos_token_id

    def _single_token(self, text: str, which: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(
                f"reward_model.step_reward.prm.{which}_token={text!r} is {len(ids)} tokens for this "
                "tokenizer; it must be one"
            )
        return ids[0]

    def encode(
        self, prompt: str | Sequence[dict], response: str
    ) -> tuple[list[int], list[int], list[int], int]:
        """:func:`encode_steps` of the pair, cut to its last ``max_length`` tokens, and the position of
        its first response token."""
        first = len(prompt_token_ids(self.tokenizer, prompt))
        ids, positions, ends = encode_steps(
            self.tokenizer,
            prompt,
            response,
            separator=self.separator,
            regex=self.regex,
            step_tag=self.step_tag if self.kind == "causal_lm" else None,
        )
        if self.max_length is not None and len(ids) > self.max_length:
            cut = len(ids) - self.max_length
            ids = ids[cut:]
            kept = [(p - cut, e) for p, e in zip(positions, ends, strict=True) if p >= cut]
            positions, ends = [p for p, _ in kept], [e for _, e in kept]
            first = max(first - cut, 0)
        return ids, positions, ends, first

    def score(
        self, prompts: Sequence[Any], responses: Sequence[str]
    ) -> list[tuple[tuple[float, ...], tuple[int, ...]]]:
        """``(step_scores, step_ends)`` per pair, in order."""
        import torch

        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        encoded = [self.encode(p, r) for p, r in zip(prompts, responses, strict=True)]
        size = self.micro_batch_size or max(len(encoded), 1)
        out: list[tuple[tuple[float, ...], tuple[int, ...]]] = []
        for start in range(0, len(encoded), size):
            chunk = encoded[start : start + size]
            width = max(len(e[0]) for e in chunk)
            input_ids = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, (ids, *_) in enumerate(chunk):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                mask[row, : len(ids)] = 1
            input_ids, mask = input_ids.to(self.device), mask.to(self.device)
            with torch.no_grad():
                logits = self.model(input_ids=input_ids, attention_mask=mask).logits.float()
                if self.kind == "implicit":
                    ref_logits = self.ref(input_ids=input_ids, attention_mask=mask).logits.float()
            if self.kind == "implicit":
                rewards = self._token_rewards(logits, ref_logits, input_ids)
                for row, (_, positions, ends, first) in enumerate(chunk):
                    out.append((self._step_sums(rewards[row], positions, first), tuple(ends)))
                continue
            probs = self._step_probabilities(logits)
            for row, (_, positions, ends, _) in enumerate(chunk):
                out.append((tuple(probs[row, positions].cpu().tolist()), tuple(ends)))
        return out

    def _token_rewards(self, logits: Any, ref_logits: Any, input_ids: Any) -> Any:
        """(B, L): β(log π(x_p|x_<p) − log π_ref(x_p|x_<p)) at every position p ≥ 1, 0 at p = 0."""
        import torch

        # torch: the reward worker processes import tearless.rewards without it
        from tearless.algos import logprobs_from_logits

        labels = input_ids[:, 1:]
        ratio = logprobs_from_logits(logits[:, :-1], labels) - logprobs_from_logits(
            ref_logits[:, :-1], labels
        )
        return torch.nn.functional.pad(self.beta * ratio, (1, 0))

    @staticmethod
    def _step_sums(rewards: Any, positions: list[int], first: int) -> tuple[float, ...]:
        """Each step's token rewards summed: step j covers (previous step's end, its own end]; the first
        step starts at the response's first token ``first``."""
        import torch

        kept = torch.where(torch.arange(len(rewards), device=rewards.device) >= first, rewards, 0.0)
        cumulative = kept.cumsum(0)
        ends = cumulative[positions]
        starts = torch.cat([cumulative.new_zeros(1), ends[:-1]]) if positions else ends
        return tuple((ends - starts).cpu().tolist())

    def _step_probabilities(self, logits: Any) -> Any:
        """(B, L) probability that the step ending at each position is good."""
        if self.kind == "causal_lm":
            return logits[..., self.good_bad].softmax(-1)[..., 0]
        if logits.shape[-1] == 1:
            return logits[..., 0].sigmoid()
        return logits.softmax(-1)[..., 1]
