"""One trainer per run directory: a lock held for the whole run.

:func:`acquire` takes an exclusive ``flock`` on ``<run_dir>/.tearless.lock`` and writes the holder's
pid, host, start time and command line into it. The kernel releases a ``flock`` when its process
ends, however it ends (exit, exception, SIGKILL, power loss of the process), so a lock is never
stale: a file left by a killed trainer is simply taken over. A second trainer on the same directory
gets :class:`RunLocked`, whose message names the first one's pid and command.

On main two ``tearless train`` on one directory both ran to exit 0, each replacing the other's
checkpoints and metrics. (A lock on a network file system is only as good as its ``flock``.)

A forked child (a reward worker, anything a reward function forks) closes its copy of a held lock's
descriptor at once (:func:`os.register_at_fork`): a ``flock`` belongs to the open file description,
so a child that outlived the trainer holding it kept the directory locked, and the resume was
refused naming the dead trainer. (``O_CLOEXEC`` covers ``exec`` only, not a bare fork.)
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
import weakref
from pathlib import Path

LOCK_FILE = ".tearless.lock"


class RunLocked(RuntimeError):
    """Another live process holds the run directory."""


class RunDirUnwritable(OSError):
    """The run directory cannot be created or written (read-only file system, permissions, …)."""


class RunLock:
    """A held lock; :meth:`release` (or the process's end) gives it back."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd
        _held.add(self)

    def _forget_in_child(self) -> None:
        # Close only: flock(LOCK_UN) here would unlock the parent's lock too (one description).
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_held: weakref.WeakSet[RunLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_held):
        lock._forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def acquire(run_dir: str | os.PathLike) -> RunLock:
    """Lock ``run_dir`` (created if missing) for this process, or raise :class:`RunLocked` /
    :class:`RunDirUnwritable` with the reason and the fix."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise RunDirUnwritable(
            exc.errno,
            f"cannot use the run directory {run_dir} ({os.strerror(exc.errno or errno.EIO)}: "
            f"{exc.filename}); "
            "make it writable or point trainer.default_local_dir (or trainer.experiment_name) elsewhere",
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise RunLocked(
            f"another trainer is using {run_dir}: pid {holder.get('pid', '?')} on {holder.get('host', '?')}, "
            f"started {holder.get('started', '?')} ({holder.get('command', '?')}). Two trainers on one "
            "directory would overwrite each other's checkpoints and metrics: wait for it to finish or stop "
            "it, or use another trainer.experiment_name"
        ) from None
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv)[:300],
    }
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise RunDirUnwritable(
            exc.errno, f"cannot write {path} ({exc}); free disk space or make the run directory writable"
        ) from exc
    return RunLock(path, fd)


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
