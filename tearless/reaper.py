"""Nothing a run started outlives the process that started it, however that process ends.

``python reaper.py DRIVER_PID [all]`` (started by :func:`start`, a plain script: it imports neither
tearless nor Ray) records the driver's descendants every :data:`POLL_S` and, once the driver is gone,
SIGKILLs those still running, then exits. A process that starts another in a group or session of
its own tells the reaper at once (:func:`record`: one line, ``pid start-time``, on the reaper's
standard input), so a child forked just before the driver's death, between two polls, is not missed:
the pipe keeps what was written after its writer is gone (issue 45: a SIGKILL 0.1 s after the reward
workers started left both running, since they lead their own process groups and the last poll had
not seen them). Which descendants: Ray's (their command line names Ray: the
GCS, raylet, agents, workers and what they forked), for a local Ray cluster started by a library
call; or, with ``all`` (``tearless train``, whose process is the run's own), every one: reward
workers and what their samples started, an in-process reward's subprocesses, Ray. With ``all`` it also
SIGKILLs what was forked after the last poll: the process groups that recorded descendants lead (a
reward worker's), and the driver's orphans, found as the processes of the driver's process group,
started after it, whose parent is now the one this reaper was handed to as well (so a pipeline's other
commands, children of the shell, are left alone).

Ray's own clean-up covers a normal exit and ``ray.shutdown()``; after a SIGKILL of the driver Ray's
``DashboardAgent`` and ``RuntimeEnvAgent`` outlived it (parent pid 1, over 30 s); a reward worker
inside C code that holds the GIL never runs its parent-death handler (issue 45: both workers alive 40
s after the trainer's SIGKILL). This process is outside every such interpreter, so nothing defers its
signal. A process is identified by pid and start time, so a reused pid is never killed.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

POLL_S = 0.5
# The write ends of the pipes to this process's ``everything`` reapers (inherited by what it forks, so
# a reward worker's record reaches the same reaper).
_channels: list[int] = []


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


def watch(driver: int, everything: bool = False) -> None:
    """Record ``driver``'s descendants (Ray's, or with ``everything`` all) until it is gone, then kill
    those that still run, and with ``everything`` the process groups they lead and the driver's
    orphans (:func:`_orphans`)."""
    me = os.getpid()
    seen: dict[int, str] = {}
    leads: dict[int, str] = {}  # recorded processes that lead their own process group
    try:
        driver_start, driver_group = _start_time(driver), os.getpgid(driver)
    except ProcessLookupError:  # gone already: it started nothing this reaper could see
        return
    told = _Told(sys.stdin.fileno()) if everything else None

    def note(pid: int, started: str, lead: bool = False) -> None:
        seen[pid] = started
        if everything and (lead or _own_group(pid)):
            leads[pid] = started

    while os.getppid() == driver:
        for pid in descendants(driver) - {me} - set(seen):
            started = _start_time(pid)
            if started is not None and (everything or _is_ray(pid)):
                note(pid, started)
        if told is None:
            select.select([], [], [], POLL_S)
            continue
        for pid, started in told.read(POLL_S):
            if _start_time(pid) == started:
                note(pid, started, lead=True)  # a told process leads its group (its own child may not yet)
    for pid, started in told.read(0.0) if told is not None else []:  # what the driver wrote last
        if _start_time(pid) == started:
            note(pid, started, lead=True)
    groups = [pid for pid, started in leads.items() if _start_time(pid) == started]
    for pid, started in seen.items():
        if _start_time(pid) == started:
            _kill(os.kill, pid)
    for group in groups:
        _kill(os.killpg, group)
    if everything and driver_start is not None:
        for pid in _orphans(os.getppid(), driver_group, int(driver_start)):
            _kill(os.kill, pid)


class _Told:
    """The lines ``pid start-time`` the driver and its descendants write to this reaper."""

    def __init__(self, fd: int) -> None:
        self.fd, self.rest = fd, b""
        os.set_blocking(fd, False)

    def read(self, wait_s: float) -> list[tuple[int, str]]:
        """What arrived within ``wait_s`` (all that is buffered when it is 0); on end of file it waits
        out ``wait_s`` (the writers are gone: only the driver's death ends the watch)."""
        if not select.select([self.fd], [], [], wait_s)[0]:
            return []
        chunks = []
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                select.select([], [], [], wait_s)
                break
            chunks.append(chunk)
        *lines, self.rest = (self.rest + b"".join(chunks)).split(b"\n")
        found = []
        for line in lines:
            fields = line.split()
            if len(fields) == 2 and fields[0].isdigit():
                found.append((int(fields[0]), fields[1].decode()))
        return found


def _orphans(parent: int, group: int, after: int) -> list[int]:
    """Processes whose parent is ``parent``, in process group ``group``, started after clock tick
    ``after``: what the dead driver forked and this reaper did not see yet (they were handed to the
    same parent as the reaper)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and int(fields[2]) == group and int(fields[19]) >= after:
            found.append(int(entry))
    return found


def _own_group(pid: int) -> bool:  # the process leads its process group
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _kill(how, target: int) -> None:
    try:
        how(target, signal.SIGKILL)
    except OSError:
        pass


def start(everything: bool = False) -> subprocess.Popen | None:
    """Start the reaper of this process's Ray cluster, or with ``everything`` of every process this
    one starts (Linux: it reads /proc); None elsewhere."""
    if not os.path.isdir("/proc/self/task"):
        return None
    process = subprocess.Popen(
        [sys.executable, "-S", os.path.abspath(__file__), str(os.getpid()), *(["all"] if everything else [])],
        stdin=subprocess.PIPE if everything else subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    if process.stdin is not None:
        fd = process.stdin.fileno()
        os.set_blocking(fd, False)  # a reaper that stopped reading never stalls the run
        _channels.append(fd)
    return process


def record(pid: int) -> None:
    """Tell this process's ``everything`` reapers (its own, or its parent's when it was forked) about
    ``pid``, a process it just started in a process group or session of its own; nothing without
    one. The line is written at once, so the reaper ends ``pid`` however soon after this call the
    driver dies."""
    started = _start_time(pid)
    if started is None:
        return
    line = f"{pid} {started}\n".encode()
    for fd in _channels:
        try:
            os.write(fd, line)  # under PIPE_BUF bytes: atomic, never interleaved with another writer's
        except OSError:  # the reaper is gone, or its pipe is full: its /proc poll still finds pid
            pass


if __name__ == "__main__":
    watch(int(sys.argv[1]), everything=sys.argv[2:] == ["all"])
