"""Hostile programs for the code sandbox, and a runner that reports what each one achieved.

Each attack is a program that prints ``ESCAPED <what>`` for every step that reached something
outside the sandbox, ``BLOCKED <step>: <why>`` for every step that failed, and ``DID <what>`` for
what it may do inside (create a System V segment, fork a daemon); after each sample the host checks
that nothing of it reached or outlived the sandbox (a file that must not exist, a process that must
still run, a connection that must not arrive, a segment or process that must be gone).
``run_attacks`` runs them all, with the guard on, off, and switched off by the program itself, and
returns a JSON-able report, so the same code runs as root and, from ``tests/rewards/as_user.py``, as
an unprivileged user. RELIABILITY.md counts them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

# The first lines of every attack program: a step helper, and (in the "switched-off" variant) the
# switch-off itself. The harness's guard reads module globals of ``__main__``; replacing them is the
# one-assignment switch-off found on main. It must gain nothing.
PRELUDE = """
import os, sys
def step(name, fn):
    try:
        got = fn()
        print("ESCAPED", name, repr(got)[:80], flush=True)
    except BaseException as exc:
        print("BLOCKED", name + ":", type(exc).__name__, str(exc)[:80], flush=True)
def act(name, fn):  # allowed inside the sandbox; the host checks that nothing of it outlives the sample
    fn()
    print("DID", name, flush=True)
"""
SWITCH_OFF = """
main = sys.modules["__main__"]
for attr in ("BLOCKED_EVENT_PREFIXES", "BLOCKED_MODULES"):
    if hasattr(main, attr):
        setattr(main, attr, ("nothing-is-blocked",))
if hasattr(main, "PATH_EVENTS"):
    main.PATH_EVENTS = {}
if hasattr(main, "WRITE_FLAGS"):
    main.WRITE_FLAGS = 0
"""
LIBC = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def sys_call(*args):
    r = libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    if r == -1:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return r
"""

# name -> program body; <<fact>> stands for repr(fact) (the host's paths, pids, ports)
ATTACKS = {
    # Issue 24, item 1: find the trainer's command line in /proc and read the data file it names.
    "forge_from_proc": """
def scan():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read()
        except OSError:
            continue
        if b"data.train_files=" in line:
            return line
    raise LookupError("no trainer found")
step("read other processes' command lines", scan)
step("read the data file by its path", lambda: open(<<secret>>).read())
step("list the host's /tmp", lambda: os.listdir(<<secret_dir>>))
step("read /etc/passwd", lambda: open("/etc/passwd").read(40))
step("list the trainer's working directory", lambda: os.listdir(<<cwd>>))
step("list /home", lambda: os.listdir("/home"))
""",
    "write_outside": """
step("write the host's /tmp", lambda: open(<<escape>>, "w").write("x"))
step("write the interpreter's folder", lambda: open(os.path.join(<<prefix>>, "planted.py"), "w").write("x"))
step("write /", lambda: open("/planted", "w").write("x"))
""",
    "host_unix_socket": """
import socket
def connect(address):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(address)
    s.sendall(b"escaped")
    return address
step("connect to a host unix socket", lambda: connect(<<unix_path>>))
step("connect to a host abstract socket", lambda: connect(<<abstract>>))
""",
    "network": """
import socket
step("connect to the host's TCP port", lambda: socket.create_connection(("127.0.0.1", <<port>>), timeout=1))
step("resolve a name", lambda: socket.getaddrinfo("example.com", 80))
""",
    "sysv_shm": LIBC
    + """
IPC_CREAT, IPC_PRIVATE = 0o1000, 0
def segment():
    libc.shmget.restype = ctypes.c_int
    shmid = libc.shmget(0x7E57, ctypes.c_size_t(256 << 20), IPC_CREAT | 0o666)
    if shmid < 0:
        raise OSError(ctypes.get_errno(), "shmget")
    return shmid
act("create a 256 MiB System V segment (key 0x7e57)", segment)
""",
    "namespaces_and_mounts": LIBC
    + """
NR = {"x86_64": dict(unshare=272, setns=308, mount=165, ptrace=101, keyctl=250, bpf=321, pidfd_open=434,
       pidfd_send_signal=424, clone=56, personality=135),
      "aarch64": dict(unshare=97, setns=268, mount=40, ptrace=117, keyctl=219, bpf=280, pidfd_open=434,
       pidfd_send_signal=424, clone=220, personality=92)}[os.uname().machine]
step("unshare(CLONE_NEWUSER)", lambda: sys_call(NR["unshare"], 0x10000000))
step("unshare(CLONE_NEWNS)", lambda: sys_call(NR["unshare"], 0x00020000))
step("clone(CLONE_NEWUSER)", lambda: sys_call(NR["clone"], 0x10000000 | 17, 0, 0, 0, 0))
step("mount a tmpfs", lambda: sys_call(NR["mount"], b"none", b"/tmp", b"tmpfs", 0, 0))
step("ptrace(ATTACH, 1)", lambda: sys_call(NR["ptrace"], 16, 1, 0, 0))
step("keyctl(GET_KEYRING_ID)", lambda: sys_call(NR["keyctl"], 0, -3, 0))
step("bpf(MAP_CREATE)", lambda: sys_call(NR["bpf"], 0, 0, 0))
step("personality(READ_IMPLIES_EXEC)", lambda: sys_call(NR["personality"], 0x0400000))
step("x32/i386 ABI", lambda: sys_call(0x40000000 | 39) if os.uname().machine == "x86_64" else 1 / 0)
""",
    "signals": LIBC
    + """
import signal
NR = dict(pidfd_open=434, pidfd_send_signal=424)  # the same on x86_64 and aarch64
step("kill the host's process", lambda: os.kill(<<victim>>, signal.SIGKILL))
step("pidfd_open the host's process", lambda: sys_call(NR["pidfd_open"], <<victim>>, 0))
def pidfd_kill():
    fd = sys_call(NR["pidfd_open"], 1, 0)
    return sys_call(NR["pidfd_send_signal"], fd, signal.SIGKILL, 0, 0)
step("pidfd_send_signal to PID 1", pidfd_kill)
step("see other processes", lambda: [p for p in os.listdir("/proc") if p.isdigit()])
""",
    "leave_a_daemon": LIBC
    + """
import time
def daemon():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            libc.prctl(15, <<nonce>>.encode(), 0, 0, 0)  # PR_SET_NAME: the host looks for this name
            time.sleep(60)
        os._exit(0)
    time.sleep(0.2)
    return "forked"
act("fork a setsid daemon", daemon)
""",
}


