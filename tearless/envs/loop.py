"""Multi-turn episodes against stateful environments, as one token sequence per episode.

For each episode a fresh environment is built (``factory()``), ``reset(row)`` gives the first
observation, rendered with the chat template (and the environment's ``tools``) as the prompt. Then,
turn after turn, the engine generates the model's turn for every active episode at once (a turn ends
at EOS), the turn goes to ``step`` (all episodes' steps concurrently, each with a timeout), and the
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tearless.envs.base import Environment, Messages, Step, as_messages
from tearless.envs.contain import Outcome, run_contained
from tearless.envs.render import ChatRenderer
from tearless.rollout.agent import AgentRollout, AgentSettings, agent_metrics
from tearless.rollout.engine import RolloutOutput, left_pad, right_pad
from tearless.rollout.seeds import mix, sample_keys
from tearless.rollout.toolcalls import detect_family, parse_tool_calls


@dataclass
class Episode:
    """One episode's tokens and bookkeeping; ``ids``/``mask``/``logps`` cover the response."""

    row: dict
    fallback_prompt: list[int]
    env: Any = None
    prompt: list[int] = field(default_factory=list)
    key: int = 0
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    observations: int = 0
    done: bool = False
    finished: bool = False
    truncated: bool = False
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


class EnvLoop:
    """Generates episodes of ``factory``'s environments with an engine (see the module docstring).

    Same call as :class:`~tearless.rollout.agent.AgentLoop`; the environments own the reward
    (``owns_reward``), so the rank scores with :meth:`score` instead of the reward manager."""

    owns_reward = True

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

    def generate(
        self,
        items: list[dict],
        *,
        n: int = 1,
        max_new_tokens: int = 64,
        keys: Sequence[int] | None = None,
        **sampling: Any,
    ) -> AgentRollout:
        """``n`` episodes per item (rows of an item adjacent), each at most ``max_new_tokens`` response
        tokens. Episode j of item i samples turn t with the key ``mix(mix(keys[i], j), t)``."""
        if keys is None:
            keys = torch.randint(0, 2**62, (len(items),)).tolist()
        episodes = [
            Episode(episode_row(it), list(it.get("input_ids") or []), key=k)
            for it, k in zip([it for it in items for _ in range(n)], sample_keys(keys, n), strict=True)
        ]
        loop = asyncio.new_event_loop()
        try:
            self._reset(loop, episodes)
            for turn in range(1, self.settings.max_assistant_turns + 1):
                active = [e for e in episodes if not e.done]
                if not active:
                    break
                self._turn(loop, active, turn, max_new_tokens, sampling)
            self._close(loop, episodes)
        finally:
            loop.close()
        return self._assemble(episodes, items, n)

    def _contained(self, loop, calls: list[Callable[[], Any]], what: str) -> list[Outcome]:
        return run_contained(
            loop,
            calls,
            max_parallel=self.settings.max_parallel_calls,
            timeout_s=self.env_timeout_s,
            what=what,
        )

    def _reset(self, loop, episodes: list[Episode]) -> None:
        def start(e: Episode) -> Callable[[], Any]:
            def build() -> Any:
                e.env = self.factory()
                return e.env

            return build

        for e, out in zip(
            episodes,
            self._contained(loop, [start(e) for e in episodes], "creating the environment"),
            strict=True,
        ):
            if out.error:
                e.fail(out)
        ready = [e for e in episodes if not e.done]
        outs = self._contained(loop, [_call(e.env.reset, e.row) for e in ready], "env.reset")
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

    def _turn(self, loop, active: list[Episode], turn: int, limit: int, sampling: dict) -> None:
        out = self.engine.generate(
            [e.prompt + e.ids for e in active],
            n=1,
            max_new_tokens=max(limit - len(e.ids) for e in active),
            keys=[mix(e.key, turn) for e in active],
            **sampling,
        )
        for j, e in enumerate(active):
            valid = out.response_mask[j].bool()
            room = limit - len(e.ids)
            new = out.response_ids[j][valid].tolist()[:room]
            e.ids += new
            e.mask += [1] * len(new)
            e.logps += out.log_probs[j][valid].tolist()[:room]
            e.turns += 1
            e.truncated = len(e.ids) >= limit and not (new and new[-1] in self.eos)
        turns = [
            self._model_turn(e, out.response_ids[j][out.response_mask[j].bool()].tolist())
            for j, e in enumerate(active)
        ]
        outs = self._contained(
            loop, [_call(e.env.step, t) for e, t in zip(active, turns, strict=True)], "env.step"
        )
        s = self.settings
        for e, t, res in zip(active, turns, outs, strict=True):
            if res.error:
                e.fail(res)
                continue
            step = res.value
            if not isinstance(step, Step):
                e.fail(Outcome(error=f"env.step returned {type(step).__name__}, not tearless.envs.Step"))
                continue
            e.messages.append(t)
            e.rewards.append(float(step.reward))
            if "success" in step.info:
                e.success = bool(step.info["success"])
            if step.done:
                e.done = e.finished = True
            elif (
                e.truncated
                or len(e.ids) >= limit
                or turn == s.max_assistant_turns
                or e.observations >= s.max_user_turns
            ):
                e.done = True
            else:
                try:
                    obs = as_messages(step.observation, "env.step's observation")
                    tokens = self.renderer(getattr(e.env, "tools", None)).after_turn(
                        obs, max_content_tokens=s.max_tool_response_length, side=s.tool_response_truncate_side
                    )
                except Exception as err:  # a bad observation is the environment's failure
                    e.fail(Outcome(error=f"env.step: {type(err).__name__}: {err}"))
                    continue
                e.messages += obs
                self._append_env(e, tokens, limit)

    def _model_turn(self, e: Episode, ids: list[int]) -> dict:
        """The model's turn as an assistant message (tool calls parsed when the env has tools)."""
        while ids and ids[-1] in self.eos:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if not getattr(e.env, "tools", None):
            return {"role": "assistant", "content": text}
        parsed = parse_tool_calls(text, self.family)
        msg = parsed.message()
        if parsed.problem:
            msg["tool_call_problem"] = parsed.problem
        return msg

    @staticmethod
    def _append_env(e: Episode, tokens: list[int], limit: int) -> None:
        e.observations += 1
        room = limit - len(e.ids)
        if len(tokens) >= room:
            tokens = tokens[:room]
            e.done = e.truncated = True
        e.ids += tokens
        e.mask += [0] * len(tokens)
        e.logps += [0.0] * len(tokens)

    def _close(self, loop, episodes: list[Episode]) -> None:
        closing = [e for e in episodes if e.env is not None and callable(getattr(e.env, "close", None))]
        self._contained(loop, [_call(e.env.close) for e in closing], "env.close")

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

    def score(self, tokenizer: Any, out: RolloutOutput, info: list[dict]) -> dict[str, Any]:
        """The rank's scores from the episodes' own rewards, in the form of
        :func:`tearless.workers.scoring.score_responses`: ``scores`` :math:`R = \\sum_t r_t`, ``correct``
        (``info["success"]``, else :math:`R \\ge 1`), ``extras`` ``env_failed``/``env_timeout``/
        ``env_turns``, and the failed episodes' errors grouped by message."""
        return env_scores(tokenizer, out, info)


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


def env_scores(tokenizer: Any, out: RolloutOutput, info: list[dict]) -> dict[str, Any]:
    """See :meth:`EnvLoop.score`."""
    texts = [
        tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
        for ids, m in zip(out.response_ids, out.response_attention_mask, strict=True)
    ]
    scores = [float(r["env_reward"]) for r in info]
    errors: dict[str, list] = {}
    for r in info:
        if r["env_error"] is not None:
            entry = errors.setdefault(r["env_error"], [0, r["env_traceback"] or r["env_error"]])
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
