"""The sandbox isolates by construction: every attack of issue 24 fails with the guard on, off, or
switched off by the program itself, as root and as an unprivileged user; the weak mode (opt-in)
is the control that shows the attacks work where isolation is absent.

The attacks live in ``sandbox_attacks.py``; ``as_user.py`` runs them as a fresh unprivileged uid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tearless.rewards import code_reward
from tearless.rewards.sandbox import SandboxError, SandboxLimits, run_in_sandbox
from tearless.rewards.sandbox_seccomp import ARCHES, DENIED, build_filter
from tests.rewards.sandbox_attacks import ATTACKS, run_attacks

HERE = Path(__file__).parent
ROOT = os.geteuid() == 0
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
FULL = {
    "pid_namespace", "mount_namespace", "ipc_namespace", "network_namespace", "uts_namespace",
    "read_only_root", "private_tmp", "private_dev_shm", "no_capabilities", "seccomp_filter", "rlimit_nproc",
}  # fmt: skip


def assert_contained(report: dict) -> None:
    for mode, attacks in report.items():
        assert set(attacks) == set(ATTACKS)
        for name, outcome in attacks.items():
            assert outcome["escaped"] == [], (mode, name, outcome)
            assert outcome["host"] == [], (mode, name, outcome)
            assert FULL <= set(outcome["protections"]), (mode, name)
            if mode != "on" or name in ("forge_from_proc", "write_outside", "host_unix_socket", "network"):
                # Without the guard every step ran and was refused by the kernel; with it, the guard
                # refuses the programs that need ctypes before their first step.
                assert outcome["blocked"] or name in ("sysv_shm", "leave_a_daemon"), (mode, name, outcome)


@pytest.mark.skipif(not ROOT, reason="the root mode needs root")
def test_every_attack_is_contained_as_root():
    report = run_attacks()
    assert_contained(report)
    assert "unprivileged_uid" in report["off"]["signals"]["protections"]
    assert "cgroup_memory" in report["off"]["signals"]["protections"] or not os.path.isdir("/sys/fs/cgroup")


def test_every_attack_is_contained_without_root(tmp_path):
    script = tmp_path / "attacks.py"
    script.write_text(
        f"import json, sys\nsys.path[:0] = [{str(HERE.parent.parent)!r}]\n"
        "from tests.rewards.sandbox_attacks import run_attacks\nprint(json.dumps(run_attacks()))\n"
    )
    command = (
        [sys.executable, str(HERE / "as_user.py"), str(script)] if ROOT else [sys.executable, str(script)]
    )
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd="/tmp")
    if "could not isolate" in proc.stderr and not ROOT:
        pytest.skip("this kernel refuses unprivileged user namespaces (the sandbox refuses to run)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert_contained(report)
    assert "user_namespace" in report["off"]["signals"]["protections"]


def test_the_weak_mode_is_the_control_where_the_attacks_work(monkeypatch):
    # Opting in to weak isolation removes what the attacks need: the forging program reads another
    # process's command line and the data file, and one that switched the guard off connects out.
    # (Only these three: in weak mode as root the others would really reach the machine.)
    monkeypatch.setenv("TEARLESS_SANDBOX", "weak")
    safe = ("forge_from_proc", "network", "host_unix_socket")
    report = run_attacks(guard_modes=("switched_off",), attacks=safe)["switched_off"]
    assert any("command lines" in line for line in report["forge_from_proc"]["escaped"])
    assert any("data file" in line for line in report["forge_from_proc"]["escaped"])
    assert report["network"]["escaped"] or report["host_unix_socket"]["escaped"]
    assert "weak_isolation" in report["network"]["protections"]


FORGER = """
```python
import os
# Find the trainer's data file from its command line and print the expected output.
for pid in os.listdir("/proc"):
    try:
        args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
    except OSError:
        continue
    for arg in args:
        if arg.startswith(b"data.train_files="):
            try:
                text = open(arg.split(b"=", 1)[1].decode()).read()
            except (OSError, ValueError):
                continue  # another trainer on the machine, its file gone or not text
            if "expected=" in text:
                print(text.split("expected=")[1].split()[0])
                raise SystemExit
```
"""


@pytest.mark.parametrize("mode", ["full", "weak"])
def test_a_program_that_forges_its_output_from_the_data_file_scores_0(tmp_path, monkeypatch, mode):
    # The trainer's command line names its data file, which holds the expected output; a program
    # that solves nothing but reads it scored 1.0 on main. The weak mode is the control: there the
    # forger sees every process on the machine, so it skips other trainers' files (a parallel test
    # session's, deleted or not of this form), which made the control fail beside a second CI run.
    data = tmp_path / "train.txt"
    data.write_text("input=6 expected=720\n")
    trainer = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", f"data.train_files={data}"]
    )
    monkeypatch.setenv("TEARLESS_SANDBOX", mode)
    try:
        result = code_reward.compute_score(
            FORGER, {"inputs": ["6\n"], "outputs": ["720\n"]}, time_limit_s=2.0
        )
    finally:
        trainer.kill()
        trainer.wait()
    assert result == ({"score": 0.0, "acc": 0.0} if mode == "full" else {"score": 1.0, "acc": 1.0})


def test_an_unknown_isolation_mode_and_a_refused_namespace_are_errors(monkeypatch):
    monkeypatch.setenv("TEARLESS_SANDBOX", "none")
    with pytest.raises(SandboxError, match="TEARLESS_SANDBOX='none' is not an isolation mode"):
        run_in_sandbox("print(1)", [""])
    monkeypatch.setenv("TEARLESS_SANDBOX", "full")
    # A kernel that refuses namespaces: the harness reports it and nothing runs less isolated.
    monkeypatch.setattr("tearless.rewards.sandbox._SCRIPTS", _scripts_with_refusing_kernel(monkeypatch))
    with pytest.raises(SandboxError, match=r"could not isolate .*EPERM-for-the-test.*TEARLESS_SANDBOX=weak"):
        run_in_sandbox("print(1)", [""])


def _scripts_with_refusing_kernel(monkeypatch) -> tuple[Path, ...]:
    import tearless.rewards.sandbox as sandbox

    patched = []
    folder = Path(__import__("tempfile").mkdtemp(prefix="tearless-refusing-"))
    for script in sandbox._SCRIPTS:
        text = script.read_text()
        if script.name == "sandbox_confine.py":
            text = text.replace(
                "def isolate(lib, job):\n",
                "def isolate(lib, job):\n    raise OSError(1, 'unshare: EPERM-for-the-test')\n",
            )
        (folder / script.name).write_text(text)
        patched.append(folder / script.name)
    return tuple(patched)


def test_the_filter_program_denies_each_listed_call_on_each_architecture():
    for machine, (_, numbers) in ARCHES.items():
        program = build_filter(machine)
        # 8 bytes per instruction: 3 or 4 header instructions, one per denied call present, clone3,
        # clone, allow, the 3-instruction flag check, and the two returns.
        present = [name for name in DENIED if name in numbers]
        header = 4 if machine == "x86_64" else 3
        assert len(program) == 8 * (header + len(present) + 3 + 3 + 2)
    with pytest.raises(OSError, match="knows x86_64 and aarch64"):
        build_filter("riscv64")


def test_programs_still_work_inside():
    # What a solution needs: the standard library (a C extension too), threads, /tmp, /dev/urandom.
    source = textwrap.dedent(
        """
        import decimal, hashlib, json, os, tempfile, threading
        t = threading.Thread(target=lambda: None); t.start(); t.join()
        with tempfile.NamedTemporaryFile("w") as f:
            f.write("x")
        digest = hashlib.sha256(b"").hexdigest()[:4]
        print(json.dumps([decimal.Decimal("1.5") * 2 == 3, len(os.urandom(4)), digest]))
        """
    )
    result = run_in_sandbox(source, [""], limits=SandboxLimits(time_limit_s=3.0))
    assert result.runs[0].status == "ok", result.runs[0].stderr
    assert json.loads(result.runs[0].output) == [True, 4, "e3b0"]
