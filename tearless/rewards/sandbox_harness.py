"""The program that runs inside the code sandbox (a script: standard library only, never imported).

:mod:`tearless.rewards.sandbox` copies this file into a fresh working directory holding
``job.json``, ``solution.py``, one input file per test (``in/<i>``) and empty ``out``, ``err``,
``res`` and ``scratch`` directories, and starts it as ``python -I -B sandbox_harness.py`` there.
The harness

1. confines itself (:func:`confine`): as root, private mount and network namespaces, a size-capped
   tmpfs on ``scratch``, then a fresh unprivileged uid; resource limits in every case. Before
   dropping root it opens every file a test will use (:func:`open_test_files`), so the program
   needs, and gets, no access to the working directory itself;
2. compiles ``solution.py`` once;
3. runs each test in a forked child (:func:`run_child`) with its own CPU and wall-clock limit: stdin
   from ``in/<i>``, stdout to ``out/<i>`` and stderr to ``err/<i>`` (RLIMIT_FSIZE caps both), for
   function-call tests the JSON of the return value on fd 3 (``res/<i>``), ``scratch`` as its
   current directory, and the audit-hook guard (:func:`install_guard`) installed before the
   untrusted code runs;
4. after each test kills whatever the test left running, empties ``scratch``, and writes one JSON
   line per event to stdout: ``{"protections": [...]}`` first, then ``{"start": i, "pgid": g}`` and
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

UID_BASE = 0x40000000  # sandbox uid = UID_BASE + harness pid: unique while the harness lives
CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
# Shared world-writable directories: each is covered by an empty root-owned tmpfs in the namespace.
SHARED_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
# Audit events the guard refuses outright: process creation, signals to other processes, sockets,
# native code, raising limits.
BLOCKED_EVENT_PREFIXES = (
    "socket.", "ctypes.", "subprocess.", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
    "os.system", "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit",
    "sys.remote_exec",
)  # fmt: skip
BLOCKED_MODULES = ("_posixsubprocess", "_ctypes", "ctypes")
# Audit events whose first (or first two) path arguments must stay inside the scratch directory.
PATH_EVENTS = {
    "os.chmod": 1, "os.chown": 1, "os.link": 2, "os.mkdir": 1, "os.remove": 1, "os.rename": 2,
    "os.rmdir": 1, "os.symlink": 2, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
}  # fmt: skip
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def check(result, what):
    if result != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def confine(job):
    """Apply the isolation the job asks for; return the protections in force, a libc handle and
    the open files of every test (see :func:`open_test_files`).

    Privileged (the parent is root): private mount and network namespaces where the kernel allows
    them, then a uid of its own (so RLIMIT_NPROC applies and file permissions keep it out of
    everything it does not own). Otherwise resource limits only.
    """
    workdir = os.getcwd()
    n = job["num_tests"]
    cpu_total = int(n * (int(job["time_limit_s"]) + 2) + 10)
    limits = [
        (resource.RLIMIT_AS, job["memory_bytes"]),
        (resource.RLIMIT_FSIZE, job["file_bytes"]),
        (resource.RLIMIT_CPU, cpu_total),
        (resource.RLIMIT_CORE, 0),
    ]
    protections = ["rlimit_cpu", "rlimit_as", "rlimit_fsize", "wall_clock_kill", "process_group_kill"]
    lib = libc()
    files_needed = 4 * n + 32
    if files_needed > resource.getrlimit(resource.RLIMIT_NOFILE)[1] and not job["privileged"]:
        raise OSError(f"{n} tests need {files_needed} open files, over this user's RLIMIT_NOFILE")
    resource.setrlimit(resource.RLIMIT_NOFILE, (files_needed, files_needed))
    if not job["privileged"]:
        # RLIMIT_NPROC counts every process of the real uid, so the budget goes on top of the
        # processes this user already has.
        limits.append((resource.RLIMIT_NPROC, count_user_tasks(os.getuid()) + job["max_processes"]))
        for which, value in limits:
            resource.setrlimit(which, (value, value))
        protections.append("rlimit_nproc_approx")
        return finish(job, protections, lib, open_test_files(n))
    uid = UID_BASE + os.getpid()
    try:
        check(lib.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare(mount, network namespaces)")
    except OSError as exc:  # a container without CAP_SYS_ADMIN: the uid switch still works
        protections.append(f"no_namespaces ({exc})")
    else:
        check(lib.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
        opts = f"size={job['file_bytes']},nr_inodes=1024,mode=0700,uid={uid},gid={uid}".encode()
        check(lib.mount(b"tmpfs", b"scratch", b"tmpfs", MS_NOSUID | MS_NODEV, opts), "tmpfs scratch")
        cover_and_expose(lib, [*job["expose"], workdir])
        os.chdir(workdir)  # the bind mount now at that path, not the covered original
        protections += ["network_namespace", "private_mounts", "scratch_tmpfs"]
    files = open_test_files(n)
    os.chown(files[-1], uid, uid)  # scratch (the tmpfs already belongs to uid; a plain directory not)
    limits.append((resource.RLIMIT_NPROC, job["max_processes"]))
    for which, value in limits:
        resource.setrlimit(which, (value, value))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getuid() == 0 or os.geteuid() == 0 or os.getgid() == 0:
        raise OSError("the sandbox is still root after setresuid")
    unreachable = [p for p in job["expose"] if not os.access(p, os.R_OK | os.X_OK)]
    if unreachable:
        raise OSError(f"the sandbox uid cannot read the interpreter's directories {unreachable}")
    protections += ["unprivileged_uid", "rlimit_nproc", "uid_sweep"]
    return finish(job, protections, lib, files)


def finish(job, protections, lib, files):
    check(lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    check(lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if job["guard"]:
        protections.append("python_audit_guard")
    return protections, lib, files


def open_test_files(n):
    """Per test ``(stdin, stdout, stderr, result)`` descriptors, then the scratch directory's.

    Opened before privileges drop: as root the files belong to root (mode 0600), so a test can
    write only through the descriptors it is handed, never another test's files by name.
    """
    create = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    files = []
    for i in range(n):
        stdin = os.open(f"in/{i}", os.O_RDONLY | os.O_CLOEXEC)
        files.append((stdin, *(os.open(f"{d}/{i}", create, 0o600) for d in ("out", "err", "res"))))
    files.append(os.open("scratch", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    return files


def cover_and_expose(lib, needed):
    """Hide shared writable directories, and directories others cannot enter, behind empty tmpfs
    mounts owned by root (mode 0755, so the sandbox uid cannot write there), then bind each
    ``needed`` directory back at its own path.

    The interpreter may live under ``/root`` (mode 0700), which the sandbox uid could not enter; the
    working directory lives under ``/tmp``. Both stay reachable; nothing else in those trees does.
    """
    needed = sorted({os.path.realpath(p) for p in needed if os.path.isdir(p)})
    needed = [p for p in needed if not any(p.startswith(q + "/") for q in needed)]
    covers = {d for d in SHARED_WRITABLE if os.path.isdir(d) and not os.path.islink(d)}
    for path in needed:
        parts = path.split("/")
        for depth in range(2, len(parts)):
            ancestor = "/".join(parts[:depth])
            if not os.stat(ancestor).st_mode & 0o001:
                covers.add(ancestor)
                break
    covers = sorted(c for c in covers if not any(c.startswith(o + "/") for o in covers))
    # Handles opened before covering: binding from /proc/self/fd/N reaches the hidden originals.
    handles = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in needed}
    for cover in covers:
        opts = b"mode=0755,size=1m,nr_inodes=1024"
        check(lib.mount(b"tmpfs", cover.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts), f"tmpfs {cover}")
        for path, fd in handles.items():
            if path.startswith(cover + "/"):
                os.makedirs(path, exist_ok=True)
                src = f"/proc/self/fd/{fd}".encode()
                check(lib.mount(src, path.encode(), None, MS_BIND | MS_REC, None), f"bind {path}")
    for fd in handles.values():
        os.close(fd)


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
    """Refuse, from Python, what a scored program has no business doing (see the module docs)."""
    prefix = workdir.rstrip("/") + "/"

    def inside(path):
        if isinstance(path, int):
            return True
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return real == workdir or real.startswith(prefix)

    def hook(event, args):
        if event.startswith(BLOCKED_EVENT_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in BLOCKED_MODULES:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS
            )
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in PATH_EVENTS:
            for path in args[: PATH_EVENTS[event]]:
                if not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the working directory")

    sys.addaudithook(hook)


def sweep(privileged, pgid):
    """Kill everything the test left behind: all processes of the sandbox uid, or its group."""
    if not privileged:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    if os.getuid() < UID_BASE or os.geteuid() < UID_BASE:
        raise OSError("refusing kill(-1) as a uid that is not a sandbox uid")
    # kill(-1) signals every process of this uid but the caller in one pass under the kernel's
    # task-list lock, and a process with SIGKILL pending cannot finish a fork, so one pass gets
    # them all; the second covers a fork that completed just before the first. (Its return value
    # says nothing: it succeeds whenever any other process exists on the machine.)
    for _ in range(2):
        os.kill(-1, signal.SIGKILL)
        reap()


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


def run_child(job, code, i, lib, files):
    """In the forked child: take this test's files and limits, then run the untrusted code."""
    os.setpgid(0, 0)
    lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
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
        protections, lib, files = confine(job)
    except OSError as exc:
        emit({"setup_error": f"{type(exc).__name__}: {exc}"})
        return
    emit({"protections": protections})
    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        emit({"compile_error": f"{type(exc).__name__}: {exc}"})
        return
    privileged = job["privileged"]
    os.fchdir(files[-1])  # the harness needs nothing else by name from here on
    for i in range(job["num_tests"]):
        start = time.monotonic()
        sys.stdout.flush()
        try:
            pid = os.fork()
        except OSError as exc:  # the process budget is used up by something that escaped a sweep
            emit({"test": i, "status": "crashed", "error": str(exc)})
            continue
        if pid == 0:
            run_child(job, code, i, lib, files)
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
        sweep(privileged, pid)
        clear_scratch()
        emit({"test": i, "seconds": round(time.monotonic() - start, 4), **describe(status, timed_out)})
        if timed_out:
            break  # the rest would most likely time out too, each costing a full limit


if __name__ == "__main__":
    main()
