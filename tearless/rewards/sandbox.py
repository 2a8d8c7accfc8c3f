"""Run an untrusted Python program against test inputs, contained: one sandbox per sample.

:func:`run_in_sandbox` writes the program, its inputs and the harness
(:mod:`tearless.rewards.sandbox_harness`) to a fresh temporary directory, starts the harness as a
separate ``python -I -B`` process in a new session, reads its progress, and removes the directory.
Each test runs in its own forked process with its own limits.

What is enforced (Linux only):

- always, per test: CPU time (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later) and wall-clock time
  (the harness kills the test's process group); address space (RLIMIT_AS, so a 10 GB allocation
  fails with MemoryError); the size of every file written, stdout and stderr included
  (RLIMIT_FSIZE; stdout past the cap ends the test with ``output_limit``); at most 64 open files;
  no core dumps. The program gets only its own test's stdin, stdout, stderr (and result)
  descriptors, opened for it beforehand, and runs in the ``scratch`` directory, emptied after
  each test.
- always, per sample: a wall-clock deadline (10 s of start-up plus the tests' limits plus 1 s each)
  after which this process kills the harness's session; no new privileges (PR_SET_NO_NEW_PRIVS);
  the harness and each test process die with their parent (PR_SET_PDEATHSIG); each test's files
  are read and emptied as soon as it ends, and the working directory is removed at the end.
- when this process is root (here, in CI, in most containers): the harness enters new mount and
  network namespaces. The network namespace has no interface but a downed loopback: no network at
  all, from Python or from native code. In the mount namespace ``/tmp``, ``/var/tmp``, ``/dev/shm``,
  ``/run/lock`` and any directory that hides the interpreter (``/root`` for a pyenv install) are
  covered with empty root-owned tmpfs mounts, only the interpreter and the working directory are
  bound back, and ``scratch`` is a private tmpfs of ``file_size_mb`` (1024 inodes). Then it switches
  to a uid of its own (``0x40000000 + pid``, no groups). So the program can write nowhere but
  ``scratch`` and its own descriptors (disk and memory use is bounded), RLIMIT_NPROC caps a fork
  bomb at ``max_processes`` tasks (threads included), and after each test ``kill(-1, SIGKILL)`` as
  that uid ends every process the test left, even ones that left the process group. Where the
  kernel refuses namespaces (a container without CAP_SYS_ADMIN) the uid switch still happens,
  ``scratch`` is a plain directory (its disk use unbounded) and ``protections`` says
  ``no_namespaces``.
- when it is not root: no namespaces and no uid switch. RLIMIT_NPROC is set to the user's current
  task count plus ``max_processes`` (approximate: the user's other processes share it), and leftover
  processes are killed by process group, so one that calls ``setsid`` escapes the sweep.
- the Python guard (``limits.guard``, on by default, in both modes): an audit hook installed before
  the program runs refuses process creation (fork, exec, spawn, subprocess, os.system), signals to
  other processes, sockets, ctypes, raising resource limits, and opening for writing, deleting,
  renaming or chmod-ing any path outside ``scratch``. Without root it is the only network and write
  barrier. An audit hook is not a security boundary against code written to escape it (a
  ``dir_fd``-relative open gets past it); it stops what careless or reward-hacking code does.

Not enforced: reading files (any file the sandbox uid, or the user without root, may read);
memory summed over processes (at most ``max_processes × memory_mb`` plus the scratch tmpfs);
without root, the number of files written to ``scratch``, and so its disk use.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UID_BASE = 0x40000000  # as in sandbox_harness.py
_HARNESS = Path(__file__).with_name("sandbox_harness.py")
_STARTUP_S = 10.0  # interpreter start and confinement, on a loaded 2-core machine
_STDERR_TAIL = 2000
_ENV = {
    "PATH": os.defpath,
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not a failure of the program under test)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    Args:
        time_limit_s: wall-clock seconds per test; the CPU limit is this rounded up.
        memory_mb: address-space limit per process, in MiB (at least 64: the interpreter needs it).
        file_size_mb: largest file the program may write, stdout included, in MiB.
        max_processes: tasks (processes and threads) the sandbox may have at once; the harness and
            the test's own process count.
        guard: install the Python audit-hook guard before the program runs.
    """

    time_limit_s: float = 4.0
    memory_mb: int = 512
    file_size_mb: int = 16
    max_processes: int = 8
    guard: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.time_limit_s <= 600:
            raise ValueError(f"time_limit_s must be in (0, 600] seconds, got {self.time_limit_s}")
        if self.memory_mb < 64:
            raise ValueError(
                f"memory_mb must be at least 64 (the interpreter needs it), got {self.memory_mb}"
            )
        if self.file_size_mb <= 0:
            raise ValueError(f"file_size_mb must be > 0, got {self.file_size_mb}")
        if self.max_processes < 2:
            raise ValueError(f"max_processes must be at least 2 (harness and test), got {self.max_processes}")


