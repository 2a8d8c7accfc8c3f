"""A pool of forked worker processes that run a reward function with a per-sample deadline.

Workers are forked, so they inherit the reward function as an object: lambdas, closures and
functions defined in a notebook work, and nothing is pickled but the samples and the results. Each
worker gets its samples in chunks (one message per chunk) and sends back one small message per
sample as soon as it is scored. The parent therefore knows which sample each worker is on and since
when, and kills (SIGKILL) a worker whose current sample runs past the deadline, or notices one that
died, and forks a replacement, so the pool keeps its size.

Outcomes are ``("ok", score, extras, steps)``, ``("err", message[, traceback])`` or
``("fatal", message)`` (the code sandbox cannot run at all,
:class:`~tearless.rewards.sandbox.SandboxError`: every sample would fail the same way, so the
manager stops the run instead of scoring it 0); ``steps`` is None or
``(step_scores, step_ends)`` (see :mod:`tearless.rewards.steps`).

What user code may do without breaking the pool: raise, call ``sys.exit``, kill its own worker,
fork (a child that returns from the reward function exits at once and never touches the pipe),
leave processes behind (each worker is a child subreaper in its own process group: after every
sample it kills what the sample left, and the parent kills a worker's whole tree with it), or write
garbage to the pipe (every answer must name the sample the worker is on, or the worker is replaced
and the sample scored again).
"""

from __future__ import annotations

import ctypes
import itertools
import math
import multiprocessing
import numbers
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from tearless import reaper
from tearless.rewards.sandbox import SandboxError

# (data_source, solution_str, ground_truth, extra_info)
Request = tuple[str, str, Any, Any]
Outcome = tuple

# Several chunks per worker balance the load when some samples are slow; a cap keeps a chunk that
# is stuck behind a timed-out sample small.
_CHUNKS_PER_WORKER = 4
_MAX_CHUNK = 64
# How long a worker waits for work before checking that its parent is still alive.
_PARENT_CHECK_S = 1.0
# How often a worker's watchdog thread checks for its parent while a sample runs.
_WATCHDOG_S = 0.5
# SIGKILL'd processes exit at once; this only bounds the wait for one stuck in the kernel.
_REAP_TIMEOUT_S = 5.0
# A score beyond this magnitude is a bug, not a reward: it would overflow float32 (1e39 reached the
# logs as Infinity) or swamp every other sample's advantage.
MAX_ABS_SCORE = 1e6
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1


def evaluate(
    score_fn: Callable[..., Any],
    kwargs: dict,
    request: Request,
    catch: type[BaseException] | tuple[type[BaseException], ...] = Exception,
) -> Outcome:
    """Call the reward function on one sample and check what it returned.

    A process the function forked that returns from it here exits at once: it must not go on as a
    copy of the caller (a second trainer, or a second worker reading the same pipe).
    """
    data_source, solution_str, ground_truth, extra_info = request
    pid = os.getpid()
    try:
        value = score_fn(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
            **kwargs,
        )
    except SandboxError as exc:
        if os.getpid() != pid:
            os._exit(0)
        return ("fatal", str(exc))
    except catch as exc:
        if os.getpid() != pid:
            os._exit(0)
        return ("err", f"raised: {type(exc).__name__}: {exc}", user_traceback(exc))
    if os.getpid() != pid:
        os._exit(0)
    return check_value(value)


def user_traceback(exc: BaseException) -> str:
    """The traceback of an exception raised by a reward function, without the frame of
    :func:`evaluate` that called it. Only file, line and function names: a confined worker may not
    open files, so the source lines are added where it is printed (:func:`with_source`)."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    frames = [
        f'  File "{frame.f_code.co_filename}", line {lineno}, in {frame.f_code.co_name}\n'
        for frame, lineno in traceback.walk_tb(tb)
    ]
    last = "".join(traceback.format_exception_only(type(exc), exc))
    return "Traceback (most recent call last):\n" + "".join(frames) + last


def with_source(text: str) -> str:
    """``text`` (a traceback from :func:`user_traceback`) with each frame's source line added."""
    import linecache
    import re

    out = []
    for line in text.splitlines():
        out.append(line)
        frame = re.fullmatch(r'  File "(.+)", line (\d+), in .+', line)
        source = linecache.getline(frame[1], int(frame[2])).strip() if frame else ""
        if source:
            out.append(f"    {source}")
    return "\n".join(out)


