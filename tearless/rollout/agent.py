"""The multi-turn agent loop: the model calls tools mid-answer and only its own tokens are trained.

For each sample the loop generates until a stop tag or EOS; if the turn holds a tool call it runs the
tool (all calls of a turn, across the batch, concurrently: :func:`tearless.tools.run_calls`), appends
the result as tokens and lets the model continue. The turns are driven by the one turn loop
(:meth:`tearless.rollout.multiturn.TurnLoop.run_turns`); :meth:`AgentLoop.respond` is this loop's
answer to a turn. The whole trajectory is one token sequence:

    prompt | model turn 1 | tool output 1 | model turn 2 | … | final model turn
    loss mask:    1…1     |     0…0       |     1…1      | … |       1…1

``RolloutOutput.response_mask`` is that loss mask (used by the policy loss, the KL terms, the entropy
and the advantage estimators); ``response_attention_mask`` is 1 on every real token, so tool output
is context the model reads. Two call formats (``multi_turn.format``):

- ``search_r1``: ``<search>query</search>`` (one tag per tool, named after it; the text fills the
  tool's first string argument) → ``<information>result</information>``; ``<answer>…</answer>`` ends.
- ``hermes``: the prompt is rendered with the chat template's ``tools``; the model writes
  ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` (several per turn allowed) and ends its turn
  with EOS; results come back as ``tool`` messages rendered by the chat template. A turn without a
  call is the final answer.

Turn budget: turns 1 … ``max_assistant_turns`` − 1 may call tools, at most ``max_user_turns`` tool (or
correction) turns are appended, and the turn after the budget runs out is the forced final turn: its
calls are not executed and the trajectory ends (Search-R1's last generation with search disabled). An
invalid action (a stop tag without its opening tag, an empty query, JSON that does not parse) gets
``invalid_action_message`` (masked, like tool output) and the model tries again. Tool output is cut
to ``max_tool_response_length`` tokens on ``tool_response_truncate_side``; the whole response (model
and tool tokens) to the rollout's response length.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from tearless.rollout.engine import RolloutEngine
from tearless.rollout.multiturn import (
    AgentRollout,
    MultiTurnLoop,
    Reply,
    TokenTrajectory,
    Turn,
    TurnLoop,
    agent_metrics,
    cut_tokens,
    pack,
)
from tearless.rollout.toolcalls import tag_blocks, too_many_calls
from tearless.tools import ToolCall, ToolLike, function_schema, run_calls
from tearless.tools.base import first_string_parameter

FORMATS = ("search_r1", "hermes")
TRUNCATE_SIDES = ("left", "right", "middle")


@dataclass(frozen=True)
class AgentSettings:
    """The ``actor_rollout_ref.rollout.multi_turn`` settings the loop uses (see the config schema)."""

    format: str = "search_r1"
    max_assistant_turns: int = 4
    max_user_turns: int = 4
    max_parallel_calls: int = 8
    max_tool_calls_per_turn: int = 16
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_timeout_s: float = 30.0
    invalid_action_message: str = "Invalid action: call a tool or give the final answer."

    @classmethod
    def from_config(cls, mt: Any) -> AgentSettings:
        return cls(**{f: getattr(mt, f) for f in cls.__dataclass_fields__})


@dataclass
class Action:
    """What a model turn asked for: ``answer`` (done), ``calls`` or ``invalid`` (with the reason)."""

    kind: str
    calls: list[ToolCall] = field(default_factory=list)
    problem: str = ""


@dataclass
class _Unparsed:
    why: str


def _loads(text: str) -> Any:
    """``json.loads(text)``, or :class:`_Unparsed` saying why not. Model output is untrusted: besides
    ``JSONDecodeError``, ``json`` raises ``ValueError`` for an integer literal over 4,300 digits and
    ``RecursionError`` for deep nesting, and none of them may end the rollout."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return _Unparsed(e.msg)
    except ValueError:
        return _Unparsed("a number too long to read")
    except RecursionError:
        return _Unparsed("nested too deeply")


