"""The program that runs inside the code sandbox (a script: standard library only, never imported).

:mod:`tearless.rewards.sandbox` copies this file, :mod:`~tearless.rewards.sandbox_confine` and
:mod:`~tearless.rewards.sandbox_seccomp` into a fresh working directory holding ``job.json``,
``solution.py``, one input file per test (``in/<i>``) and empty ``out``, ``err`` and ``res``
directories, and starts it as ``python -I -B sandbox_harness.py`` there. The harness

1. opens every file a test will use (:func:`open_test_files`): the program never needs, and never
   sees, the working directory;
2. confines itself. Full isolation (the default): new PID, mount, IPC, network, UTS (and, without
   root, user) namespaces, an empty read-only root with only the interpreter and its libraries,
   a private ``/tmp`` and ``/dev/shm``, no capabilities (:func:`sandbox_confine.isolate`), then
   the system-call filter (:func:`sandbox_seccomp.install`). Weak isolation (only when the user
   asked for it): resource limits and process-group kills alone. Resource limits in both;
3. compiles ``solution.py`` once;
4. with full isolation forks the sandbox's PID 1 (:func:`run_tests` runs there) and waits for it;
5. runs each test in a forked child (:func:`run_child`) with its own CPU and wall-clock limit: stdin
   from ``in/<i>``, stdout to ``out/<i>`` and stderr to ``err/<i>`` (RLIMIT_FSIZE caps both), for
   function-call tests the JSON of the return value on fd 3 (``res/<i>``), the scratch directory
   as its current directory, and the audit-hook guard (:func:`install_guard`, a second layer that
   stops careless code early) installed before the untrusted code runs;
6. after each test kills every other process of the sandbox (PID 1's ``kill(-1)`` reaches exactly
   the namespace), empties the scratch directory, and writes one JSON line per event to stdout:
   ``{"protections": [...], "cgroup": path}`` first, then ``{"start": i, "pgid": g}`` and
   ``{"test": i, "status": ..., ...}`` per test, or ``{"compile_error": msg}``.

Expected outputs never enter the sandbox: the parent compares them with what the tests wrote.
"""

import json
import os
import resource
import select
import shutil
import signal
import sys
import time
import traceback

sys.path.insert(0, os.getcwd())  # -I leaves the script's directory out; the two modules beside it
import sandbox_confine
import sandbox_seccomp

del sys.path[0]  # nothing else is imported from the working directory

