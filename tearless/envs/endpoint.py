"""An OpenAI-compatible ``/v1/chat/completions`` server backed by the rollout engine, recording tokens.

An agent program talks to ``session_url`` with the plain ``openai`` client (``base_url=…``); each
episode has its own session (its own URL path), so calls are attributed without trusting the
client. A request is rendered with the model's chat template (``tools=`` included) and queued; one
engine thread takes all requests queued at that moment and generates them as one batch (the run's
sampling settings, not the request's ``temperature``: the trainer recomputes log-probs at the
rollout temperature, so a different one would make the samples off-policy). Every call records its
prompt ids, the completion ids exactly as sampled and their log-probs.

Token-in, token-out across calls: when a request repeats an earlier call's messages followed by the
assistant message that call returned (same content and tool calls) and that completion ended with
EOS, the new prompt is that call's prompt + completion ids + the template's tokens for the new
messages (:meth:`~tearless.envs.render.ChatRenderer.after_turn`), never a re-rendering of the
returned text; the call is that call's child. A trajectory is a chain of calls; :meth:`Session.samples`
gives one sample per call (``per_call``) or the chain ending at the last call merged into one
sequence (``trajectory``: completions loss-masked 1, everything between them 0).

Not supported: streaming (``stream=true`` is answered 400), ``n`` > 1, per-request sampling settings.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tearless.envs.render import ChatRenderer
from tearless.rollout.seeds import mix
from tearless.rollout.toolcalls import parse_tool_calls


@dataclass
class Call:
    """One recorded call: the request's messages, the assistant message returned, its tokens."""

    messages: list[dict]
    assistant: dict
    prompt_ids: list[int]
    completion_ids: list[int]
    logps: list[float]
    ended_eos: bool
    parent: int | None
    root_len: int  # prompt length of the chain's first call: the merged sample's prompt


@dataclass
class Sample:
    """A training sample: prompt ids, response ids, loss mask and log-probs of the response."""

    prompt: list[int]
    ids: list[int]
    mask: list[int]
    logps: list[float]


def _norm_assistant(msg: dict) -> tuple:
    """What identifies an assistant message: content and calls (name, parsed arguments)."""
    calls = []
    for c in msg.get("tool_calls") or []:
        fn = c.get("function", {})
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return ((msg.get("content") or "").strip(), tuple(calls))


def _norm(messages: list[dict]) -> list[tuple]:
    return [
        (m.get("role"), _norm_assistant(m))
        if m.get("role") == "assistant"
        else (m.get("role"), m.get("content"))
        for m in messages
    ]


@dataclass
class Session:
    """One episode's calls; ``limit`` response tokens per trajectory (completions and template
    tokens between them), ``key`` seeds call i with ``mix(key, i)``."""

    key: int
    limit: int
    sampling: dict
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    def prompt_for(self, messages: list[dict], renderer: ChatRenderer) -> tuple[list[int], int | None, int]:
        """The prompt ids of a request, the parent call and the chain's root prompt length."""
        norm = _norm(messages)
        for i in range(len(self.calls) - 1, -1, -1):
            c = self.calls[i]
            k = len(c.messages)
            if (
                c.ended_eos
                and len(messages) > k + 1
                and norm[:k] == _norm(c.messages)
                and norm[k] == ("assistant", _norm_assistant(c.assistant))
            ):
                return c.prompt_ids + c.completion_ids + renderer.after_turn(messages[k + 1 :]), i, c.root_len
        ids = renderer.prompt(messages)
        return ids, None, len(ids)

    def samples(self, mode: str = "trajectory") -> list[Sample]:
        """``per_call``: one sample per call; ``trajectory``: the chain ending at the last call,
        merged (see the module docstring)."""
        if not self.calls:
            return []
        if mode == "per_call":
            return [
                Sample(c.prompt_ids, c.completion_ids, [1] * len(c.completion_ids), c.logps)
                for c in self.calls
            ]
        chain, i = [], len(self.calls) - 1
        while i is not None:
            chain.append(self.calls[i])
            i = self.calls[i].parent
        chain.reverse()
        last = chain[-1]
        full = last.prompt_ids + last.completion_ids
        mask, logps = [0] * len(full), [0.0] * len(full)
        for c in chain:
            start = len(c.prompt_ids)
            for j, lp in enumerate(c.logps):
                mask[start + j], logps[start + j] = 1, lp
        root = last.root_len
        return [Sample(full[:root], full[root:], mask[root:], logps[root:])]


@dataclass
class _Request:
    session: Session
    prompt: list[int]
    max_tokens: int
    key: int
    future: Future = field(default_factory=Future)


