"""The multi-turn protocol: what a loop that generates whole trajectories gives the rank, the one turn
loop that drives a trajectory's turns, and the token bookkeeping every such loop shares.

Three loops implement :class:`MultiTurnLoop`: the tool loop (:class:`tearless.rollout.agent.AgentLoop`),
the environment loop (:class:`tearless.envs.loop.EnvLoop`) and the agent-program loop
(:class:`tearless.envs.agents.ProgramLoop`). Each turns prompt rows into an :class:`AgentRollout`: one
token sequence per trajectory,

    prompt | model turn 1 | environment turn 1 | model turn 2 | … | last model turn
    loss mask:    1…1     |        0…0         |     1…1      | … |      1…1

built with :class:`TokenTrajectory` and packed by :func:`pack`. The tool loop and the environment loop
are both :class:`TurnLoop`: one :meth:`TurnLoop.run_turns` samples every active trajectory's turn in one
engine call, tells the loop's :meth:`TurnLoop.respond` what each turn was (a :class:`Turn`) and applies
its :class:`Reply` (end the trajectory, or append the environment's tokens); the loops differ only in
how they answer (parse the turn and run its tool calls; an environment's ``step``). The agent-program
loop has no turns of its own to drive: the user's program calls the model through an endpoint.

``owns_reward`` says who scores: ``False`` (the tool loop), the run's reward manager reads the
trajectory's text; ``True`` (environments, agent programs, a :class:`RewardingLoop`), the loop's own
:meth:`RewardingLoop.score` sums the rewards the episodes earned. Either way the rank gets one
:class:`Scores`.

The protocol lives on the rollout floor so that ``tearless.envs`` (the floor above) implements it and
the rank (``tearless.workers``) depends on it alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch

from tearless.rollout.engine import RolloutOutput, left_pad, right_pad
from tearless.rollout.seeds import mix, sample_keys


class Scores(TypedDict):
    """A generating rank's scores of its responses (B of them), whoever scored them; the rank sends it
    to the driver inside its share, which merges the shares' fields (a dict, so it travels and merges
    as the share does).

    ``scores`` (B,) float32 the sequence rewards; ``correct`` (B,) bool; ``texts`` the decoded responses
    (tool and environment tokens included); ``extras`` each response's reward components
    (``reward_extra/<key>/mean``); ``failures`` the samples not scored; ``errors`` those failures by
    message, ``{message: [count, traceback or message]}``; ``lost_workers`` reward processes that died
    while scoring."""

    scores: torch.Tensor
    correct: torch.Tensor
    texts: list[str]
    extras: list[dict[str, float]]
    failures: int
    errors: dict[str, list]
    lost_workers: int


@dataclass
class AgentRollout:
    """The rollout, per-row info (``tool_calls``, ``num_turns``, ``answered``, …) and batch metrics."""

    out: RolloutOutput
    rows: list[dict]
    metrics: dict[str, float]


class MultiTurnLoop(ABC):
    """A loop that generates whole trajectories: ``generate`` gives ``n`` of them per item (rows of an
    item adjacent), each at most ``max_new_tokens`` response tokens (model and environment tokens
    together); trajectory j of item i samples its t-th call with the key ``mix(mix(keys[i], j), t)``
    (:mod:`tearless.rollout.seeds`). ``owns_reward`` is ``False``: the run's reward manager scores.

    ``generate`` keeps that contract once, for every loop: it gives each trajectory its key and a
    loop implements :meth:`trajectories`."""

    owns_reward: bool = False

    def generate(
        self,
        items: list[dict],
        *,
        n: int = 1,
        max_new_tokens: int = 64,
        keys: Sequence[int] | None = None,
        **sampling: Any,
    ) -> AgentRollout:
        """``n`` trajectories per item; ``keys`` one per item (fresh random ones when None), ``sampling``
        to the engine."""
        return self.trajectories(items, n, trajectory_keys(keys, len(items), n), max_new_tokens, sampling)

    @abstractmethod
    def trajectories(
        self, items: list[dict], n: int, keys: list[int], limit: int, sampling: dict[str, Any]
    ) -> AgentRollout:
        """``n`` trajectories per item (rows of an item adjacent), trajectory j of item i keyed
        ``keys[i * n + j]`` (its t-th call samples with ``mix(key, t)``), each at most ``limit``
        response tokens; ``sampling`` goes to the engine."""


class RewardingLoop(MultiTurnLoop):
    """A :class:`MultiTurnLoop` whose episodes earn their own rewards (``owns_reward`` is ``True``):
    ``score`` gives the rank's :class:`Scores` from ``generate``'s rollout and rows, no reward
    manager involved."""

    owns_reward = True

    @abstractmethod
    def score(self, tokenizer: Any, out: RolloutOutput, info: list[dict]) -> Scores:
        """The rank's :class:`Scores` of ``out`` and its rows ``info``."""


