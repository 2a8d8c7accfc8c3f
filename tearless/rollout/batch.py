"""The step's batch: one scored rollout, one row per response, every per-response field in one place.

A prompt gets its ``uid`` when it is drawn (:mod:`tearless.trainers.source`); its ``n`` responses
carry it in their ``items`` and are grouped, selected and filtered by it (:mod:`tearless.algos.groups`),
never by position. A field marked ``per_row`` is selected and concatenated with the rows
(:meth:`Rollout.select`, :func:`concat`): adding a per-response field is adding it here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
from tensordict import TensorDict

from tearless.algos.groups import group_ids
from tearless.models.vision import stack_pixels
from tearless.rollout.engine import RolloutOutput, concat_rollouts, select_rows

ROW = {"per_row": True}


@dataclass
class Rollout:
    """A scored rollout gathered from the generating ranks, rows in prompt order (a prompt's ``n``
    responses adjacent). Per response: the tensors (``out``), its prompt's fields with its ``uid`` (plus
    ``tool_calls`` in multi-turn), score, correctness, decoded text, each scorer's extra values and,
    for ReMax, the score of its prompt's greedy response (``baselines``). For the batch: the metrics of
    reward scoring and of the agent loop, the slowest rank's seconds of generation and scoring, and
    reward errors (message → [count, traceback])."""

    out: RolloutOutput
    items: list[dict] = field(metadata=ROW)
    scores: torch.Tensor = field(metadata=ROW)
    correct: torch.Tensor = field(metadata=ROW)
    texts: list[str] = field(metadata=ROW)
    extras: list[dict] = field(metadata=ROW)
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    errors: dict[str, list] = field(default_factory=dict)
    baselines: torch.Tensor | None = field(default=None, metadata=ROW)

    @property
    def uids(self) -> list[Any]:
        """Each response's prompt group, given when its prompt was drawn."""
        return [it["uid"] for it in self.items]

    def tensors(self) -> TensorDict:
        """The rows' tensors as the ranks take them (log-prob forwards, values, updates), each row
        carrying its prompt group as a small integer (``uid_index``, first-appearance order), and, for a
        vision-language policy, its prompt's pixel inputs (``pixel_values``, …: the items'
        ``multi_modal_inputs`` stacked, :func:`~tearless.models.vision.stack_pixels`)."""
        out = self.out
        td = TensorDict(
            {
                "prompt_ids": out.prompt_ids,
                "prompt_mask": out.prompt_mask,
                "response_ids": out.response_ids,
                "response_mask": out.response_mask,
                "response_attention_mask": out.response_attention_mask,
                "uid_index": group_ids(self.uids, len(self.items)),
            },
            batch_size=[len(self.items)],
        )
        if out.entropy is not None:
            td["rollout_entropy"] = out.entropy
        if self.items and "multi_modal_inputs" in self.items[0]:  # a vision-language policy's pixels
            td.update(stack_pixels([it["multi_modal_inputs"] for it in self.items]))
        return td

    def select(self, keep: torch.Tensor) -> Rollout:
        """The rows ``keep`` (an index tensor), in that order; the batch fields unchanged."""
        rows = keep.tolist()

        def pick(value: Any) -> Any:
            if value is None:
                return None
            return value[keep] if isinstance(value, torch.Tensor) else [value[i] for i in rows]

        per_row = {f.name: pick(getattr(self, f.name)) for f in fields(self) if f.metadata.get("per_row")}
        batch = {f.name: getattr(self, f.name) for f in fields(self) if not f.metadata.get("per_row")}
        return Rollout(**{**batch, **per_row, "out": select_rows(self.out, keep)})


def concat(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Rollouts one after the other (the batch fields of the last one)."""
    if len(parts) == 1:
        return parts[0]

    def join(values: list[Any]) -> Any:
        if any(v is None for v in values):
            return None
        return torch.cat(values) if isinstance(values[0], torch.Tensor) else [x for v in values for x in v]

    last = parts[-1]
    per_row = {
        f.name: join([getattr(p, f.name) for p in parts]) for f in fields(last) if f.metadata.get("per_row")
    }
    batch = {f.name: getattr(last, f.name) for f in fields(last) if not f.metadata.get("per_row")}
    return Rollout(**{**batch, **per_row, "out": concat_rollouts([p.out for p in parts], pad_token_id)})