PR_SET_PDEATHSIG = 1
# Audit events the guard refuses outright: process creation, signals to other processes, sockets,
# native code, raising limits.
BLOCKED_EVENT_PREFIXES = (
    "socket.", "ctypes.", "subprocess.", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
    "os.system", "os.kill", "os.killpg", "signal.pthread_kill", "signal.pidfd_send_signal",
    "resource.setrlimit", "resource.prlimit", "sys.remote_exec",
)  # fmt: skip
BLOCKED_MODULES = ("_posixsubprocess", "_ctypes", "ctypes")
# Audit events whose first (or first two) path arguments must stay inside the scratch directory.
PATH_EVENTS = {
    "os.chmod": 1, "os.chown": 1, "os.link": 2, "os.mkdir": 1, "os.remove": 1, "os.rename": 2,
    "os.rmdir": 1, "os.symlink": 2, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
}  # fmt: skip
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def confine(job, lib):
    """Isolate (see the module docs); return the protections in force, the memory cgroup (or None)
    and the open files of every test (see :func:`open_test_files`)."""
    n = job["num_tests"]
    files_needed = 4 * n + 32
    if files_needed > resource.getrlimit(resource.RLIMIT_NOFILE)[1] and os.geteuid() != 0:
        raise OSError(f"{n} tests need {files_needed} open files, over this user's RLIMIT_NOFILE")
    resource.setrlimit(resource.RLIMIT_NOFILE, (files_needed, files_needed))
    files = open_test_files(n)
    cpu_total = int(n * (int(job["time_limit_s"]) + 2) + 10)
    limits = [
        (resource.RLIMIT_AS, job["memory_bytes"]),
        (resource.RLIMIT_FSIZE, job["file_bytes"]),
        (resource.RLIMIT_CPU, cpu_total),
        (resource.RLIMIT_CORE, 0),
    ]
    protections = ["rlimit_cpu", "rlimit_as", "rlimit_fsize", "wall_clock_kill"]
    cgroup = None
    if job["isolation"] == "full":
        more, cgroup = sandbox_confine.isolate(lib, job)
        # The sandbox's uid is its own (or its user namespace's), so the budget is exact; PID 1 is
        # not counted against it.
        limits.append((resource.RLIMIT_NPROC, job["max_processes"] + 1))
        protections += [*more, "rlimit_nproc", "namespace_kill"]
        files.append(os.open("/tmp", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    else:
        os.mkdir("scratch", 0o700)
        files.append(os.open("scratch", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        if os.geteuid() != 0:
            # RLIMIT_NPROC counts every process of the real uid, so the budget goes on top of the
            # processes this user already has.
            limits.append((resource.RLIMIT_NPROC, count_user_tasks(os.getuid()) + job["max_processes"]))
            protections.append("rlimit_nproc_approx")
        protections += ["weak_isolation", "process_group_kill"]
    for which, value in limits:
        resource.setrlimit(which, (value, value))
    sandbox_confine.call(lib.prctl, PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0, what="prctl(PDEATHSIG)")
    if job["isolation"] == "full":
        sandbox_seccomp.install(lib)
        protections.append("seccomp_filter")
    if job["guard"]:
        protections.append("python_audit_guard")
    return protections, cgroup, files


def open_test_files(n):
    """Per test ``(stdin, stdout, stderr, result)`` descriptors.

    Opened before confinement, so the program needs no access to the working directory: with
    full isolation the files belong to the harness's user (mode 0600) outside the sandbox's root,
    and a test can write only through the descriptors it is handed.
    """
    create = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    files = []
    for i in range(n):
        stdin = os.open(f"in/{i}", os.O_RDONLY | os.O_CLOEXEC)
        files.append((stdin, *(os.open(f"{d}/{i}", create, 0o600) for d in ("out", "err", "res"))))
    return files


def count_user_tasks(uid):
    """Tasks (threads included, as RLIMIT_NPROC counts them) whose real uid is ``uid``."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                total += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return total


def install_guard(workdir):
    """Refuse, from Python, what a scored program has no business doing (see the module docs).

    The hook keeps its own copies of the rules and helpers, so replacing the module's globals (or
    ``os.path.realpath``) no longer switches it off. It is still only a second layer: a program can
    get past an audit hook, and with full isolation that gains it nothing."""
    prefix = workdir.rstrip("/") + "/"
    blocked_events, blocked_modules = tuple(BLOCKED_EVENT_PREFIXES), frozenset(BLOCKED_MODULES)
    path_events, write_flags = dict(PATH_EVENTS), WRITE_FLAGS
    realpath, fsdecode = os.path.realpath, os.fsdecode

    def inside(path):
        if isinstance(path, int):
            return True
        try:
            real = realpath(fsdecode(path))
        except (TypeError, ValueError):
            return False
        return real == workdir or real.startswith(prefix)

    def hook(event, args):
        if event.startswith(blocked_events):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in blocked_modules:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in path_events:
            for path in args[: path_events[event]]:
                if not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the working directory")

    sys.addaudithook(hook)


def sweep(full, pgid):
    """Kill everything the test left behind: every other process of the sandbox's PID namespace
    (this is its PID 1, so ``kill(-1)`` reaches exactly those), or with weak isolation its group."""
    if not full:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        reap()
        return
    if os.getpid() != 1:
        raise OSError("refusing kill(-1) outside the sandbox's PID namespace")
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:  # nothing was left
        return
    while True:  # orphans come to PID 1: wait until every killed process is gone
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def clear_scratch():
    """Empty the current directory (scratch), so each test starts with nothing left by the last."""
    for entry in os.scandir("."):
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.name, ignore_errors=True)
            else:
                os.unlink(entry.name)
        except OSError:  # a file made unremovable: it stays, bounded like the rest of scratch
            pass


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def wait_child(pid, limit_s):
    """Wait up to ``limit_s`` seconds for ``pid``; return its wait status, or None on timeout."""
    deadline = time.monotonic() + limit_s
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if fd is not None:
                select.select([fd], [], [], left)
            else:
                time.sleep(min(left, 0.002))
    finally:
        if fd is not None:
            os.close(fd)


def run_child(job, code, i, files):
    """In the forked child: take this test's files and limits, then run the untrusted code."""
    os.setpgid(0, 0)
    sandbox_confine.libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; output past the cap ends the test
    cpu = max(1, int(job["time_limit_s"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    call = job["fn_name"] is not None
    os.fchdir(files[-1])
    args = None
    if call:
        with os.fdopen(os.dup(files[i][0]), encoding="utf-8") as f:
            args = json.load(f)
    stdin = os.open(os.devnull, os.O_RDONLY) if call else files[i][0]
    for fd, target in ((stdin, 0), (files[i][1], 1), (files[i][2], 2), (files[i][3], 3)):
        os.dup2(fd, target)  # dup2 clears close-on-exec on the copy, which the program may rely on
    os.closerange(4, 4 * job["num_tests"] + 32)  # every other test's files, and the harness's
    nofile = min(64, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    result_file = os.fdopen(3, "w", encoding="utf-8") if call else None
    if not call:
        os.close(3)
    if job["guard"]:
        install_guard(os.getcwd())
    status = 0
    namespace = {"__name__": "__solution__" if call else "__main__", "__file__": "solution.py"}
    try:
        exec(code, namespace)
        if call:
            value = call_function(namespace, job["fn_name"], args)
            json.dump(value, result_file, default=repr)
            result_file.close()
    except SystemExit as exc:
        # sys.exit(256) must not read as success once the kernel keeps only the low 8 bits.
        exit_code = exc.code
        if exit_code is None or exit_code == 0:
            status = 0
        else:
            status = exit_code if isinstance(exit_code, int) and 0 < exit_code < 256 else 1
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # output over the cap (with SIGXFSZ ignored again), or a closed stdout
        status = status or 1
    os._exit(status)


def call_function(namespace, fn_name, args):
    """Call ``fn_name`` (a top-level function, or a method of LeetCode's ``class Solution``)."""
    fn = namespace.get(fn_name)
    if fn is None and isinstance(namespace.get("Solution"), type):
        fn = getattr(namespace["Solution"](), fn_name, None)
    if not callable(fn):
        raise NameError(f"the program defines no function {fn_name!r}")
    return fn(*args)


def describe(status, timed_out):
    if timed_out:
        return {"status": "timeout"}
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        names = {signal.SIGXCPU: "timeout", signal.SIGXFSZ: "output_limit", signal.SIGKILL: "killed"}
        return {"status": names.get(sig, "crashed"), "signal": sig}
    code = os.WEXITSTATUS(status)
    return {"status": "ok" if code == 0 else "error", "exit": code}


def emit(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main():
    with open("job.json", encoding="utf-8") as f:
        job = json.load(f)
    with open("solution.py", encoding="utf-8", errors="replace") as f:
        source = f.read()
    try:
        protections, cgroup, files = confine(job, sandbox_confine.libc())
    except OSError as exc:
        emit({"setup_error": f"{type(exc).__name__}: {exc}"})
        return
    emit({"protections": protections, "cgroup": cgroup})
    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        emit({"compile_error": f"{type(exc).__name__}: {exc}"})
        return
    full = job["isolation"] == "full"
    if not full:
        run_tests(job, code, files, full)
        return
    sys.stdout.flush()
    init = os.fork()  # PID 1 of the sandbox: when it ends, the kernel kills every process left
    if init == 0:
        code_ = 1
        try:
            sandbox_confine.call(
                sandbox_confine.libc().prctl,
                PR_SET_PDEATHSIG,
                signal.SIGKILL,
                0,
                0,
                0,
                what="prctl(PDEATHSIG)",
            )
            run_tests(job, code, files, full)
            code_ = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            os._exit(code_)
    _, status = os.waitpid(init, 0)
    if os.WIFSIGNALED(status):
        # PID 1 was killed (the memory cgroup's OOM killer may pick it): die the same way, so the
        # parent scores the tests without a result as failed instead of calling the sandbox broken.
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status))


def run_tests(job, code, files, full):
    os.fchdir(files[-1])  # the harness needs nothing else by name from here on
    for i in range(job["num_tests"]):
        start = time.monotonic()
        sys.stdout.flush()
        try:
            pid = os.fork()
        except OSError as exc:  # the process budget is used up
            emit({"test": i, "status": "crashed", "error": str(exc)})
            continue
        if pid == 0:
            run_child(job, code, i, files)
        try:
            os.setpgid(pid, pid)  # also done by the child; whichever runs first wins the race
        except OSError:
            pass
        emit({"start": i, "pgid": pid})
        status = wait_child(pid, job["time_limit_s"])
        timed_out = status is None
        if timed_out:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        sweep(full, pid)
        clear_scratch()
        emit({"test": i, "seconds": round(time.monotonic() - start, 4), **describe(status, timed_out)})
        if timed_out:
            break  # the rest would most likely time out too, each costing a full limit


if __name__ == "__main__":
    main()
