"""Built-in environments.

``tools``: the tool loop as an environment. The model calls the tools of a tool YAML
(:func:`tearless.tools.load_tools`) with its chat template's own tool-call syntax; the calls of a
turn run concurrently (:func:`tearless.tools.run_calls`: a failing or hanging tool is an error
message for the model) and come back as ``role: tool`` messages; a turn without a call is the answer,
scored by the built-in dispatcher on ``data_source`` (:func:`tearless.rewards.compute_score`), and
the episode ends. A call that does not parse gets a ``user`` message naming the problem.
"""

from __future__ import annotations

import json
from typing import Any

from tearless.envs.base import Messages, Step, register_env
from tearless.rewards import compute_score
from tearless.tools import ToolCall, function_schema, load_tools, run_calls


@register_env("tools")
class ToolEnv:
    def __init__(
        self, tool_config_path: str, tool_timeout_s: float = 30.0, max_parallel_calls: int = 8
    ) -> None:
        self._tools = load_tools(tool_config_path)
        self.tools = [function_schema(t) for t in self._tools.values()]
        self.timeout_s, self.max_parallel = tool_timeout_s, max_parallel_calls
        self.row: dict[str, Any] = {}

    def reset(self, row: dict[str, Any]) -> Messages:
        self.row = row
        return list(row["prompt"])

    def step(self, turn: dict[str, Any]) -> Step:
        if turn.get("tool_call_problem"):
            return Step([{"role": "user", "content": f"Invalid tool call: {turn['tool_call_problem']}."}])
        calls = turn.get("tool_calls") or []
        if not calls:
            r = self.row
            result = compute_score(r["data_source"], turn["content"], r["ground_truth"], r["extra_info"])
            score = float(result["score"] if isinstance(result, dict) else result)
            return Step(reward=score, done=True, info={"success": score >= 1.0})
        parsed = [ToolCall(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        results = run_calls(parsed, self._tools, max_parallel=self.max_parallel, timeout_s=self.timeout_s)
        return Step(
            [
                {"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"], "content": res.text}
                for c, res in zip(calls, results, strict=True)
            ]
        )
