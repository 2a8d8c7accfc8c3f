"""Chat messages to token ids through the model's own chat template, token-in, token-out.

The prompt of an episode is rendered once. After that, the trajectory grows only by appending: the
tokens the model generated (kept exactly as sampled, never decoded and re-encoded) and, after a
turn that ended with EOS, the tokens the template inserts for the next messages. Those are found as
a suffix: the template renders a placeholder conversation ``[user "u", assistant "a"]`` up to the
assistant's end-of-turn token, then the same conversation followed by the new messages and the
generation prompt; the new text is the difference, and only it is encoded. Re-rendering the whole
conversation instead could tokenize the model's own text differently (a BPE merge across what were
two sampled tokens, a template that normalises whitespace or re-serialises tool-call JSON), so the
tokens trained on would not be the tokens sampled.
"""

from __future__ import annotations

from typing import Any

from tearless.rollout.multiturn import cut_tokens

_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class ChatRenderer:
    """Renders prompts and the template's tokens between turns for one tokenizer and tool list."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("environments and the agent endpoint need a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.tools = tools or None
        before = self._text(_BASE, generation_prompt=False)
        eos = tokenizer.eos_token
        self._prefix_len = before.rfind(eos) + len(eos) if eos and eos in before else len(before)

    def _text(self, messages: list[dict], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[dict]) -> list[int]:
        """The first prompt: ``messages`` rendered with the tools and the generation prompt."""
        ids = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    def after_turn(
        self, messages: list[dict], *, max_content_tokens: int | None = None, side: str = "middle"
    ) -> list[int]:
        """The tokens the template adds after an assistant turn that ended with its EOS token, for
        ``messages`` followed by the next generation prompt. Each message's content is first cut
        to ``max_content_tokens`` tokens (on ``side``)."""
        if max_content_tokens is not None:
            messages = [self._cut(m, max_content_tokens, side) for m in messages]
        full = self._text([*_BASE, *messages], generation_prompt=True)
        return self.encode(full[self._prefix_len :])

    def _cut(self, message: dict, limit: int, side: str) -> dict:
        content = message.get("content")
        if not isinstance(content, str):
            return message
        ids = self.encode(content)
        cut = cut_tokens(ids, limit, side)
        return message if cut == ids else {**message, "content": self.tokenizer.decode(cut)}