def _victim() -> subprocess.Popen:
    """A host process whose command line looks like a trainer's, for the forging and signal attacks."""
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "data.train_files=/nonexistent.parquet"]
    )


def run_attacks(
    guard_modes=("on", "off", "switched_off"), attacks=tuple(ATTACKS), time_limit_s: float = 3.0
) -> dict:
    """Run ``attacks`` (all by default) in every guard mode; return ``{mode: {attack: {"escaped": [...],
    "blocked": [...], "host": [...problems seen on the host afterwards...], "status": ...}}}``."""
    from tearless.rewards.sandbox import SandboxLimits, run_in_sandbox

    report: dict = {}
    victim = _victim()
    host_dir = tempfile.mkdtemp(prefix="tearless-attack-")
    secret = os.path.join(host_dir, "train.jsonl")
    with open(secret, "w") as f:
        f.write('{"expected": "42"}\n')
    unix_path = os.path.join(host_dir, "host.sock")
    unix_server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_server.bind(unix_path)
    unix_server.listen()
    abstract = f"\0tearless-attack-{os.getpid()}"
    abstract_server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract_server.bind(abstract)
    abstract_server.listen()
    tcp = socket.create_server(("127.0.0.1", 0))
    for server in (unix_server, abstract_server, tcp):
        server.settimeout(0.05)
    facts = dict(
        secret=secret,
        secret_dir=host_dir,
        cwd=os.path.dirname(os.path.abspath(__file__)),
        escape=os.path.join(host_dir, "escaped"),
        prefix=sys.prefix,
        unix_path=unix_path,
        abstract=abstract,
        port=tcp.getsockname()[1],
        victim=victim.pid,
        nonce=f"tlatk{os.getpid():08x}"[:15],
    )
    try:
        for mode in guard_modes:
            report[mode] = {}
            for name in attacks:
                body = ATTACKS[name]
                for key, value in facts.items():
                    body = body.replace(f"<<{key}>>", repr(value))
                source = PRELUDE + (SWITCH_OFF if mode == "switched_off" else "") + textwrap.dedent(body)
                shm_before = _sysv_segments()
                result = run_in_sandbox(
                    source, [""], limits=SandboxLimits(time_limit_s=time_limit_s, guard=mode == "on")
                )
                run = result.runs[0]
                lines = (run.output or "").splitlines() + run.stderr.splitlines()
                host = []
                if os.path.exists(facts["escape"]) or os.path.exists(os.path.join(sys.prefix, "planted.py")):
                    host.append("a file was written outside the sandbox")
                if victim.poll() is not None:
                    host.append("the host process was killed")
                    victim = _victim()
                    facts["victim"] = victim.pid
                for server in (unix_server, abstract_server, tcp):
                    try:
                        server.accept()[0].close()
                        host.append(f"a connection reached {server.getsockname()!r}")
                    except (TimeoutError, BlockingIOError, OSError):
                        pass
                if _sysv_segments() - shm_before:
                    host.append("a System V segment outlived the sample")
                time.sleep(0.05)
                host += [f"process {p} outlived the sample" for p in _daemons(facts["nonce"])]
                report[mode][name] = {
                    "status": run.status,
                    "escaped": [line for line in lines if line.startswith("ESCAPED")],
                    "blocked": [line for line in lines if line.startswith("BLOCKED")],
                    "host": host,
                    "protections": result.protections,
                }
    finally:
        victim.kill()
        victim.wait()
        for server in (unix_server, abstract_server, tcp):
            server.close()
        for segment in _sysv_segments():
            subprocess.run(["ipcrm", "-m", str(segment)], capture_output=True)
        for pid in _daemons(facts["nonce"]):
            os.kill(pid, signal.SIGKILL)
        for planted in (os.path.join(sys.prefix, "planted.py"), "/planted"):
            if os.path.exists(planted):
                os.unlink(planted)
        for name in os.listdir(host_dir):
            os.unlink(os.path.join(host_dir, name))
        os.rmdir(host_dir)
    return report


def _sysv_segments() -> set[int]:
    """Ids of the host's System V shared-memory segments with the attack's key (0x7e57)."""
    with open("/proc/sysvipc/shm") as f:
        next(f)
        return {int(line.split()[1]) for line in f if int(line.split()[0]) == 0x7E57}


def _daemons(nonce: str) -> list[int]:
    """Pids of the processes named ``nonce`` (the attack's daemon names itself so)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == nonce:
                    found.append(int(pid))
        except OSError:
            continue
    return found


if __name__ == "__main__":
    print(json.dumps(run_attacks()))
