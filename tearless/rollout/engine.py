"""The rollout-engine protocol: what every engine returns, and what an engine can do.

An engine samples ``n`` responses per prompt and returns a :class:`RolloutOutput`; it declares its
:class:`Capabilities`, and the rest of the package asks those, never the engine's name
(``actor_rollout_ref.rollout.name`` is read only by the factory, :func:`engine_class` and
``tearless.workers.build.build_rollout``). The built-in engine is :class:`tearless.rollout.hf.HFRollout`,
vLLM's :class:`tearless.rollout.vllm.VLLMRollout`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = [
    "Capabilities",
    "RolloutEngine",
    "RolloutOutput",
    "concat_rollouts",
    "engine_capabilities",
    "engine_class",
    "left_pad",
    "select_rows",
]


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do.

    - ``holds_own_weights``: it keeps its own copy of the policy, in its own format, that every
      update must be loaded into (and that the sync probe checks); otherwise it samples from the
      model it was given (in the hybrid placement, the trained one).
    - ``exact_log_probs``: its sampling log-probs are the trainer's forward of the same weights in
      the same precision, so an on-policy update may skip recomputing π_old.
    - ``records_versions``: it records the policy version of each token (``token_versions``).
    - ``resumes_partial``: it takes new weights between two tokens and continues the responses in
      flight (``between_tokens``; partial rollouts).
    - ``multi_turn``: the agent loop can drive it (stop sequences, one call per turn).
    - ``raw_images``: a vision-language prompt reaches it as its text and decoded images (``images``,
      each prompt's ``multi_modal_prompt``), which it tokenises and preprocesses itself; otherwise as
      the processor's pixel inputs (``vision``, each prompt's ``multi_modal_inputs``).
    """

    holds_own_weights: bool
    exact_log_probs: bool
    records_versions: bool
    resumes_partial: bool
    multi_turn: bool
    raw_images: bool


@dataclass
class RolloutOutput:
    """Token tensors of one rollout, prompts left-padded and responses right-padded.

    Shapes: ``prompt_ids``/``prompt_mask`` (B, P), ``response_ids``/``response_mask``/``log_probs``
    (B, R) with B = number of prompts × n, rows of the same prompt adjacent (interleaved).
    ``truncated`` (B,) is True where the response hit the length cap without an EOS.

    ``response_mask`` is the loss mask: 1 on the tokens the model sampled. ``response_attention_mask``
    is 1 on every real response token; it differs only in a multi-turn rollout
    (:mod:`tearless.rollout.agent`), where tool output is context the model attends to (1) but did
    not write (mask 0). It defaults to ``response_mask``.

    ``entropy`` (B, R), when the engine provides it, is the entropy of the temperature-scaled,
    unfiltered distribution each response token was drawn from (0 outside the mask): on-policy, the
    actor's entropy of the same tokens.

    ``token_versions`` (B, R), when the engine provides it, is the policy version each response token
    was sampled with (0 outside the mask). Tokens of one response differ only in a partial rollout
    (``HFRollout.generate``'s ``between_tokens``): a response interrupted by a weight update
    continues under the new weights, and ``log_probs`` holds each token's behaviour log-prob.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    log_probs: torch.Tensor
    truncated: torch.Tensor
    response_attention_mask: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    token_versions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.response_attention_mask is None:
            self.response_attention_mask = self.response_mask


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token lists into (B, P) ids and mask, padding on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def right_pad(rows: list[list], pad: float, dtype: torch.dtype, width: int) -> torch.Tensor:
    """Stack per-response lists into a (B, ``width``) tensor, each row from column 0, ``pad`` after it."""
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


class RolloutEngine(Protocol):
    """What the workers and the agent loop call on an engine."""

    capabilities: Capabilities
    eos: torch.Tensor
    pad_token_id: int

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        do_sample: bool = True,
        keys: Sequence[int] | None = None,
        stop_sequences: list[list[int]] | None = None,
        version: int = 0,
        between_tokens: Callable[[], int | None] | None = None,
        vision: Sequence[dict[str, torch.Tensor]] | None = None,
    ) -> RolloutOutput:
        """``n`` responses per prompt, rows of a prompt adjacent (see ``HFRollout.generate``); ``vision``
        (each prompt's pixel inputs) only for a vision-language policy, which only the built-in engine
        samples (the config refuses the others)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take the policy's named tensors (plain state-dict names)."""
        ...


# The engines by ``actor_rollout_ref.rollout.name``: module and class, imported on first use (vLLM is
# an optional dependency; its module imports vllm only when an engine is built).
ENGINES = {"hf": ("tearless.rollout.hf", "HFRollout"), "vllm": ("tearless.rollout.vllm", "VLLMRollout")}


def engine_class(name: str) -> type:
    """The engine class registered as ``name``."""
    module, cls = ENGINES[name]
    return getattr(importlib.import_module(module), cls)


def engine_capabilities(name: str) -> Capabilities:
    """The capabilities of the engine registered as ``name``, without building it."""
    return engine_class(name).capabilities


def select_rows(out: RolloutOutput, rows: torch.Tensor) -> RolloutOutput:
    """The rollout restricted to ``rows`` (an index tensor), in that order."""
    fields = (getattr(out, f) for f in RolloutOutput.__dataclass_fields__)
    return RolloutOutput(*(None if t is None else t[rows] for t in fields))


def concat_rollouts(outs: list[RolloutOutput], pad_token_id: int) -> RolloutOutput:
    """Stack rollouts of different widths: prompts re-padded on the left, responses on the right."""
    if len(outs) == 1:
        return outs[0]
    p = max(o.prompt_ids.shape[1] for o in outs)
    r = max(o.response_ids.shape[1] for o in outs)

    def left(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (p - t.shape[1], 0), value=value)

    def right(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, r - t.shape[1]), value=value)

    return RolloutOutput(
        prompt_ids=torch.cat([left(o.prompt_ids, pad_token_id) for o in outs]),
        prompt_mask=torch.cat([left(o.prompt_mask, 0) for o in outs]),
        response_ids=torch.cat([right(o.response_ids, pad_token_id) for o in outs]),
        response_mask=torch.cat([right(o.response_mask, 0) for o in outs]),
        log_probs=torch.cat([right(o.log_probs, 0.0) for o in outs]),
        truncated=torch.cat([o.truncated for o in outs]),
        response_attention_mask=torch.cat([right(o.response_attention_mask, 0) for o in outs]),
        entropy=None
        if any(o.entropy is None for o in outs)
        else torch.cat([right(o.entropy, 0.0) for o in outs]),
        token_versions=None
        if any(o.token_versions is None for o in outs)
        else torch.cat([right(o.token_versions, 0) for o in outs]),
    )