@dataclass(kw_only=True)
class TokenTrajectory:
    """One trajectory's response as it grows: ``ids``, the loss ``mask`` (1 on model tokens) and the
    sampler's ``logps`` (0 on environment tokens), ``turns`` model turns and ``user_turns``
    environment turns so far."""

    prompt: list[int] = field(default_factory=list)
    key: int = 0
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    turns: int = 0
    user_turns: int = 0
    done: bool = False
    truncated: bool = False

    def append_model(self, ids: list[int], logps: list[float], limit: int) -> list[int]:
        """Append a model turn (mask 1) cut to the room left under the response budget ``limit``;
        the tokens kept."""
        room = limit - len(self.ids)
        ids, logps = ids[:room], logps[:room]
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logps += logps
        self.turns += 1
        return ids

    def append_env(self, tokens: list[int], limit: int) -> None:
        """Append environment tokens (mask 0), cut to the response budget ``limit``; a trajectory
        with no room left for the model to answer ends, truncated."""
        self.user_turns += 1
        room = limit - len(self.ids)
        if len(tokens) >= room:
            tokens = tokens[:room]
            self.done = self.truncated = True
        self.ids += tokens
        self.mask += [0] * len(tokens)
        self.logps += [0.0] * len(tokens)


def cut_tokens(ids: list[int], limit: int, side: str) -> list[int]:
    """``ids`` cut to ``limit`` tokens: ``left`` keeps the end, ``right`` the start, ``middle`` both ends
    (the first ``limit // 2`` tokens and the last ``limit - limit // 2``)."""
    if len(ids) <= limit:
        return ids
    if side == "left":
        return ids[len(ids) - limit :]
    if side == "right":
        return ids[:limit]
    head = limit // 2
    return ids[:head] + ids[len(ids) - (limit - head) :]


def trajectory_keys(keys: Sequence[int] | None, n_items: int, n: int) -> list[int]:
    """One key per trajectory, ``n`` per item (rows of an item adjacent): trajectory j of item i gets
    ``mix(keys[i], j)`` (:func:`~tearless.rollout.seeds.sample_keys`); fresh random item keys when
    ``keys`` is None."""
    if keys is None:
        keys = torch.randint(0, 2**62, (n_items,)).tolist()
    return sample_keys(keys, n)


def generate_turn(
    engine: Any, active: Sequence[TokenTrajectory], turn: int, limit: int, **sampling: Any
) -> RolloutOutput:
    """Turn ``turn`` of every active trajectory in one engine call: each continues its prompt and
    response so far, sampled with the key ``mix(key, turn)``; ``max_new_tokens`` is the most room any
    has left under the response budget ``limit`` (:meth:`TokenTrajectory.append_model` cuts each turn
    to its own room). ``sampling`` goes to the engine."""
    return engine.generate(
        [r.prompt + r.ids for r in active],
        n=1,
        max_new_tokens=max(limit - len(r.ids) for r in active),
        keys=[mix(r.key, turn) for r in active],
        **sampling,
    )


@dataclass(frozen=True)
class Turn:
    """What :meth:`TurnLoop.run_turns` tells a loop about one trajectory's model turn ``number``
    (1-based): ``ids`` the tokens kept (cut to the room left under the response budget), ``sampled`` all
    the engine sampled, ``full`` the budget is spent, ``final`` no environment tokens can follow (the
    budget spent, the last model turn, or no environment turn left)."""

    number: int
    ids: list[int]
    sampled: list[int]
    full: bool
    final: bool