class SearchR1Format:
    """Tag calls (``<search>q</search>``), results in ``<information>…</information>``."""

    eos_ends_trajectory = True  # EOS without an answer: the model gave up

    def __init__(self, tools: dict[str, ToolLike], tokenizer: Any, settings: AgentSettings) -> None:
        self.tokenizer, self.settings = tokenizer, settings
        self.argument = {}
        for name, tool in tools.items():
            key = first_string_parameter(tool.parameters)
            if key is None:
                raise ValueError(
                    f"tool {name!r} has no string argument, so multi_turn.format=search_r1 cannot call it "
                    "as <name>text</name>; use multi_turn.format=hermes"
                )
            self.argument[name] = key
        names = "|".join(["answer", *map(re.escape, tools)])
        self.opening = re.compile(rf"<({names})>")
        self.stops = [f"</{name}>" for name in tools] + ["</answer>"]

    def prompt_ids(self, item: dict) -> list[int]:
        return list(item["input_ids"])

    def parse(self, text: str) -> Action:
        found = self._first_block(text)
        if found is None:
            return Action("invalid", problem="no <tool>...</tool> call and no <answer>...</answer>")
        tag, content = found[0], found[1].strip()
        if tag == "answer":
            return Action("answer")
        if not content:
            return Action("invalid", problem=f"empty <{tag}></{tag}>")
        return Action("calls", [ToolCall(tag, {self.argument[tag]: content})])

    def _first_block(self, text: str) -> tuple[str, str] | None:
        """The tag and content of the first ``<tag>…</tag>`` (the lazy regex ``<(tags)>(.*?)</\\1>``'s
        match) in O(len(text)): per tag, the next closing tag is searched for again only once an
        opening tag lies past it, so thousands of unterminated tags cost one pass, not one each."""
        next_close: dict[str, int] = {}
        for match in self.opening.finditer(text):
            tag = match.group(1)
            at = next_close.get(tag, -2)
            if at != -1 and at < match.end():
                at = next_close[tag] = text.find(f"</{tag}>", match.end())
            if at >= 0:
                return tag, text[match.end() : at]
        return None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def result_tokens(self, results: list[str]) -> list[int]:
        s = self.settings
        body = self._encode("\n".join(results))
        body = cut_tokens(body, s.max_tool_response_length, s.tool_response_truncate_side)
        return self._encode("<information>") + body + self._encode("</information>")

    def correction_tokens(self, problem: str) -> list[int]:
        return self._encode(f"\n{self.settings.invalid_action_message} ({problem})\n")


class HermesFormat:
    """Chat-template tool calls: ``<tool_call>{json}</tool_call>``, results as ``tool`` messages."""

    stops: list[str] = []  # noqa: RUF012  (the turn ends at EOS)
    eos_ends_trajectory = False  # every turn ends with EOS; a turn without a call ends the trajectory

    def __init__(self, tools: dict[str, ToolLike], tokenizer: Any, settings: AgentSettings) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("multi_turn.format=hermes needs a tokenizer with a chat template")
        self.tokenizer, self.settings = tokenizer, settings
        self.schemas = [function_schema(t) for t in tools.values()]
        # The text a tool turn adds after the assistant's EOS: rendered once with a placeholder.
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        before = tokenizer.apply_chat_template(base, tokenize=False)
        eos = tokenizer.eos_token
        cut = before.rfind(eos) + len(eos) if eos and eos in before else len(before)
        self._prefix_len = cut
        self._base = base

    def prompt_ids(self, item: dict) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            list(item["raw_prompt"]),
            tools=self.schemas,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return list(ids)

    def parse(self, text: str) -> Action:
        limit = self.settings.max_tool_calls_per_turn
        spans = tag_blocks(text, "<tool_call>", "</tool_call>", limit)
        if not spans:
            return Action("answer")
        if len(spans) > limit:
            return Action(
                "invalid", problem=f"{too_many_calls(limit)} (multi_turn.max_tool_calls_per_turn={limit})"
            )
        calls = []
        for block in (text[start:end] for start, end in spans):
            call = _loads(block)
            if isinstance(call, _Unparsed):
                return Action("invalid", problem=f"tool call is not valid JSON ({call.why})")
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return Action("invalid", problem='a tool call needs {"name": ..., "arguments": {...}}')
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):
                arguments = _loads(arguments)
                if isinstance(arguments, _Unparsed):
                    return Action("invalid", problem=f"arguments are not valid JSON ({arguments.why})")
            if not isinstance(arguments, dict):
                return Action("invalid", problem='"arguments" must be a JSON object {"name": value, ...}')
            calls.append(ToolCall(call["name"], arguments))
        return Action("calls", calls)

    def _messages_tokens(self, contents: list[str]) -> list[int]:
        messages = [*self._base, *({"role": "tool", "content": c} for c in contents)]
        full = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(full[self._prefix_len :], add_special_tokens=False))

    def result_tokens(self, results: list[str]) -> list[int]:
        s = self.settings
        contents = []
        for text in results:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            cut = cut_tokens(ids, s.max_tool_response_length, s.tool_response_truncate_side)
            contents.append(text if cut == ids else self.tokenizer.decode(cut))
        return self._messages_tokens(contents)

    def correction_tokens(self, problem: str) -> list[int]:
        return self._messages_tokens([f"{self.settings.invalid_action_message} ({problem})"])


@dataclass(kw_only=True)
class _Trajectory(TokenTrajectory):
    answered: bool = False
    invalid: int = 0
    tool_truncated: int = 0
    calls: list[dict] = field(default_factory=list)