@dataclass
class TestRun:
    """One test's run: ``status`` is ``ok`` (exit 0), ``error`` (non-zero exit or exception),
    ``timeout``, ``output_limit``, ``killed``, ``crashed`` (another signal) or ``skipped`` (not run:
    an earlier test timed out, the program did not compile, or the harness died).

    ``output`` is stdout (standard-input tests) or the JSON of the return value (function-call
    tests), set only when ``status`` is ``ok``; ``stderr`` is the end of standard error.
    """

    status: str
    output: str | None = None
    stderr: str = ""
    seconds: float = 0.0


@dataclass
class SandboxResult:
    runs: list[TestRun]
    protections: list[str] = field(default_factory=list)
    compile_error: str | None = None


def run_in_sandbox(
    source: str,
    inputs: Sequence[Any],
    *,
    fn_name: str | None = None,
    limits: SandboxLimits | None = None,
) -> SandboxResult:
    """Run ``source`` once per input and return what each run printed (or returned).

    With ``fn_name`` None each input is a string fed to stdin and the program runs as
    ``__main__``; otherwise each input is the list of positional arguments of ``fn_name`` (a
    top-level function or a method of ``class Solution``) and the module runs as ``__solution__``.
    """
    if not sys.platform.startswith("linux"):
        raise SandboxError(
            f"the code sandbox needs Linux (namespaces, rlimits, /proc); this is {sys.platform}"
        )
    limits = limits or SandboxLimits()
    privileged = os.geteuid() == 0
    workdir = Path(tempfile.mkdtemp(prefix="tearless-sandbox-"))
    proc: subprocess.Popen | None = None
    events: list[dict] = []
    runs: dict[int, TestRun] = {}

    def collect(event: dict) -> None:
        # Read a test's files as soon as it is reported and empty them, so the disk holds at most
        # the files of the test running now: a few times file_size_mb, however many tests there are.
        runs[event["test"]] = _read_test(workdir, event, fn_name is not None)

    try:
        _write_job(workdir, source, inputs, fn_name, limits, privileged)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", _HARNESS.name],
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**_ENV, "HOME": ".", "TMPDIR": "."},  # the program's working directory: scratch
            start_new_session=True,
        )
        deadline = time.monotonic() + _STARTUP_S + len(inputs) * (limits.time_limit_s + 1.0)
        stderr = _follow(proc, deadline, events, collect)
        _stop(proc, events, privileged)
        setup = next((e["setup_error"] for e in events if "setup_error" in e), None)
        if setup is not None or not any("protections" in e for e in events):
            raise SandboxError(
                f"the sandbox could not start: {setup or stderr.strip()[-_STDERR_TAIL:] or 'no output'}"
            )
        if proc.returncode > 0:  # the harness itself failed (a signal means the program killed it)
            raise SandboxError(f"the sandbox harness failed: {stderr.strip()[-_STDERR_TAIL:]}")
        compile_error = next((e["compile_error"] for e in events if "compile_error" in e), None)
        return SandboxResult(
            [runs.get(i, TestRun("skipped", stderr=compile_error or "")) for i in range(len(inputs))],
            next(e["protections"] for e in events if "protections" in e),
            compile_error,
        )
    finally:
        if proc is not None and proc.poll() is None:
            _stop(proc, events, privileged)
        _remove_tree(workdir)