@dataclass(frozen=True)
class Reply:
    """A loop's answer to a :class:`Turn`: ``done`` ends the trajectory (``truncated`` says whether it
    ran out of budget); otherwise ``tokens``, the environment's turn, are appended (loss mask 0)."""

    tokens: list[int] = field(default_factory=list)
    done: bool = False
    truncated: bool = False


class TurnLoop(ABC):
    """The one loop that drives multi-turn trajectories' turns: :meth:`run_turns`. A subclass holds
    ``engine`` and ``settings`` (``max_assistant_turns``, ``max_user_turns``) and answers each turn
    with :meth:`respond`."""

    engine: Any
    settings: Any

    def run_turns(self, rows: Sequence[TokenTrajectory], limit: int, sampling: dict[str, Any]) -> None:
        """Turns 1 … ``max_assistant_turns`` of ``rows`` (their prompts and keys set), each response at
        most ``limit`` tokens: each turn samples every active trajectory at once (:func:`generate_turn`,
        ``sampling`` to the engine), appends what fits (:meth:`TokenTrajectory.append_model`), asks
        :meth:`respond` and applies its replies; stops when every trajectory is done."""
        s = self.settings
        for number in range(1, s.max_assistant_turns + 1):
            active = [r for r in rows if not r.done]
            if not active:
                break
            out = generate_turn(self.engine, active, number, limit, **sampling)
            turns = []
            for j, r in enumerate(active):
                valid = out.response_mask[j].bool()
                sampled = out.response_ids[j][valid].tolist()
                ids = r.append_model(sampled, out.log_probs[j][valid].tolist(), limit)
                full = len(r.ids) >= limit
                last = number == s.max_assistant_turns or r.user_turns >= s.max_user_turns
                turns.append(Turn(number, ids, sampled, full, full or last))
            for r, reply in zip(active, self.respond(active, turns), strict=True):
                if reply.done:
                    r.done, r.truncated = True, reply.truncated
                else:
                    r.append_env(reply.tokens, limit)

    @abstractmethod
    def respond(self, active: list[Any], turns: list[Turn]) -> list[Reply]:
        """One :class:`Reply` per active trajectory (``active``, the subclass's own trajectories) to
        its entry of ``turns``."""


def pack(
    prompts: list[list[int]],
    responses: list[tuple[list[int], list[int], list[float]]],
    truncated: list[bool],
    pad: int,
) -> RolloutOutput:
    """A rollout of token lists: prompts left-padded; responses ``(ids, loss mask, log-probs)``
    right-padded, attention 1 on every real response token."""
    prompt_ids, prompt_mask = left_pad(prompts, pad)
    width = max(1, max(len(r[0]) for r in responses))
    return RolloutOutput(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=right_pad([r[0] for r in responses], pad, torch.long, width),
        response_mask=right_pad([r[1] for r in responses], 0, torch.long, width),
        log_probs=right_pad([r[2] for r in responses], 0.0, torch.float32, width),
        truncated=torch.tensor(truncated, dtype=torch.bool),
        response_attention_mask=right_pad([[1] * len(r[0]) for r in responses], 0, torch.long, width),
    )


def agent_metrics(rows: list[dict], mask: torch.Tensor, attention: torch.Tensor) -> dict[str, float]:
    """``multi_turn/*`` metrics of trajectories: ``rows`` as :class:`AgentRollout` gives them, with their
    loss mask and attention mask (B, R), so a batch gathered from several workers gets its metrics once."""
    turns = torch.tensor([float(r["num_turns"]) for r in rows])
    calls = torch.tensor([float(len(r["tool_calls"])) for r in rows])
    return {
        "multi_turn/num_turns/mean": float(turns.mean()),
        "multi_turn/num_turns/max": float(turns.max()),
        "multi_turn/num_turns/min": float(turns.min()),
        "multi_turn/tool_calls/mean": float(calls.mean()),
        "multi_turn/tool_errors": float(sum(c["error"] for r in rows for c in r["tool_calls"])),
        "multi_turn/invalid_actions": float(sum(r["invalid"] for r in rows)),
        "multi_turn/tool_response_truncated": float(sum(r["tool_truncated"] for r in rows)),
        "multi_turn/answered": sum(r["answered"] for r in rows) / len(rows),
        "multi_turn/tool_token_share": float((attention.sum() - mask.sum()) / attention.sum().clamp(min=1)),
    }
