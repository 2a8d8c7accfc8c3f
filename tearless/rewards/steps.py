r"""Step-level (process) rewards: cut a response into reasoning steps, find each step's last token, and
build ``token_level_rewards`` from the outcome score and the step scores.

A reward function (or a process reward model) may return, besides its ``score`` (the outcome),
``step_scores`` (one number per step) and optionally ``step_ends``: the exclusive character offset in
``solution_str`` where each step ends. Without ``step_ends`` the steps are found by
:func:`split_steps` with the configured separator. Each step's score lands on the response token
that holds the step's last character; the outcome lands on the last response token:

.. math:: r_t = w_o\,[t = t_{last}]\,R + w_s \sum_j [t = t_j]\,s_j

with :math:`w_o` ``outcome_weight``, :math:`w_s` ``step_weight``, R the outcome, :math:`s_j` and
:math:`t_j` step j's score and last token. ``step_mask`` marks every :math:`t_j`, and also
:math:`t_{last}` when :math:`w_o \ne 0` (the outcome is then the reward of a final step, merged with
the last step when that ends on the same token), for estimators that read rewards per step
(``grpo_process``). Everything here is a pure function of its inputs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch


def split_steps(text: str, separator: str, *, regex: bool = False) -> list[int]:
    r"""Exclusive end offsets of the steps of ``text``.

    ``text`` is cut at every occurrence of ``separator`` (a literal string, or a regular expression
    with ``regex``); the pieces between occurrences are the steps, and a piece that is only
    whitespace is not a step. A step ends at its last non-whitespace character, so the separator
    works both between steps (``"\n\n"``) and as a header before each step (``r"Step \d+:"`` with
    ``regex``: the header's own text is not a step). E.g. ``"a+b=3\nc=4\n"`` with ``"\n"`` → ``[5, 9]``.
    """
    if not separator:
        raise ValueError("the step separator is empty; set it to the string between steps, e.g. '\\n'")
    pattern = re.compile(separator if regex else re.escape(separator))
    cuts = [(m.start(), m.end()) for m in pattern.finditer(text) if m.end() > m.start()]
    ends, start = [], 0
    for cut_start, cut_end in [*cuts, (len(text), len(text))]:
        piece = text[start:cut_start]
        if piece.strip():
            ends.append(start + len(piece.rstrip()))
        start = cut_end
    return ends


def char_ends_to_tokens(
    ends: Sequence[int], token_ids: Sequence[int], decode: Callable[[list[int]], str], text: str
) -> list[int]:
    """For each exclusive character end offset of ``text``, the index in ``token_ids`` of the token
    that completes the character ``end - 1``.

    ``text`` must be ``decode(token_ids)``. The token is found by a binary search over prefix decodes:
    the smallest k with ``decode(token_ids[:k])`` starting with ``text[:end]``. This works for any
    tokenizer whose prefixes decode to prefixes of the text: one token per character, BPE merges over
    several characters, byte-level tokens that complete a multi-byte character (a prefix ending inside
    one decodes to a replacement character, which does not match). Raises ValueError for an offset
    outside (0, len(text)].
    """
    out = []
    for end in ends:
        if not 0 < end <= len(text):
            raise ValueError(f"step end {end} is outside the response's {len(text)} characters")
        target = text[:end]
        low, high = 1, len(token_ids)
        while low < high:
            mid = (low + high) // 2
            if decode(list(token_ids[:mid])).startswith(target):
                high = mid
            else:
                low = mid + 1
        out.append(low - 1)
    return out


def response_step_tokens(
    step_ends: Sequence[int],
    response_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    decode: Callable[[list[int]], str],
) -> list[int | None]:
    """Row positions of the last tokens of the steps of one response.

    The scorer read ``decode(response_ids[attention_mask])`` (the whole trajectory, tool output
    included), so character offsets are mapped over those tokens first. A step whose last token is
    not the model's (``response_mask`` 0: tool output in a multi-turn rollout) is credited to the
    model's last token before it; a step with none before it gets ``None`` (nothing to credit).
    """
    positions = attention_mask.bool().nonzero().squeeze(-1)
    ids = response_ids[positions].tolist()
    text = decode(ids)
    model = response_mask.bool()
    out: list[int | None] = []
    for k in char_ends_to_tokens(step_ends, ids, decode, text):
        p = int(positions[k])
        before = model[: p + 1].nonzero()
        out.append(int(before[-1]) if len(before) else None)
    return out


def score_positions(mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's last token with mask 1, where its score goes (0 for an empty row).

    Not ``mask.sum(-1) - 1``: in a multi-turn rollout the mask has holes where tool output is, and
    the last model token sits after them.
    """
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)
    return torch.where(mask.any(-1), last, 0)


