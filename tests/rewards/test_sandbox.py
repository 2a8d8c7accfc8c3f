"""The code sandbox's limits: hostile programs are contained, scored as failures, and leave nothing
behind.

Each hostile program runs twice: with the Python guard (the audit hook refuses the act) and without
it (only the operating system's isolation stands: namespaces, uid, rlimits, seccomp). The fork bomb
is bounded by RLIMIT_NPROC (8 tasks) and a 1 s wall clock, so it cannot take the machine down; a
smaller bomb is tested first. Isolation itself (what a program can see and reach) is tested in
``test_sandbox_isolation.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from tearless.rewards.sandbox import UID_BASE, SandboxError, SandboxLimits, run_in_sandbox

ROOT = os.geteuid() == 0
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
GUARDS = [pytest.param(True, id="guard"), pytest.param(False, id="os-only")]


HARNESS_PIDS: list[int] = []  # the harness processes this session's sandbox runs started


@pytest.fixture(autouse=True)
def record_harness_pids(monkeypatch):
    """Record the pid of every harness the sandbox starts: in root mode its programs run as
    ``UID_BASE + harness pid``, so those uids are this session's, whatever else runs on the machine
    (another test session's sandboxes have uids of their own)."""
    real = subprocess.Popen

    class Recording(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            HARNESS_PIDS.append(self.pid)

    monkeypatch.setattr(subprocess, "Popen", Recording)


def live_sandbox_processes() -> list[int]:
    """Pids of running (not zombie) processes owned by the sandbox uids of this session's runs."""
    ours = {UID_BASE + pid for pid in HARNESS_PIDS}
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid not in ours:
                continue
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            pids.append(int(pid))
    return pids


def run(source: str, *, guard: bool, time_limit_s: float = 1.0, inputs=("",), **limits):
    start = time.monotonic()
    result = run_in_sandbox(
        textwrap.dedent(source), list(inputs), limits=SandboxLimits(time_limit_s, guard=guard, **limits)
    )
    return result, time.monotonic() - start


def assert_unharmed(elapsed: float, bound: float) -> None:
    assert elapsed < bound, f"took {elapsed:.1f}s"
    if ROOT:
        assert HARNESS_PIDS, "no sandbox harness was recorded: the check below would be vacuous"
        assert live_sandbox_processes() == []


def test_a_correct_program_passes_with_stdin_and_stdout():
    result, _ = run(
        """
        import heapq, sys
        n = int(input())
        print(sum(map(int, sys.stdin.read().split())) * n)
        """,
        guard=True,
        inputs=["2\n1 2 3\n", "3\n4"],
    )
    assert [r.status for r in result.runs] == ["ok", "ok"]
    assert [r.output for r in result.runs] == ["12\n", "12\n"]
    expected = {"rlimit_cpu", "rlimit_as", "rlimit_fsize", "python_audit_guard", "pid_namespace"}
    expected |= {"network_namespace", "read_only_root", "rlimit_nproc", "namespace_kill", "seccomp_filter"}
    expected.add("unprivileged_uid" if ROOT else "user_namespace")
    assert expected <= set(result.protections)


def test_function_calls_and_a_compile_error():
    result = run_in_sandbox(
        "class Solution:\n    def pair(self, a, b):\n        return (a + b, [a, b])\n",
        [[1, 2], [3, 4]],
        fn_name="pair",
    )
    assert [r.output for r in result.runs] == ["[3, [1, 2]]", "[7, [3, 4]]"]
    broken = run_in_sandbox("def f(:\n", ["x"])
    assert broken.compile_error.startswith("SyntaxError")
    assert broken.runs[0].status == "skipped"


@pytest.mark.parametrize("guard", GUARDS)
def test_an_infinite_loop_times_out_and_ends_the_sample(guard):
    result, elapsed = run("while True:\n    pass\n", guard=guard, time_limit_s=0.5, inputs=["", ""])
    assert [r.status for r in result.runs] == ["timeout", "skipped"]
    assert_unharmed(elapsed, 5.0)


@pytest.mark.parametrize("guard", GUARDS)
def test_a_10_gb_allocation_fails(guard):
    result, elapsed = run("x = bytearray(10 * 1024**3)\nprint(len(x))\n", guard=guard)
    assert result.runs[0].status == "error"
    assert "MemoryError" in result.runs[0].stderr
    assert_unharmed(elapsed, 5.0)


@pytest.mark.parametrize("guard", GUARDS)
def test_writing_outside_the_working_directory_fails(guard, tmp_path):
    targets = [
        f"/tmp/tearless-escape-{uuid.uuid4().hex}",
        str(tmp_path / "escape"),
        "/dev/shm/tearless-escape",
    ]
    result, elapsed = run(
        f"""
        import os
        open("inside.txt", "w").write("fine")
        for path in {targets!r}:
            try:
                with open(path, "w") as f:
                    f.write("escaped")
                print("escaped", path)
            except OSError as exc:
                print("blocked", type(exc).__name__)
        fd = os.open({targets[1]!r}, os.O_WRONLY | os.O_CREAT)
        """,
        guard=guard,
    )
    assert result.runs[0].status == "error"  # the last os.open raised
    assert not any(os.path.exists(p) for p in targets)
    assert_unharmed(elapsed, 5.0)


@pytest.mark.parametrize("guard", GUARDS)
def test_opening_a_socket_fails(guard):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    port = server.getsockname()[1]
    with server:
        result, elapsed = run(
            f"""
            import socket
            s = socket.create_connection(("127.0.0.1", {port}), timeout=1)
            s.sendall(b"escaped")
            print("connected")
            """,
            guard=guard,
        )
        with pytest.raises(TimeoutError):
            server.accept()
    assert result.runs[0].status == "error"
    assert ("PermissionError" if guard else "Network is unreachable") in result.runs[0].stderr
    assert_unharmed(elapsed, 5.0)


def test_a_small_fork_bomb_is_refused_by_the_guard():
    source = """
        import os
        for _ in range(3):
            try:
                os.fork()
            except PermissionError:
                print("refused")
        """
    result, elapsed = run(source, guard=True)
    assert result.runs[0].output == "refused\n" * 3
    assert_unharmed(elapsed, 5.0)


def test_a_small_fork_bomb_without_the_guard_is_capped_by_rlimit_nproc():
    # 3 doublings want 8 test processes; with the harness the budget of 8 tasks leaves room for 7
    # (the sandbox's PID 1 is not counted).
    source = """
        import os, time
        for _ in range(3):
            try:
                os.fork()
            except OSError:
                print("refused", flush=True)
        time.sleep(0.3)
        """
    result, elapsed = run(source, guard=False, max_processes=8)
    assert "refused" in result.runs[0].output
    assert_unharmed(elapsed, 5.0)


def test_a_fork_bomb_without_the_guard_is_contained():
    source = """
        import os
        while True:
            try:
                if os.fork() == 0:
                    os.setsid()  # leave the process group: only the PID namespace holds these
            except OSError:
                pass
        """
    result, elapsed = run(source, guard=False, inputs=["", ""], max_processes=8)
    assert [r.status for r in result.runs] == ["timeout", "skipped"]
    assert_unharmed(elapsed, 8.0)


def test_a_program_cannot_kill_the_harness_and_its_processes_die_with_the_sample():
    source = """
        import os, signal, time
        if os.fork() == 0:
            os.setsid()
            time.sleep(30)
        time.sleep(0.1)
        os.kill(os.getppid(), signal.SIGKILL)  # the sandbox's PID 1: the kernel ignores it
        os.kill(-1, signal.SIGTERM)  # every process it may signal but itself: only the sandbox's own
        print("still here")
        """
    result, elapsed = run(source, guard=False, time_limit_s=1.0, inputs=["", ""])
    assert [(r.status, r.output) for r in result.runs] == [("ok", "still here\n")] * 2
    assert_unharmed(elapsed, 5.0)


def test_the_program_writes_only_to_a_small_private_scratch():
    source = """
        import os, shutil
        print(shutil.disk_usage(".").total, os.listdir("."))
        try:
            for i in range(100):
                with open(f"f{i}", "wb") as f:
                    f.write(b"x" * 300_000)
        except OSError as exc:
            print("full after", i, "files")
        for path in ["/out/1", "/in/1", "/job.json", "../escape"]:
            try:
                open(path, "a").close()
                print("opened", path)
            except OSError:
                print("refused", path)
        """
    result, elapsed = run(source, guard=False, inputs=["", ""], file_size_mb=1)
    lines = result.runs[0].output.splitlines()
    # An empty tmpfs of file_size_mb, but for the interpreter's directories when they live under /tmp
    # (a fresh clone's venv in a mktemp -d directory): they are bound read-only at their own path.
    interpreter = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    mounted = sorted({p.split("/")[2] for p in map(os.path.realpath, interpreter) if p.startswith("/tmp/")})
    assert lines[0] == f"{1 << 20} {mounted}"
    assert lines[1] == "full after 3 files"
    assert lines[2:] == ["refused /out/1", "refused /in/1", "refused /job.json", "refused ../escape"]
    assert result.runs[1].output == result.runs[0].output  # the first test's files were removed
    assert_unharmed(elapsed, 5.0)


@pytest.mark.skipif(not ROOT, reason="the memory cgroup needs root")
def test_memory_summed_over_processes_is_capped_by_the_cgroup():
    # Each of 4 children touches 150 MiB, under the 200 MiB address-space limit of each; the sample's
    # cgroup holds 200 + 16 (scratch) + 16 (/dev/shm) + 64 MiB margin = 296 MiB, so at most one
    # child's worth fits beside the others and the OOM killer ends the rest (or the parent).
    source = """
        import os
        pids = []
        for _ in range(4):
            pid = os.fork()
            if pid == 0:
                block = bytearray(150 << 20)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                os._exit(0)
            pids.append(pid)
        print(sum(os.waitpid(p, 0)[1] == 0 for p in pids), "of 4 children filled their memory")
        """
    result, elapsed = run(source, guard=False, time_limit_s=5.0, memory_mb=200)
    if "cgroup_memory" not in result.protections:
        pytest.skip("this kernel offers no memory cgroup to the sandbox")
    run_ = result.runs[0]
    assert run_.status == "killed" or int(run_.output.split()[0]) < 4, run_
    assert_unharmed(elapsed, 10.0)


def test_output_is_capped_and_the_working_directory_removed():
    result, elapsed = run("while True:\n    print('x' * 1000)\n", guard=True, file_size_mb=1)
    assert result.runs[0].status == "output_limit"
    assert_unharmed(elapsed, 5.0)
    before = set(os.listdir(tempfile.gettempdir()))
    result, _ = run("import os\nprint(os.getcwd())\n", guard=True)
    assert result.runs[0].output == "/tmp\n"  # its own scratch; the working directory is outside
    left = {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("tearless-sandbox-")}
    assert left == set()


def test_limits_are_checked():
    with pytest.raises(ValueError, match="memory_mb must be at least 64"):
        SandboxLimits(memory_mb=8)
    with pytest.raises(ValueError, match="time_limit_s"):
        SandboxLimits(time_limit_s=0)


NON_ROOT_SCRIPT = """
import json, os, sys
sys.path.insert(0, {repo!r})
import tearless.rewards.sandbox as sandbox


def stat(pid):
    return open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()


def running():  # this uid's live processes (without root: the user's others too, hence before/after)
    found = set()
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{{p}}").st_uid == os.getuid() and stat(p)[0] not in "ZX":
                found.add(p)
        except OSError:
            continue
    return found


before = running()
limits = sandbox.SandboxLimits(time_limit_s=1.0)
ok = sandbox.run_in_sandbox("print(int(input()) * 2)", ["21"], limits=limits)
bomb = sandbox.run_in_sandbox(
    "import os\\nwhile True:\\n    try:\\n        if os.fork() == 0: os.setsid()\\n"
    "    except OSError: pass\\n",
    ["", ""],
    limits=sandbox.SandboxLimits(time_limit_s=1.0, guard=False),
)
left = sorted(running() - before)
print(json.dumps({{
    "protections": ok.protections, "ok": [ok.runs[0].status, ok.runs[0].output],
    "bomb": [r.status for r in bomb.runs], "left": left,
}}))
"""


def test_without_root_the_limits_hold_in_a_user_namespace(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "non_root.py"
    script.write_text(NON_ROOT_SCRIPT.format(repo=repo))
    helper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "as_user.py")
    command = [sys.executable, helper, str(script)] if ROOT else [sys.executable, str(script)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd="/tmp")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"user_namespace", "pid_namespace", "rlimit_nproc", "seccomp_filter"} <= set(report["protections"])
    assert report["ok"] == ["ok", "42\n"]
    assert report["bomb"] == ["timeout", "skipped"] and report["left"] == []


def test_a_broken_setup_is_an_error_not_a_zero(monkeypatch):
    monkeypatch.setattr("tearless.rewards.sandbox.sys.executable", "/bin/false")
    with pytest.raises(SandboxError, match="could not start"):
        run_in_sandbox("print(1)", [""])