class AgentLoop(TurnLoop, MultiTurnLoop):
    """Multi-turn generation over a rollout engine whose capabilities include ``multi_turn`` (see the
    module docstring); a :class:`~tearless.rollout.multiturn.MultiTurnLoop` whose trajectories the
    run's reward manager scores, and a :class:`~tearless.rollout.multiturn.TurnLoop` that answers a turn
    by parsing it and running its tool calls."""

    owns_reward = False

    def __init__(
        self, engine: RolloutEngine, tokenizer: Any, tools: dict[str, ToolLike], settings: AgentSettings
    ) -> None:
        if settings.format not in FORMATS:
            raise ValueError(f"multi_turn.format={settings.format!r} is not one of {', '.join(FORMATS)}")
        self.engine, self.tokenizer, self.tools, self.settings = engine, tokenizer, tools, settings
        fmt_cls = SearchR1Format if settings.format == "search_r1" else HermesFormat
        self.fmt = fmt_cls(tools, tokenizer, settings)
        self.stops = [list(tokenizer.encode(s, add_special_tokens=False)) for s in self.fmt.stops]
        self.eos = set(engine.eos.tolist())

    def trajectories(
        self, items: list[dict], n: int, keys: list[int], limit: int, sampling: dict[str, Any]
    ) -> AgentRollout:
        """``n`` trajectories per item, model and tool tokens together at most ``limit``
        (:meth:`~tearless.rollout.multiturn.MultiTurnLoop.trajectories`); ``sampling`` and the format's
        stop sequences go to the engine."""
        prompts = [self.fmt.prompt_ids(it) for it in items]
        rows = [
            _Trajectory(prompt=list(p), key=k)
            for p, k in zip([p for p in prompts for _ in range(n)], keys, strict=True)
        ]
        self.run_turns(rows, limit, {"stop_sequences": self.stops, **sampling})
        return self._assemble(rows)

    def respond(self, active: list[_Trajectory], turns: list[Turn]) -> list[Reply]:
        """A turn that answers (or, in ``search_r1``, gives up with EOS) ends its trajectory; one that
        filled the budget ends it truncated; the last turn (the model's or the tools') ends it without
        running its calls; otherwise the turn's calls run, every trajectory's in one pool
        (:meth:`_run_calls`), and their result tokens follow, or an invalid action's correction."""
        replies: dict[int, Reply] = {}
        pending: list[tuple[int, _Trajectory, list[ToolCall]]] = []
        for j, (r, turn) in enumerate(zip(active, turns, strict=True)):
            action = self.parse(self.tokenizer.decode(turn.ids, skip_special_tokens=True))
            gave_up = self.fmt.eos_ends_trajectory and bool(turn.ids) and turn.ids[-1] in self.eos
            if action.kind == "answer" or gave_up:
                r.answered = action.kind == "answer"
                replies[j] = Reply(done=True)
            elif turn.final:  # out of budget, or the forced final turn: its calls are not run
                replies[j] = Reply(done=True, truncated=turn.full)
            elif action.kind == "calls":
                pending.append((j, r, action.calls))
            else:
                r.invalid += 1
                replies[j] = Reply(self.fmt.correction_tokens(action.problem))
        results = self._run_calls([(r, calls) for _, r, calls in pending])
        for (j, _, _), tokens in zip(pending, results, strict=True):
            replies[j] = Reply(tokens)
        return [replies[j] for j in range(len(active))]

    def parse(self, text: str) -> Action:
        """The action of a model turn; total: a parser failure the formats did not foresee is an
        invalid action for the model (naming the error), never an exception that ends the run."""
        try:
            return self.fmt.parse(text)
        except Exception as e:  # model output is untrusted input: no output may stop training
            return Action("invalid", problem=f"the turn could not be read ({type(e).__name__})")

    def _run_calls(self, pending: list[tuple[_Trajectory, list[ToolCall]]]) -> list[list[int]]:
        """Every pending trajectory's calls of this turn in one pool (at most ``max_parallel_calls`` at
        once), recorded on their trajectories; each trajectory's result tokens."""
        s = self.settings
        flat = [c for _, calls in pending for c in calls]
        results = iter(
            run_calls(flat, self.tools, max_parallel=s.max_parallel_calls, timeout_s=s.tool_timeout_s)
        )
        tokens = []
        for r, calls in pending:
            texts = []
            for call in calls:
                res = next(results)
                texts.append(res.text)
                r.calls.append(
                    {"name": call.name, "arguments": call.arguments, "result": res.text, "error": res.error}
                )
                n_tokens = len(self.tokenizer.encode(res.text, add_special_tokens=False))
                r.tool_truncated += n_tokens > s.max_tool_response_length
            tokens.append(self.fmt.result_tokens(texts))
        return tokens

    def _assemble(self, rows: list[_Trajectory]) -> AgentRollout:
        pad = self.engine.pad_token_id
        out = pack(
            [r.prompt for r in rows],
            [(r.ids, r.mask, r.logps) for r in rows],
            [r.truncated for r in rows],
            pad,
        )
        info = [
            {
                "tool_calls": r.calls,
                "num_turns": r.turns,
                "answered": r.answered,
                "invalid": r.invalid,
                "tool_truncated": r.tool_truncated,
            }
            for r in rows
        ]
        return AgentRollout(out, info, agent_metrics(info, out.response_mask, out.response_attention_mask))