def token_level_rewards(
    scores: Sequence[float],
    steps: Sequence[tuple[Sequence[float], Sequence[int] | None] | None],
    texts: Sequence[str],
    response_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    decode: Callable[[list[int]], str],
    *,
    separator: str = "\n",
    regex: bool = False,
    outcome_weight: float = 1.0,
    step_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_level_rewards, step_mask)``, both (B, T), for a batch of scored responses.

    ``scores`` (B,) are the outcome scores; ``steps[i]`` is None (no step scores: the outcome alone
    on the last valid token, which with the default weights is exactly the outcome-only reward) or
    ``(step_scores, step_ends)``, ``step_ends`` None to split ``texts[i]`` (what the scorer read) by
    ``separator``. ``response_ids``, ``attention_mask``, ``response_mask`` are the rollout's (B, T)
    tensors. Steps on the same token add up; a row without valid tokens gets nothing. A scorer's step
    count that differs from the separator's raises ValueError naming the sample.
    """
    batch, width = response_mask.shape
    rows = response_mask.bool().any(-1).nonzero().squeeze(-1)
    last = score_positions(response_mask)
    rewards = torch.zeros(batch, width, dtype=torch.float32)
    step_mask = torch.zeros(batch, width, dtype=torch.bool)
    if outcome_weight != 0.0:
        outcome = torch.as_tensor(scores, dtype=torch.float32)
        rewards[rows, last[rows]] = outcome_weight * outcome[rows]
        step_mask[rows, last[rows]] = True
    for i in rows.tolist():
        if steps[i] is None:
            continue
        step_scores, ends = steps[i]
        if ends is None:
            ends = split_steps(texts[i], separator, regex=regex)
            if len(ends) != len(step_scores):
                raise ValueError(
                    f"sample {i}: the scorer gave {len(step_scores)} step scores but the separator "
                    f"{separator!r} cuts its response into {len(ends)} steps; return 'step_ends' "
                    "(character offsets) with the scores, or set reward_model.step_reward.separator"
                )
        located = response_step_tokens(ends, response_ids[i], attention_mask[i], response_mask[i], decode)
        for score, t in zip(step_scores, located, strict=True):
            if t is not None:
                rewards[i, t] += step_weight * float(score)
                step_mask[i, t] = True
    return rewards, step_mask


def step_fields(steps: tuple[Sequence[float], Sequence[int] | None] | None) -> dict[str, list]:
    """A scored response's steps as fields of its reward components (``step_scores`` and, when the
    scorer gave them, ``step_ends``), which the trainer carries with each sample; {} without steps."""
    if steps is None:
        return {}
    scores, ends = steps
    return {"step_scores": list(scores), **({"step_ends": list(ends)} if ends is not None else {})}


def rollout_token_rewards(
    scores: torch.Tensor,
    components: Sequence[dict],
    texts: Sequence[str],
    out: Any,
    tokenizer: Any,
    settings: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RL trainer's hook: :func:`token_level_rewards` of a rollout ``out`` (its ``response_ids``,
    ``response_attention_mask`` and ``response_mask``), decoded as the trainer decodes responses for
    scoring, with the steps found in each sample's reward ``components`` (:func:`step_fields`) and the
    ``reward_model.step_reward`` config section ``settings``."""
    steps = [(c["step_scores"], c.get("step_ends")) if "step_scores" in c else None for c in components]
    return token_level_rewards(
        scores.tolist(),
        steps,
        texts,
        out.response_ids,
        out.response_attention_mask,
        out.response_mask,
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        separator=settings.separator,
        regex=settings.separator_regex,
        outcome_weight=settings.outcome_weight,
        step_weight=settings.step_weight,
    )
