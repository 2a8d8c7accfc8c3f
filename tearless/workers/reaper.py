"""A local Ray cluster does not outlive the process that started it, however that process ends.

``python reaper.py DRIVER_PID`` (started by :func:`start`, a plain script: it imports neither tearless
nor Ray) records the driver's descendants that are Ray's (their command line names Ray: the GCS,
raylet, agents, workers and what they forked) every :data:`POLL_S` and, once the driver is gone,
SIGKILLs those still running, then exits. Ray's own
clean-up covers a normal exit and ``ray.shutdown()``; after a SIGKILL of the driver Ray's
``DashboardAgent`` and ``RuntimeEnvAgent`` outlived it (parent pid 1, over 30 s), which is what
this catches. A process is identified by pid and start time, so a reused pid is never killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> set[int]:
    """``pid``'s descendants, through /proc/<pid>/task/*/children (every thread's children)."""
    found, stack = set(), [pid]
    while stack:
        p = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            for c in children:
                if c not in found:
                    found.add(c)
                    stack.append(c)
    return found


def _is_ray(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"ray" in f.read()
    except OSError:
        return False


def watch(driver: int) -> None:
    """Record ``driver``'s descendants until it is gone, then kill those that still run."""
    me = os.getpid()
    seen: dict[int, str] = {}
    while os.getppid() == driver:
        for pid in descendants(driver) - {me} - set(seen):
            started = _start_time(pid)
            if started is not None and _is_ray(pid):
                seen[pid] = started
        time.sleep(POLL_S)
    for pid, started in seen.items():
        if _start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def start() -> subprocess.Popen | None:
    """Start the reaper of this process's Ray cluster (Linux: it reads /proc); None elsewhere."""
    if not os.path.isdir("/proc/self/task"):
        return None
    return subprocess.Popen(
        [sys.executable, "-S", os.path.abspath(__file__), str(os.getpid())],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip


if __name__ == "__main__":
    watch(int(sys.argv[1]))
