"""An LLM judge as the reward: each response is scored by a chat model behind an OpenAI-compatible
``/chat/completions`` endpoint (vLLM's server, a hosted API, tearless's own endpoint).

The request for a sample is the ``reward_model.judge.prompt_template`` with ``{prompt}``, ``{response}``
and ``{ground_truth}`` filled in, sent as one user message with the judge's ``model``, ``temperature``
and ``max_tokens``. The reply's text becomes a score by the parser:

- ``number``: the first number in the reply, which must lie in ``score_range`` [lo, hi]; the score is
  (x − lo) / (hi − lo), in [0, 1] (a judge asked for "0 to 10" that answers "7" scores 0.7);
- ``last_number``: the same with the reply's last number (a judge that reasons before its verdict);
- ``labels``: the label of ``labels`` (a map label → score) found first in the reply, as a whole word,
  case-insensitively ("incorrect" is not read as "correct").

Calls run ``max_concurrency`` at a time; ``timeout_s`` bounds each socket operation of a call (the
connect, each read), not the whole reply. A refused or dropped connection, a timeout, a reply cut
short or not HTTP, HTTP 429 or a 5xx answer is retried ``max_retries`` times after ``backoff_s``,
2·``backoff_s``, 4·``backoff_s``, … seconds; other HTTP errors are not retried. A sample whose call
failed, or whose reply the parser cannot read, gets ``reward_model.failure_score`` and is counted in
``reward/failures`` like any scorer error. ``max_failures`` failed samples in a row (in the order
they finish, across batches: the judge is down, or answers what the parser cannot read) stop the
judge at once: no request is sent after that, the samples not yet judged fail as "not sent", and the
run stops with one line naming the key; a batch of many samples against a dead judge so costs about
one sample's retries, not the batch's. :meth:`Judge.close` stops it the same way, ending the
back-off waits of calls in flight. Scores are kept in a cache of the ``cache_size`` most recently
used requests, keyed by the request's exact JSON, so a response judged once (the same prompt,
response and settings) is not sent again; failures are not cached.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import string
import threading
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

FIELDS = ("prompt", "response", "ground_truth")
PARSERS = ("number", "last_number", "labels")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")
_RETRIED_HTTP = (429, 500, 502, 503, 504)


class JudgeError(Exception):
    """One sample's judging failed; the message says why."""


class NotSent(JudgeError):
    """A sample left unjudged because the judge was stopped (down, or closed)."""


def template_fields(template: str) -> list[str]:
    """The ``{field}`` names of a template (``{{`` and ``}}`` are literal braces).

    ValueError for a lone brace, and for a field with a format spec (``{response:d}``) or a
    conversion (``{response!r}``): the fields are strings filled in as they are.
    """
    names = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if spec:
            raise ValueError(f"{{{name}:{spec}}} has a format spec")
        if conversion:
            raise ValueError(f"{{{name}!{conversion}}} has a conversion")
        names.append(name)
    return names


def prompt_text(prompt: str | Sequence[dict]) -> str:
    """A sample's prompt for ``{prompt}``: the string itself, the content of a single message, or
    ``"role: content"`` lines of a conversation."""
    if isinstance(prompt, str):
        return prompt
    messages = list(prompt)
    if len(messages) == 1:
        return str(messages[0]["content"])
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def parse_score(
    reply: str, *, parser: str, score_range: Sequence[float] = (0.0, 10.0), labels: dict | None = None
) -> float:
    """The score of a judge's reply (see the module docstring); :class:`JudgeError` when it has none."""
    if parser in ("number", "last_number"):
        lo, hi = float(score_range[0]), float(score_range[1])
        numbers = _NUMBER.findall(reply)
        if not numbers:
            raise JudgeError(f"the judge's reply has no number: {reply[:80]!r}")
        value = float(numbers[0] if parser == "number" else numbers[-1])
        if not lo <= value <= hi:
            raise JudgeError(f"the judge's number {value:g} is outside score_range [{lo:g}, {hi:g}]")
        return (value - lo) / (hi - lo)
    found = []
    for label, score in (labels or {}).items():
        match = re.search(rf"(?<!\w){re.escape(str(label))}(?!\w)", reply, re.IGNORECASE)
        if match:
            found.append((match.start(), -len(str(label)), float(score)))
    if not found:
        raise JudgeError(f"the judge's reply has none of the labels {sorted(labels or {})}: {reply[:80]!r}")
    return min(found)[2]


