"""A test double of a rollout engine that emits given token ids, and a recording wrapper of a real one.

``ScriptedEngine`` returns, for the k-th time a row's prompt is seen, ``script[key][k]`` (token ids,
EOS included where the turn ends), the row told apart by the text its prompt starts with; log-prob
``-0.5`` per token. Everything else in the tests (tokenizer, chat template, loops, endpoint) is real.
"""

from __future__ import annotations

import torch

from tearless.rollout.hf import RolloutOutput, left_pad


class ScriptedEngine:
    def __init__(self, tok, script: dict[str, list[list[int]]]) -> None:
        self.tok, self.script = tok, script
        self.eos = torch.tensor([tok.eos_token_id])
        self.pad_token_id = tok.pad_token_id
        self.turn: dict[str, int] = {}
        self.generated: list[list[int]] = []

    def generate(self, prompts, *, n, max_new_tokens, keys=None, **_):
        rows = []
        for ids in prompts:
            text = self.tok.decode(ids)
            key = next(k for k in self.script if k in text)
            k = self.turn.get(key, 0)
            self.turn[key] = k + 1
            rows.append(list(self.script[key][k])[:max_new_tokens])
        self.generated += rows
        width = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), width), self.pad_token_id)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r, dtype=torch.long), 1
        p_ids, p_mask = left_pad(prompts, self.pad_token_id)
        return RolloutOutput(
            p_ids, p_mask, ids, mask, -0.5 * mask.float(), torch.zeros(len(rows), dtype=torch.bool)
        )


class Recording:
    """A real engine whose every generated row (ids and log-probs under the mask) is kept."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.eos, self.pad_token_id = engine.eos, engine.pad_token_id
        self.generated: list[tuple[list[int], list[float]]] = []

    def generate(self, prompts, **kwargs):
        out = self.engine.generate(prompts, **kwargs)
        for ids, m, lp in zip(out.response_ids, out.response_mask, out.log_probs, strict=True):
            self.generated.append((ids[m.bool()].tolist(), lp[m.bool()].tolist()))
        return out
