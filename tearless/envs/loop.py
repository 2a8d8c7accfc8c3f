"""Multi-turn episodes against stateful environments, as one token sequence per episode.

For each episode a fresh environment is built (``factory()``), ``reset(row)`` gives the first
observation, rendered with the chat template (and the environment's ``tools``) as the prompt. Then,
turn after turn (the one turn loop, :meth:`~tearless.rollout.multiturn.TurnLoop.run_turns`), the engine
generates the model's turn for every active episode at once (a turn ends at EOS), the turn goes to
``step`` (all episodes' steps concurrently, each with a timeout: :meth:`EnvLoop.respond`), and the
observation's template tokens are appended (:class:`~tearless.envs.render.ChatRenderer`):

    prompt | model turn 1 | observation 1 | model turn 2 | … | last model turn
    loss mask:    1…1     |     0…0       |     1…1      | … |      1…1

exactly the layout of the tool loop (:mod:`tearless.rollout.agent`), so the policy loss, the KL
terms, the entropy and every advantage estimator see only the model's tokens. The episode's reward
:math:`R = \\sum_t r_t` lands on its last token (the trainer places a sequence score there).

Budgets: ``max_assistant_turns`` model turns, ``max_user_turns`` observations, the response length
(model and environment tokens together); each observation message's content is cut to
``max_tool_response_length`` tokens. An episode that runs out of a budget ends there with the
rewards it has. An environment that raises or passes ``env_timeout_s`` in ``reset`` or ``step`` ends
its episode as failed: reward 0, loss mask 0 on all of it (nothing is trained on it), its error
counted (``reward_extra/env_failed/mean``, ``reward_extra/env_timeout/mean``) and listed with the
run's scoring errors.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tearless.envs.base import Environment, Messages, Step, as_messages
from tearless.envs.contain import Outcome, run_contained
from tearless.envs.render import ChatRenderer
from tearless.rollout.agent import AgentSettings
from tearless.rollout.engine import RolloutOutput
from tearless.rollout.multiturn import (
    AgentRollout,
    Reply,
    RewardingLoop,
    Scores,
    TokenTrajectory,
    Turn,
    TurnLoop,
    agent_metrics,
    pack,
)
from tearless.rollout.toolcalls import detect_family, parse_tool_calls

# The start of a failed episode's error message among a round's reward errors: its sample gets
# reward 0 and a zero loss mask, not reward_model.failure_score (tearless.trainers.reward_errors).
EPISODE_FAILED = "episode failed: "


@dataclass(kw_only=True)
class Episode(TokenTrajectory):
    """One episode's tokens (``user_turns`` counts its observations) and its environment's
    bookkeeping."""

    row: dict
    fallback_prompt: list[int]
    env: Any = None
    rewards: list[float] = field(default_factory=list)
    finished: bool = False
    success: bool | None = None
    error: str | None = None
    timed_out: bool = False
    traceback: str | None = None
    messages: Messages = field(default_factory=list)

    def fail(self, outcome: Outcome) -> None:
        self.done = True
        self.error, self.timed_out, self.traceback = outcome.error, outcome.timed_out, outcome.traceback


def episode_row(item: dict) -> dict:
    """The data row an environment's ``reset`` receives."""
    return {
        "prompt": list(item.get("raw_prompt") or []),
        "data_source": item.get("data_source"),
        "ground_truth": item.get("ground_truth"),
        "extra_info": item.get("extra_info") or {},
    }