class Judge:
    """Scores (prompt, response, ground truth) triples through an OpenAI-compatible endpoint.

    Args mirror ``reward_model.judge`` (see :class:`~tearless.config.schema.JudgeConfig`);
    ``max_failures=None`` never stops. ``sleep`` is the back-off's wait (by default a wait on the
    judge's stop, which :meth:`close` and ``max_failures`` end early).
    """

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        prompt_template: str,
        parser: str = "number",
        score_range: Sequence[float] = (0.0, 10.0),
        labels: dict | None = None,
        api_key_env: str | None = "OPENAI_API_KEY",
        temperature: float = 0.0,
        max_tokens: int = 16,
        max_concurrency: int = 8,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_failures: int | None = None,
        cache_size: int = 100_000,
        sleep: Callable[[float], object] | None = None,
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.template = model, prompt_template
        self.parse = {"parser": parser, "score_range": tuple(score_range), "labels": dict(labels or {})}
        key = os.environ.get(api_key_env) if api_key_env else None
        self.headers = {
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {key}"} if key else {}),
        }
        self.temperature, self.max_tokens = temperature, max_tokens
        self.max_concurrency, self.timeout_s = max_concurrency, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.max_failures, self.cache_size = max_failures, cache_size
        self.cache: OrderedDict[str, float] = OrderedDict()  # least recently used first
        self.requests_sent = 0  # HTTP requests, retries included
        self.failures_in_a_row = 0  # samples, in the order they finished
        self.down: JudgeError | None = None  # the failure that made max_failures in a row
        self._stopped = threading.Event()
        self.sleep = self._stopped.wait if sleep is None else sleep
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop: calls in flight end at their next back-off or retry, nothing more is sent."""
        self._stopped.set()

    def _check_stop(self) -> None:
        if self._stopped.is_set():
            if self.down is not None:
                raise NotSent(f"not sent: judge down after {self.max_failures} failures in a row")
            raise NotSent("not sent: the judge was closed")

    def request(self, prompt: Any, response: str, ground_truth: Any) -> dict:
        """The chat-completion request body of one sample."""
        values = {"prompt": prompt_text(prompt), "response": response, "ground_truth": str(ground_truth)}
        content = self.template.format(**values)
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }

    def _post(self, body: bytes) -> str:
        """The reply's text, retried as the module docstring says; :class:`JudgeError` when it fails."""
        why = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.sleep(self.backoff_s * 2 ** (attempt - 1))
            self._check_stop()
            with self._lock:
                self.requests_sent += 1
            try:
                req = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout_s) as answer:
                    reply = json.loads(answer.read())
                return str(reply["choices"][0]["message"].get("content") or "")
            except urllib.error.HTTPError as e:
                why = f"HTTP {e.code} from {self.url}: {error_body(e)}"
                if e.code not in _RETRIED_HTTP:
                    break
            except (OSError, http.client.HTTPException) as e:
                # OSError: refused, reset, timed out (URLError wraps these as its reason);
                # HTTPException: a reply cut short (IncompleteRead) or not HTTP (BadStatusLine)
                reason = getattr(e, "reason", e)
                if isinstance(reason, TimeoutError):
                    why = f"the request to {self.url} timed out after timeout_s={self.timeout_s:g}"
                else:
                    detail = reason if isinstance(reason, (str, OSError)) else repr(reason)
                    why = f"the request to {self.url} failed ({detail})"
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise JudgeError(
                    f"{self.url} answered something that is not a chat completion ({e})"
                ) from None
        tries = f" ({self.max_retries} retries)" if self.max_retries else ""
        raise JudgeError(why + tries)

    def judge(self, prompt: Any, response: str, ground_truth: Any) -> float:
        """One sample's score, from the cache when the same request was judged before."""
        body = json.dumps(self.request(prompt, response, ground_truth), sort_keys=True).encode()
        key = hashlib.sha256(body).hexdigest()
        with self._lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        score = parse_score(self._post(body), **self.parse)
        self._count(None)  # only a call counts: a cached score says nothing of the judge now
        with self._lock:
            if self.cache_size > 0:
                self.cache[key] = score
                self.cache.move_to_end(key)
                while len(self.cache) > self.cache_size:
                    self.cache.popitem(last=False)
        return score

    def _count(self, error: JudgeError | None) -> None:
        """Count a finished sample (``error`` None: judged) towards ``max_failures`` in a row."""
        with self._lock:
            if error is None:
                self.failures_in_a_row = 0
                return
            self.failures_in_a_row += 1
            if self.down is None and self.max_failures and self.failures_in_a_row >= self.max_failures:
                self.down = error
                self._stopped.set()

    def score(self, items: Sequence[dict]) -> list[float | JudgeError]:
        """Each item's score (or its :class:`JudgeError`), ``max_concurrency`` calls at a time."""

        def one(item: dict) -> float | JudgeError:
            try:
                return self.judge(item["prompt"], item["solution_str"], item["ground_truth"])
            except NotSent as e:
                return e
            except JudgeError as e:
                self._count(e)
                return e

        with ThreadPoolExecutor(
            max_workers=self.max_concurrency, thread_name_prefix="tearless-judge"
        ) as pool:
            return list(pool.map(one, items))


def error_body(error: urllib.error.HTTPError) -> str:
    """The start of an HTTP error's body, or "" when reading it fails too (a server that hangs up)."""
    try:
        return error.read()[:200].decode(errors="replace")
    except (OSError, http.client.HTTPException):
        return ""