def _write_job(
    workdir: Path,
    source: str,
    inputs: Sequence[Any],
    fn_name: str | None,
    limits: SandboxLimits,
    privileged: bool,
) -> None:
    for name in ("in", "out", "err", "res", "scratch"):
        (workdir / name).mkdir()
    for i, value in enumerate(inputs):
        text = json.dumps(list(value)) if fn_name is not None else value
        (workdir / "in" / str(i)).write_text(text, encoding="utf-8")
    (workdir / "solution.py").write_text(source, encoding="utf-8")
    (workdir / _HARNESS.name).write_text(_HARNESS.read_text(encoding="utf-8"), encoding="utf-8")
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    prefixes.add(os.path.dirname(os.path.realpath(sys.executable)))
    job = {
        "num_tests": len(inputs),
        "fn_name": fn_name,
        "time_limit_s": limits.time_limit_s,
        "memory_bytes": limits.memory_mb << 20,
        "file_bytes": limits.file_size_mb << 20,
        "max_processes": limits.max_processes,
        "guard": limits.guard,
        "privileged": privileged,
        "expose": sorted(os.path.realpath(p) for p in prefixes),
    }
    (workdir / "job.json").write_text(json.dumps(job), encoding="utf-8")


def _follow(
    proc: subprocess.Popen, deadline: float, events: list[dict], on_test: Callable[[dict], None]
) -> str:
    """Read the harness's event lines until it exits or ``deadline``, calling ``on_test`` for each
    finished test; return the harness's stderr."""
    assert proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif len(key.data) < 1 << 20:  # the harness writes little; a flood is cut off
                    key.data.extend(chunk)
                    if key.data is out:
                        *lines, rest = out.split(b"\n")
                        out[:] = rest
                        for line in filter(bytearray.strip, lines):
                            events.append(json.loads(line))
                            if "test" in events[-1]:
                                on_test(events[-1])
    return err.decode("utf-8", "replace")


def _stop(proc: subprocess.Popen, events: list[dict], privileged: bool) -> None:
    """Make sure nothing of the run survives: the harness's session, the last test's group and,
    as root, every process of the sandbox uid."""
    pgids = [proc.pid, *[e["pgid"] for e in events if "pgid" in e][-1:]]
    if proc.poll() is None:
        for pgid in pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    if privileged and proc.returncode != 0:
        _kill_uid(UID_BASE + proc.pid)
    elif proc.returncode != 0 and len(pgids) > 1:
        try:
            os.killpg(pgids[-1], signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_uid(uid: int) -> None:
    """Fork a helper that becomes ``uid`` and sends SIGKILL to every process of that uid."""
    if uid < UID_BASE:
        raise ValueError(f"refusing to kill the processes of uid {uid}: not a sandbox uid")
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            if os.getuid() == uid and os.geteuid() == uid:
                for _ in range(2):  # see sandbox_harness.sweep
                    os.kill(-1, signal.SIGKILL)  # every process of this uid but the helper itself
        except BaseException:
            pass
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _read_test(workdir: Path, event: dict, call: bool) -> TestRun:
    i = str(event["test"])
    tail = _read_regular(workdir / "err" / i, _STDERR_TAIL, tail=True) or ""
    output = None
    if event["status"] == "ok":
        output = _read_regular(workdir / ("res" if call else "out") / i, 1 << 30)
    for name in ("out", "err", "res"):
        with contextlib.suppress(OSError):  # without root, a program may have deleted its own file
            os.truncate(workdir / name / i, 0)
    status = event["status"] if output is not None or event["status"] != "ok" else "error"
    return TestRun(status, output, tail, float(event.get("seconds", 0.0)))


def _read_regular(path: Path, cap: int, tail: bool = False) -> str | None:
    """A file the program may have replaced: no symlinks followed, no FIFOs waited on, ``cap`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        if tail and info.st_size > cap:
            os.lseek(fd, info.st_size - cap, os.SEEK_SET)
        chunks, size = [], 0
        while size < cap and (chunk := os.read(fd, min(1 << 20, cap - size))):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks).decode("utf-8", "replace")
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    def make_writable(func: Any, target: str, _exc: Any) -> None:
        # A program may chmod its own directories to 0; without root that blocks the removal.
        os.chmod(os.path.dirname(target), 0o700)
        if os.path.isdir(target) and not os.path.islink(target):
            os.chmod(target, 0o700)
        func(target)

    shutil.rmtree(path, onerror=make_writable)
