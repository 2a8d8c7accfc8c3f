"""Training agent programs: each episode runs the user's agent against the endpoint, and the calls it
made become the training sample.

An agent is ``agent(base_url, row) -> reward`` (plain or ``async``; the reward a float or a dict
with ``score`` and optionally ``success``): it talks to ``base_url`` with the ``openai`` client, makes
any number of calls (with ``tools``, several conversations, sub-agents), runs its own tools and
returns the episode's reward. Each episode gets its own session of one shared
:class:`~tearless.envs.endpoint.Endpoint` (started with the first batch, kept for the run). Episodes
run concurrently, at most ``max_parallel_calls`` at once, each within ``env_timeout_s``; an agent that
raises, hangs or makes no call fails its episode (reward 0, nothing trained on it, counted and listed
like an environment's failure). The trained sample of an episode is its merged trajectory: the chain
of calls ending at the last one (:meth:`~tearless.envs.endpoint.Session.samples`); calls outside that
chain (a second conversation) are recorded but not trained on, counted in
``reward_extra/agent_unmerged_calls/mean``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from tearless.envs.base import load_object
from tearless.envs.contain import Outcome, run_contained
from tearless.envs.endpoint import Endpoint, Session
from tearless.envs.loop import env_scores, episode_row
from tearless.rollout.agent import AgentSettings
from tearless.rollout.engine import RolloutOutput
from tearless.rollout.multiturn import AgentRollout, RewardingLoop, Scores, agent_metrics, pack
from tearless.rollout.toolcalls import detect_family


def load_agent(spec: str) -> Callable[..., Any]:
    """The agent function ``spec`` names (``pkg.module:fn`` or ``file.py:fn``)."""
    fn = load_object(spec, "actor_rollout_ref.rollout.multi_turn.agent")
    if not callable(fn):
        raise ValueError(
            f"actor_rollout_ref.rollout.multi_turn.agent={spec!r} is not a function agent(base_url, row)"
        )
    return fn


def _reward(value: Any) -> tuple[float, bool | None]:
    if isinstance(value, dict):
        success = value.get("success")
        return float(value["score"]), None if success is None else bool(success)
    return float(value), None


class ProgramLoop(RewardingLoop):
    """Generates episodes by running an agent program per episode (see the module docstring); a
    :class:`~tearless.rollout.multiturn.RewardingLoop`: the agents own the reward."""

    owns_reward = True

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        agent: Callable[..., Any],
        settings: AgentSettings,
        *,
        timeout_s: float = 60.0,
        tool_family: str | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.agent, self.settings = engine, tokenizer, agent, settings
        self.timeout_s = timeout_s
        self.family = tool_family or detect_family(getattr(tokenizer, "chat_template", None))
        self.endpoint: Endpoint | None = None

    def trajectories(
        self, items: list[dict], n: int, keys: list[int], limit: int, sampling: dict[str, Any]
    ) -> AgentRollout:
        """``n`` episodes per item, each at most ``limit`` response tokens
        (:meth:`~tearless.rollout.multiturn.MultiTurnLoop.trajectories`); an episode's session seeds its
        call c with ``mix(key, c)``."""
        if self.endpoint is None:
            self.endpoint = Endpoint(self.engine, self.tokenizer, family=self.family)
        expanded = [it for it in items for _ in range(n)]
        sids = [self.endpoint.open_session(k, limit, sampling) for k in keys]
        rows = [episode_row(it) for it in expanded]
        calls = [
            self._episode(self.endpoint.session_url(sid), row) for sid, row in zip(sids, rows, strict=True)
        ]
        loop = asyncio.new_event_loop()
        try:
            outcomes = run_contained(
                loop,
                calls,
                max_parallel=self.settings.max_parallel_calls,
                timeout_s=self.timeout_s,
                what="the agent",
            )
        finally:
            loop.close()
        sessions = [self.endpoint.close_session(sid) for sid in sids]
        return self._assemble(expanded, sessions, outcomes)

    def _episode(self, url: str, row: dict) -> Callable[[], Any]:
        if inspect.iscoroutinefunction(self.agent):

            async def run() -> Any:
                return await self.agent(url, row)

            return run
        return lambda: self.agent(url, row)

    def _assemble(self, items: list[dict], sessions: list[Session], outcomes: list[Outcome]) -> AgentRollout:
        pad = self.engine.pad_token_id
        eos = min(self.engine.eos.tolist())
        prompts, responses, info = [], [], []
        for it, session, outcome in zip(items, sessions, outcomes, strict=True):
            error, reward, success = outcome.error, 0.0, None
            if error is None:
                try:
                    reward, success = _reward(outcome.value)
                except (TypeError, ValueError, KeyError) as e:
                    error = f"the agent returned {outcome.value!r}, not a float or {{'score': float}} ({e})"
            if error is None and not session.calls:
                error = "the agent made no call to the endpoint"
            samples = session.samples("trajectory") if error is None else []
            if samples:
                s = samples[0]
                prompts.append(s.prompt)
                responses.append((s.ids, s.mask, s.logps))
            else:
                prompts.append(list(it.get("input_ids") or [pad]))
                responses.append(([eos], [0], [0.0]))
                reward = 0.0
            info.append(
                {
                    "tool_calls": [],
                    "num_turns": len(session.calls),
                    "answered": error is None,
                    "invalid": 0,
                    "tool_truncated": 0,
                    "env_rewards": [reward],
                    "env_reward": reward,
                    "env_success": success,
                    "env_error": error,
                    "env_timeout": outcome.timed_out,
                    "env_traceback": outcome.traceback,
                    "calls": len(session.calls),
                    "merged_calls": self._chain_length(session) if error is None else 0,
                }
            )
        out = pack(prompts, responses, [False] * len(responses), pad)
        return AgentRollout(out, info, agent_metrics(info, out.response_mask, out.response_attention_mask))

    @staticmethod
    def _chain_length(session: Session) -> int:
        n, i = 0, len(session.calls) - 1
        while i is not None:
            n, i = n + 1, session.calls[i].parent
        return n

    def score(self, tokenizer: Any, out: RolloutOutput, info: list[dict]) -> Scores:
        """As :meth:`tearless.envs.loop.EnvLoop.score`, plus ``agent_unmerged_calls`` (calls of an
        episode outside its trained trajectory)."""
        scored = env_scores(tokenizer, out, info)
        for extra, r in zip(scored["extras"], info, strict=True):
            extra["agent_unmerged_calls"] = (
                float(r["calls"] - r["merged_calls"]) if r["env_error"] is None else 0.0
            )
        return scored
