"""The reaper (tearless/reaper.py): what a driver tells it is ended after the driver's SIGKILL, even a
process forked in its own process group an instant before, which no /proc poll saw.

Issue 45's signal test failed once in CI this way: the trainer was SIGKILLed right after its reward
workers started; the reaper polls every 0.5 s, had not seen them, and they lead their own process
groups, so its end-of-watch search (the driver's process group) missed them too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tearless import reaper

# A driver that starts its reaper, lets it poll, forks a child into a process group of its own (as
# the reward pool does), tells the reaper, writes the pids down and SIGKILLs itself at once.
DRIVER = """
import os, signal, sys, time
from pathlib import Path
from tearless import reaper
watcher = reaper.start(everything=True)
time.sleep(1.5)
child = os.fork()
if child == 0:
    os.setpgid(0, 0)
    time.sleep(3600)
    os._exit(0)
os.setpgid(child, child)
reaper.record(child)
Path(sys.argv[1]).write_text(f"{child} {watcher.pid}")
os.kill(os.getpid(), signal.SIGKILL)
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_child_told_an_instant_before_the_drivers_sigkill_is_ended(tmp_path):
    repo = Path(__file__).resolve().parent.parent
    pids, stderr = tmp_path / "pids", tmp_path / "stderr"
    with open(stderr, "w") as err:  # files, not pipes: a survivor would hold a pipe open
        returncode = subprocess.run(
            [sys.executable, "-c", DRIVER, str(pids)], stdout=subprocess.DEVNULL, stderr=err, timeout=120,
            env={**os.environ, "PYTHONPATH": str(repo)},
        ).returncode  # fmt: skip
    assert returncode == -signal.SIGKILL, stderr.read_text()
    child, watcher = (int(p) for p in pids.read_text().split())
    try:
        deadline = time.monotonic() + 5.0  # the bound; the reaper notices within POLL_S
        while alive(child) or alive(watcher):
            assert time.monotonic() < deadline, f"alive: child {alive(child)}, reaper {alive(watcher)}"
            time.sleep(0.05)
    finally:
        for pid in (child, watcher):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_told_lines_are_read_whole_across_reads():
    read_end, write_end = os.pipe()
    try:
        told = reaper._Told(read_end)
        os.write(write_end, b"12 345\n6")
        assert told.read(1.0) == [(12, "345")]
        assert told.read(0.0) == []  # nothing new: the half line waits
        os.write(write_end, b"7 89\nnot a line\n")
        assert told.read(1.0) == [(67, "89")]
    finally:
        os.close(read_end)
        os.close(write_end)


def test_record_without_a_reaper_writes_nothing(monkeypatch):
    read_end, write_end = os.pipe()
    try:
        monkeypatch.setattr(reaper, "_channels", [])
        reaper.record(os.getpid())
        os.set_blocking(read_end, False)
        assert reaper._Told(read_end).read(0.0) == []
        monkeypatch.setattr(reaper, "_channels", [write_end])
        reaper.record(os.getpid())
        assert reaper._Told(read_end).read(1.0) == [(os.getpid(), reaper._start_time(os.getpid()))]
    finally:
        os.close(read_end)
        os.close(write_end)