def check_value(value: Any) -> Outcome:
    """Turn a reward function's return value into an outcome: a finite float score plus numeric extras.

    The score is a real number (a bool, int, float, numpy scalar, or a one-element tensor or array,
    through ``.item()``) or a dict's ``score``. A dict's other finite numeric (and bool) values are
    kept as extras; non-numeric or non-finite ones (a predicted string, a NaN) are dropped, since
    extras are logged as numbers, and so are extras beyond ±:data:`MAX_ABS_SCORE`. A dict's
    ``step_scores`` (finite numbers) and optional ``step_ends`` (increasing character offsets, one per
    score) become the outcome's ``steps``. Anything else (None, a string, a NaN, a score beyond
    ±:data:`MAX_ABS_SCORE`, malformed steps) is an ``("err", why)`` outcome, never an exception.
    """
    steps = None
    if isinstance(value, dict):
        if "score" not in value:
            keys = sorted(str(k)[:40] for k in value)[:20]
            return ("err", f"returned a dict without a 'score' key (keys: {keys})")
        extras = {}
        for key, extra in value.items():
            number = _as_float(extra) if key not in ("score", *_STEP_KEYS) else None
            if number is not None and math.isfinite(number) and abs(number) <= MAX_ABS_SCORE:
                extras[str(key)] = number
        score = value["score"]
        if "step_scores" in value:
            steps = _steps(value.get("step_scores"), value.get("step_ends"))
            if isinstance(steps, str):
                return ("err", steps)
        elif "step_ends" in value:
            return ("err", "returned 'step_ends' without 'step_scores'")
    else:
        score, extras = value, {}
    number = _as_float(score)
    if number is None:
        return (
            "err",
            f"returned a score of type {type(score).__name__} ({_short(score)}); a reward function must "
            "return a float or a dict with a numeric 'score'",
        )
    if not math.isfinite(number):
        return ("err", f"returned a non-finite score ({number})")
    if abs(number) > MAX_ABS_SCORE:
        return ("err", f"returned an absurd score ({number:g}); beyond ±{MAX_ABS_SCORE:g} is a failure")
    return ("ok", number, extras, steps)


_STEP_KEYS = ("step_scores", "step_ends")


def _steps(scores: Any, ends: Any) -> tuple[tuple[float, ...], tuple[int, ...] | None] | str:
    """``(step_scores, step_ends)`` checked and as plain tuples, or a string saying what is wrong."""
    if isinstance(scores, (str, bytes, dict)) or not hasattr(scores, "__len__"):
        return f"returned step_scores of type {type(scores).__name__}; it must be a list of numbers"
    values = [_as_float(x) for x in scores]
    if any(x is None or not math.isfinite(x) for x in values):
        return f"returned step_scores with a value that is not a finite number ({_short(list(scores))})"
    if ends is None:
        return tuple(values), None
    if isinstance(ends, (str, bytes, dict)) or not hasattr(ends, "__len__"):
        return f"returned step_ends of type {type(ends).__name__}; it must be a list of character offsets"
    offsets = [int(e) if isinstance(e, numbers.Integral) and not isinstance(e, bool) else None for e in ends]
    if any(e is None or e <= 0 for e in offsets) or len(offsets) != len(values):
        return (
            f"returned step_ends {_short(list(ends))}: it must hold one positive character offset per "
            f"step score ({len(values)})"
        )
    if any(b <= a for a, b in itertools.pairwise(offsets)):
        return f"returned step_ends {_short(list(ends))} that do not increase"
    return tuple(values), tuple(offsets)


def _as_float(value: Any) -> float | None:
    """``value`` as a float if it is one real number, else ``None`` (an int past float range is inf)."""
    if not isinstance(value, numbers.Real) and callable(getattr(value, "item", None)):
        try:
            value = value.item()  # numpy and torch raise unless the array holds exactly one number
        except Exception:
            return None
    if not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
    except Exception:
        return None


def _short(value: Any) -> str:
    """At most 60 characters of ``repr(value)``, even for a repr that is huge or raises."""
    if isinstance(value, (str, bytes)) and len(value) > 60:
        value = value[:60]
    try:
        return repr(value)[:60]
    except Exception:
        return f"<{type(value).__name__}>"


def _well_formed(message: Any, expected: int) -> bool:
    if not (isinstance(message, tuple) and len(message) == 2 and message[0] == expected):
        return False
    outcome = message[1]
    if not isinstance(outcome, tuple) or not outcome:
        return False
    if outcome[0] == "ok":
        return (
            len(outcome) == 4
            and isinstance(outcome[1], float)
            and isinstance(outcome[2], dict)
            and (outcome[3] is None or isinstance(outcome[3], tuple))
        )
    if outcome[0] == "err" and len(outcome) == 3:  # a raised exception: (err, message, traceback)
        return isinstance(outcome[1], str) and isinstance(outcome[2], str)
    return outcome[0] in ("err", "fatal") and len(outcome) == 2 and isinstance(outcome[1], str)


