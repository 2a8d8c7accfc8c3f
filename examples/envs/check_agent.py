"""An agent program trained through tearless's OpenAI-compatible endpoint: two calls, one tool.

The agent asks the model the row's question, runs its tool (``check``: is the answer the sum?) on
the reply, tells the model the verdict and asks again. Each right reply earns 0.5; the episode is
solved when either is right. Any program written against the ``openai`` client works the same way.

    tearless train actor_rollout_ref.rollout.multi_turn.enable=true data.max_response_length=40 \
        actor_rollout_ref.rollout.multi_turn.agent=examples/envs/check_agent.py:agent
"""

from __future__ import annotations

import openai


def final_answer(reply: str) -> str:
    """The reply's final answer: what follows its last comma (the embedded task's answers work
    their carries out first: ``3+8=11, 52``)."""
    return reply.rsplit(",", 1)[-1].strip()


def check(answer: str, expected: str) -> str:
    """The agent's tool: the verdict it sends back to the model."""
    return "yes" if final_answer(answer) == expected.strip() else "no"


def agent(base_url: str, row: dict) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(row["prompt"])
    first = client.chat.completions.create(model="policy", messages=messages)
    answer = first.choices[0].message.content or ""
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": check(answer, row["ground_truth"])},
    ]
    second = client.chat.completions.create(model="policy", messages=messages)
    right = [
        check(reply, row["ground_truth"]) == "yes"
        for reply in (answer, second.choices[0].message.content or "")
    ]
    return {"score": 0.5 * sum(right), "success": any(right)}