class Endpoint:
    """The server (see the module docstring). ``engine`` is a rollout engine (``generate(prompts,
    n=1, max_new_tokens=…, keys=…, **sampling)``); ``family`` the tool-call syntax of the template."""

    def __init__(
        self, engine: Any, tokenizer: Any, *, family: str = "hermes", batch_wait_s: float = 0.01
    ) -> None:
        self.engine, self.tokenizer, self.family = engine, tokenizer, family
        self.eos = set(engine.eos.tolist())
        self.batch_wait_s = batch_wait_s
        self.sessions: dict[str, Session] = {}
        self._renderers: dict[str, ChatRenderer] = {}
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._next = 0
        self._lock = threading.Lock()
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self._threads = [
            threading.Thread(target=self.server.serve_forever, daemon=True, name="tearless-endpoint"),
            threading.Thread(target=self._engine_loop, daemon=True, name="tearless-endpoint-engine"),
        ]
        for t in self._threads:
            t.start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def open_session(self, key: int, limit: int, sampling: dict) -> str:
        """A new session's id; its base URL is :meth:`session_url`."""
        with self._lock:
            sid = f"s{self._next}"
            self._next += 1
            self.sessions[sid] = Session(key, limit, dict(sampling))
        return sid

    def session_url(self, sid: str) -> str:
        return f"http://127.0.0.1:{self.port}/{sid}/v1"

    def close_session(self, sid: str) -> Session:
        """The session's record; later calls to its URL are refused (404)."""
        with self._lock:
            session = self.sessions.pop(sid)
        with session.lock:
            session.closed = True
        return session

    def shutdown(self) -> None:
        self._queue.put(None)
        self.server.shutdown()
        self.server.server_close()

    def renderer(self, tools: list[dict] | None) -> ChatRenderer:
        key = json.dumps(tools, sort_keys=True)
        with self._lock:
            if key not in self._renderers:
                self._renderers[key] = ChatRenderer(self.tokenizer, tools)
            return self._renderers[key]

    # ------------------------------------------------------------------ the engine thread
    def _engine_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while True:  # everything that arrives while requests keep coming goes into this batch
                try:
                    nxt = self._queue.get(timeout=self.batch_wait_s)
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
            groups: dict[str, list[_Request]] = {}
            for r in batch:
                groups.setdefault(json.dumps(r.session.sampling, sort_keys=True), []).append(r)
            for group in groups.values():
                self._generate(group)

    def _generate(self, group: list[_Request]) -> None:
        try:
            out = self.engine.generate(
                [r.prompt for r in group],
                n=1,
                max_new_tokens=max(r.max_tokens for r in group),
                keys=[r.key for r in group],
                **group[0].session.sampling,
            )
        except Exception as e:  # the calls fail (HTTP 500), their agents' episodes with them
            for r in group:
                r.future.set_exception(e)
            return
        for j, r in enumerate(group):
            valid = out.response_mask[j].bool()
            ids = out.response_ids[j][valid].tolist()[: r.max_tokens]
            r.future.set_result((ids, out.log_probs[j][valid].tolist()[: len(ids)]))

    # ------------------------------------------------------------------ one request
    def complete(self, sid: str, body: dict) -> tuple[int, dict]:
        """(HTTP status, JSON body) of a chat-completion request."""
        session = self.sessions.get(sid)
        if session is None or session.closed:
            return 404, _error(f"session {sid!r} is closed or unknown (its episode ended)")
        if body.get("stream"):
            return 400, _error("stream=true is not supported by the tearless endpoint")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return 400, _error("'messages' must be a non-empty list of chat messages")
        tools = body.get("tools") or None
        renderer = self.renderer(tools)
        with session.lock:
            prompt, parent, root = session.prompt_for(messages, renderer)
            index = len(session.calls)
        used = len(prompt) - root
        room = session.limit - used
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or room
        max_tokens = min(int(asked), room)
        if max_tokens <= 0:
            return 400, _error(f"the episode's token budget ({session.limit} response tokens) is spent")
        request = _Request(session, prompt, max_tokens, mix(session.key, index))
        self._queue.put(request)
        ids, logps = request.future.result()
        ended_eos = bool(ids) and ids[-1] in self.eos
        text = self.tokenizer.decode(ids[:-1] if ended_eos else ids, skip_special_tokens=False)
        parsed = parse_tool_calls(text, self.family) if tools else None
        assistant = parsed.message() if parsed else {"role": "assistant", "content": text}
        with session.lock:
            if session.closed:
                return 404, _error(f"session {sid!r} ended while the call ran")
            session.calls.append(Call(list(messages), assistant, prompt, ids, logps, ended_eos, parent, root))
        finish = "tool_calls" if assistant.get("tool_calls") else "stop" if ended_eos else "length"
        return 200, {
            "id": f"chatcmpl-{sid}-{index}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model", "tearless")),
            "choices": [{"index": 0, "message": assistant, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
        }


class _Server(ThreadingHTTPServer):
    # Every client of a batch connects at once (a judge's max_concurrency, an agent per episode);
    # socketserver's listen queue of 5 reset the rest (39-56 of 128 at once, on 2 cores).
    request_queue_size = 1024


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error"}}


def _handler(endpoint: Endpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            parts = self.path.strip("/").split("/")
            if len(parts) != 4 or parts[1:] != ["v1", "chat", "completions"]:
                return self._send(404, _error(f"no route {self.path}; use /<session>/v1/chat/completions"))
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except ValueError:
                return self._send(400, _error("the request body is not JSON"))
            try:
                status, answer = endpoint.complete(parts[0], body if isinstance(body, dict) else {})
            except Exception as e:  # reported to the client, whose episode fails; the server goes on
                status, answer = 500, _error(f"{type(e).__name__}: {e}")
            self._send(status, answer)

        def _send(self, status: int, answer: dict) -> None:
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request on stderr would drown the training log

    return Handler