def _worker_main(
    conn: Connection, score_fn: Callable[..., Any], kwargs: dict, to_close: list, parent: int, pdeathsig: bool
) -> None:
    # The fork copied the parent's ends of every pipe; holding them would keep other workers (and
    # this one) from seeing end-of-file when the parent goes away.
    for other in to_close:
        other.close()
    # Ctrl-C reaches the whole process group; the parent decides what happens to workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Its own process group and a subreaper: whatever a sample forks stays findable (see kill_tree).
    os.setpgid(0, 0)
    _set_subreaper()
    _die_with(parent, pdeathsig)
    # Several workers each running torch's full intra-op thread pool would oversubscribe the cores,
    # and an OpenMP pool used before the fork can deadlock in the child.
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    while True:
        if not conn.poll(_PARENT_CHECK_S):
            if os.getppid() != parent:
                return
            continue
        try:
            chunk = conn.recv()
        except EOFError:
            return
        if chunk is None:
            return
        for index, request in chunk:
            # BaseException too: a scorer calling sys.exit() is a failed sample, not a dead worker.
            outcome = evaluate(score_fn, kwargs, request, BaseException)
            _kill_leftovers()
            conn.send((index, outcome))


def _die_with(parent: int, pdeathsig: bool) -> None:
    """Make this worker end (with what its sample started) when ``parent`` does: SIGTERM on its death
    (``pdeathsig``: the pool was made in the parent's main thread), and a watchdog thread."""
    signal.signal(signal.SIGTERM, lambda *_: _end_worker())
    if pdeathsig:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: the watchdog alone
            pass
    if os.getppid() != parent:  # it died before the signal was armed
        _end_worker()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_WATCHDOG_S)
        _end_worker()

    threading.Thread(target=watch, name="tearless-reward-watchdog", daemon=True).start()


def _end_worker() -> None:
    """Kill this worker's descendants and its process group (itself last); never returns."""
    kill_tree(os.getpid(), include_root=False)
    try:
        os.killpg(os.getpid(), signal.SIGKILL)
    finally:
        os._exit(1)


def _set_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: leftovers are found by process group only
        pass


def _kill_leftovers() -> None:
    """In a worker: kill every process the last sample left (they are all its descendants, orphans
    included, since the worker is a subreaper) and reap them."""
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return  # no child at all: the common case, one system call
    for _ in range(100):  # a fork bomb may refill the tree while it is killed; each round shrinks it
        if not kill_tree(os.getpid(), include_root=False):
            break
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                return