def _call(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """A zero-argument callable running ``fn(*args)``, a coroutine function when ``fn`` is one."""
    if inspect.iscoroutinefunction(fn):

        async def run() -> Any:
            return await fn(*args)

        return run
    return lambda: fn(*args)


class EnvLoop(TurnLoop, RewardingLoop):
    """Generates episodes of ``factory``'s environments with an engine (see the module docstring).

    A :class:`~tearless.rollout.multiturn.RewardingLoop`: the environments own the reward
    (``owns_reward``), so the rank scores with :meth:`score` instead of the reward manager; a
    :class:`~tearless.rollout.multiturn.TurnLoop` that answers a turn with the environments' ``step``."""

    owns_reward = True
    # The event loop of the current generate call: an async environment's reset, steps and close
    # share it (one it built in reset may hold loop-bound resources).
    _events: asyncio.AbstractEventLoop

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        factory: Callable[[], Environment],
        settings: AgentSettings,
        *,
        env_timeout_s: float = 60.0,
        tool_family: str | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.factory, self.settings = engine, tokenizer, factory, settings
        self.env_timeout_s = env_timeout_s
        self.family = tool_family or detect_family(getattr(tokenizer, "chat_template", None))
        self.eos = set(engine.eos.tolist())
        self._renderers: dict[str, ChatRenderer] = {}

    def renderer(self, tools: list[dict] | None) -> ChatRenderer:
        key = repr(tools)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(self.tokenizer, tools)
        return self._renderers[key]

    def trajectories(
        self, items: list[dict], n: int, keys: list[int], limit: int, sampling: dict[str, Any]
    ) -> AgentRollout:
        """``n`` episodes per item, each at most ``limit`` response tokens
        (:meth:`~tearless.rollout.multiturn.MultiTurnLoop.trajectories`)."""
        episodes = [
            Episode(row=episode_row(it), fallback_prompt=list(it.get("input_ids") or []), key=k)
            for it, k in zip([it for it in items for _ in range(n)], keys, strict=True)
        ]
        self._events = asyncio.new_event_loop()
        try:
            self._reset(episodes)
            self.run_turns(episodes, limit, sampling)
            self._close(episodes)
        finally:
            self._events.close()
        return self._assemble(episodes, items, n)

    def _contained(self, calls: list[Callable[[], Any]], what: str) -> list[Outcome]:
        return run_contained(
            self._events,
            calls,
            max_parallel=self.settings.max_parallel_calls,
            timeout_s=self.env_timeout_s,
            what=what,
        )

    def _reset(self, episodes: list[Episode]) -> None:
        def start(e: Episode) -> Callable[[], Any]:
            def build() -> Any:
                e.env = self.factory()
                return e.env

            return build

        for e, out in zip(
            episodes,
            self._contained([start(e) for e in episodes], "creating the environment"),
            strict=True,
        ):
            if out.error:
                e.fail(out)
        ready = [e for e in episodes if not e.done]
        outs = self._contained([_call(e.env.reset, e.row) for e in ready], "env.reset")
        for e, out in zip(ready, outs, strict=True):
            if out.error:
                e.fail(out)
                continue
            try:
                e.messages = as_messages(out.value, "env.reset")
                e.prompt = self.renderer(getattr(e.env, "tools", None)).prompt(e.messages)
            except Exception as err:  # a bad observation is the environment's failure, not the run's
                e.fail(Outcome(error=f"env.reset: {type(err).__name__}: {err}"))
        for e in episodes:
            if e.error is not None:  # a failed episode still needs a prompt row: the data row's own
                e.prompt = e.fallback_prompt or [self.engine.pad_token_id]

    def respond(self, active: list[Episode], turns: list[Turn]) -> list[Reply]:
        """Every active episode's ``step`` with its turn, concurrently, each contained
        (:func:`~tearless.envs.contain.run_contained`): a step that says done ends the episode, a final
        turn ends it (its step still earns its reward), otherwise the observation's template tokens
        follow. A turn that fills the budget without EOS is truncated; an environment that fails ends
        its episode as failed."""
        messages = [self._model_turn(e, t.sampled) for e, t in zip(active, turns, strict=True)]
        steps = [_call(e.env.step, m) for e, m in zip(active, messages, strict=True)]
        outs = self._contained(steps, "env.step")
        s = self.settings
        replies = []
        for e, t, m, res in zip(active, turns, messages, outs, strict=True):
            ended = Reply(done=True, truncated=t.full and not (t.ids and t.ids[-1] in self.eos))
            if res.error:
                e.fail(res)
                replies.append(ended)
                continue
            step = res.value
            if not isinstance(step, Step):
                e.fail(Outcome(error=f"env.step returned {type(step).__name__}, not tearless.envs.Step"))
                replies.append(ended)
                continue
            e.messages.append(m)
            e.rewards.append(float(step.reward))
            if "success" in step.info:
                e.success = bool(step.info["success"])
            if step.done or t.final:
                e.finished = step.done
                replies.append(ended)
                continue
            try:
                obs = as_messages(step.observation, "env.step's observation")
                tokens = self.renderer(getattr(e.env, "tools", None)).after_turn(
                    obs, max_content_tokens=s.max_tool_response_length, side=s.tool_response_truncate_side
                )
            except Exception as err:  # a bad observation is the environment's failure
                e.fail(Outcome(error=f"env.step: {type(err).__name__}: {err}"))
                replies.append(ended)
                continue
            e.messages += obs
            replies.append(Reply(tokens))
        return replies

    def _model_turn(self, e: Episode, ids: list[int]) -> dict:
        """The model's turn as an assistant message (tool calls parsed when the env has tools)."""
        while ids and ids[-1] in self.eos:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if not getattr(e.env, "tools", None):
            return {"role": "assistant", "content": text}
        parsed = parse_tool_calls(text, self.family, self.settings.max_tool_calls_per_turn)
        msg = parsed.message()
        if parsed.problem:
            msg["tool_call_problem"] = parsed.problem
        return msg

    def _close(self, episodes: list[Episode]) -> None:
        closing = [e for e in episodes if e.env is not None and callable(getattr(e.env, "close", None))]
        self._contained([_call(e.env.close) for e in closing], "env.close")

    def _assemble(self, episodes: list[Episode], items: list[dict], n: int) -> AgentRollout:
        pad = self.engine.pad_token_id
        for e in episodes:
            if e.error is not None:  # trained on nothing, scored 0: the episode is lost, not the run
                e.ids = e.ids or [min(self.eos)]
                e.mask, e.logps, e.rewards = [0] * len(e.ids), [0.0] * len(e.ids), []
        out = pack(
            [e.prompt for e in episodes],
            [(e.ids, e.mask, e.logps) for e in episodes],
            [e.truncated for e in episodes],
            pad,
        )
        info = [
            {
                "tool_calls": [],
                "num_turns": e.turns,
                "answered": e.finished,
                "invalid": 0,
                "tool_truncated": 0,
                "env_rewards": list(e.rewards),
                "env_reward": sum(e.rewards),
                "env_success": e.success,
                "env_error": e.error,
                "env_timeout": e.timed_out,
                "env_traceback": e.traceback,
                "messages": e.messages,
            }
            for e in episodes
        ]
        return AgentRollout(out, info, agent_metrics(info, out.response_mask, out.response_attention_mask))

    def score(self, tokenizer: Any, out: RolloutOutput, info: list[dict]) -> Scores:
        """The rank's scores from the episodes' own rewards, in the form of
        :func:`tearless.workers.scoring.score_responses`: ``scores`` :math:`R = \\sum_t r_t`, ``correct``
        (``info["success"]``, else :math:`R \\ge 1`), ``extras`` ``env_failed``/``env_timeout``/
        ``env_turns``, and the failed episodes' errors grouped by message."""
        return env_scores(tokenizer, out, info)


def env_scores(tokenizer: Any, out: RolloutOutput, info: list[dict]) -> Scores:
    """See :meth:`EnvLoop.score`."""
    texts = [
        tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
        for ids, m in zip(out.response_ids, out.response_attention_mask, strict=True)
    ]
    scores = [float(r["env_reward"]) for r in info]
    errors: dict[str, list] = {}
    for r in info:
        if r["env_error"] is not None:
            message = EPISODE_FAILED + r["env_error"]
            entry = errors.setdefault(message, [0, r["env_traceback"] or r["env_error"]])
            entry[0] += 1
    return {
        "scores": torch.tensor(scores, dtype=torch.float32),
        "correct": torch.tensor(
            [
                bool(r["env_success"]) if r["env_success"] is not None else s >= 1.0
                for r, s in zip(info, scores, strict=True)
            ]
        ),
        "texts": texts,
        "extras": [
            {
                "env_failed": float(r["env_error"] is not None),
                "env_timeout": float(r["env_timeout"]),
                "env_turns": float(r["num_turns"]),
            }
            for r in info
        ],
        "failures": sum(r["env_error"] is not None for r in info),
        "errors": errors,
        "lost_workers": 0,
    }