def kill_tree(pid: int, *, include_root: bool = True) -> list[int]:
    """SIGKILL ``pid``'s descendants (found through /proc, children before their parents are reaped)
    and, with ``include_root``, ``pid`` itself; return the pids signalled."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], list(children.get(pid, []))
    while stack:
        child = stack.pop()
        found.append(child)
        stack.extend(children.get(child, []))
    for target in [*found, pid] if include_root else found:
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return found


class _Worker:
    def __init__(self, process: Any, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.queue: deque[int] = deque()  # sample indices sent and not yet answered, in order
        self.started = 0.0  # when the sample at the head of the queue started (monotonic)
        self.lost = False  # its pipe broke: it is dead or dying

    def kill(self) -> None:
        """SIGKILL the process with everything it started (if it still runs), reap it and close the
        pipe; safe to call twice."""
        if self.process.exitcode is None:
            kill_tree(self.process.pid)
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.process.join(_REAP_TIMEOUT_S)
        self.conn.close()


class WorkerPool:
    """``num_workers`` forked processes running ``score_fn(**request, **kwargs)`` with a deadline.

    Not thread-safe: one :meth:`run` at a time.
    """

    def __init__(
        self, score_fn: Callable[..., Any], kwargs: dict, num_workers: int, timeout_s: float
    ) -> None:
        self._ctx = multiprocessing.get_context("fork")
        self._score_fn = score_fn
        self._kwargs = kwargs
        self._timeout_s = timeout_s
        self._num_workers = num_workers
        self._workers: list[_Worker] = []
        self.lost = 0  # workers that died (killed from outside, or crashed) while scoring; timeouts aside
        self._fill()

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [w.process.pid for w in self._workers if w.process.exitcode is None]

    def run(self, requests: Sequence[Request]) -> list[Outcome]:
        """Score every request; outcomes are in the order of ``requests``.

        A sample whose worker dies is scored once more by a fresh worker; if that one dies too, the
        sample fails. Every wait is bounded by the earliest deadline of a running sample.
        """
        self._fill()
        outcomes: list[Outcome | None] = [None] * len(requests)
        pending = deque(range(len(requests)))
        deaths = [0] * len(requests)
        chunk = max(1, min(_MAX_CHUNK, math.ceil(len(requests) / (self._num_workers * _CHUNKS_PER_WORKER))))
        try:
            while pending or any(w.queue for w in self._workers):
                for w in self._workers:
                    if not w.queue and pending:
                        self._send(w, [pending.popleft() for _ in range(min(chunk, len(pending)))], requests)
                busy = [w for w in self._workers if w.queue]
                timeout = min(w.started for w in busy) + self._timeout_s - time.monotonic()
                ready = set(
                    wait([w.conn for w in busy] + [w.process.sentinel for w in busy], max(timeout, 0.0))
                )
                for w in busy:
                    self._collect(w, outcomes)
                now = time.monotonic()
                for w in busy:
                    if w.lost or w.process.sentinel in ready:
                        self._on_death(w, outcomes, pending, deaths)
                    elif w.queue and now >= w.started + self._timeout_s:
                        w.kill()
                        outcomes[w.queue.popleft()] = ("err", f"timeout after {self._timeout_s:g}s")
                        self._replace(w, pending)
        except BaseException:
            # Interrupted (Ctrl-C, or an item that cannot be pickled): busy workers would send stale
            # results into the next call, so they go, and the next call forks fresh ones.
            for w in [w for w in self._workers if w.queue]:
                w.kill()
                self._workers.remove(w)
            raise
        return outcomes  # type: ignore[return-value]

    def close(self) -> None:
        """Stop every worker: ask politely, then SIGKILL whatever is still running after a second."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 1.0
        for w in self._workers:
            w.process.join(max(deadline - time.monotonic(), 0.0))
            w.kill()
        self._workers = []

    def _fill(self) -> None:
        # Workers that died between calls (killed from outside) are replaced before any work is sent.
        for w in [w for w in self._workers if w.process.exitcode is not None]:
            w.kill()
            self._workers.remove(w)
        while len(self._workers) < self._num_workers:
            self._workers.append(self._spawn())

    def _spawn(self) -> _Worker:
        parent_end, child_end = self._ctx.Pipe(duplex=True)
        to_close = [w.conn for w in self._workers] + [parent_end]
        main_thread = threading.current_thread() is threading.main_thread()
        process = self._ctx.Process(
            target=_worker_main,
            args=(child_end, self._score_fn, self._kwargs, to_close, os.getpid(), main_thread),
            name="tearless-reward-worker",
            daemon=True,
        )
        process.start()
        child_end.close()
        reaper.record(process.pid)  # it leads its own group: the reaper ends it even after a SIGKILL
        return _Worker(process, parent_end)

    def _send(self, w: _Worker, indices: list[int], requests: Sequence[Request]) -> None:
        try:
            w.conn.send([(i, requests[i]) for i in indices])
        except OSError:
            # It died while idle; the death check requeues the chunk.
            w.lost = True
        except Exception as exc:
            # Pickling failed before anything was written; say which items and what to do.
            raise ValueError(
                f"reward items {indices[0]}..{indices[-1]} cannot be sent to a worker process ({exc}); "
                "ground_truth and extra_info must be picklable, or use num_workers=0"
            ) from exc
        w.queue.extend(indices)
        w.started = time.monotonic()

    def _collect(self, w: _Worker, outcomes: list) -> None:
        try:
            while w.queue and w.conn.poll():
                message = w.conn.recv()
                # A worker answers its chunk in order: the answer must name the head of its queue
                # and be a well-formed outcome, or something else wrote to the pipe.
                if not _well_formed(message, w.queue[0]):
                    w.lost = True
                    return
                w.queue.popleft()
                outcomes[message[0]] = message[1]
                w.started = time.monotonic()
        except Exception:  # EOF, a broken pipe, or bytes that do not unpickle
            w.lost = True

    def _on_death(self, w: _Worker, outcomes: list, pending: deque, deaths: list[int]) -> None:
        # Also a worker whose pipe carried something that is not an answer: it is killed like a dead one.
        w.kill()
        self.lost += 1
        if w.queue:
            index = w.queue.popleft()
            deaths[index] += 1
            if deaths[index] >= 2:
                outcomes[index] = (
                    "err",
                    f"worker process died while scoring this sample, twice (exit code {w.process.exitcode})",
                )
            else:
                w.queue.appendleft(index)
        self._replace(w, pending)

    def _replace(self, w: _Worker, pending: deque) -> None:
        # Samples the dead worker had not reached go back to the front of the line, in their order.
        pending.extendleft(reversed(w.queue))
        w.queue.clear()
        self._workers[self._workers.index(w)] = self._spawn()
