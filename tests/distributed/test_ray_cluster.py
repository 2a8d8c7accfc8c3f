"""A real two-node Ray cluster, started as a user starts one (issue 43, item 5): ``ray start --head`` and
``ray start --address=…`` as a second node, both on this machine with one CPU each. ``tearless train``
joins it with ``ray_init.address`` and ``trainer.nnodes=2``, one rank lands on each node, the driver is
SIGKILLed after a checkpoint and the run resumes to the end; the cluster, and another job's detached
actor, are untouched throughout. Nothing outlives the test but the two nodes, which it stops.

Ray 2.60 turns token authentication on for a cluster once a token exists (``~/.ray/auth_token``), and a
joining node or driver without the token is refused with ``InvalidAuthToken``: the test gives every
process its own token through ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` (docs/scale-out.md).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tearless.reaper import descendants
from tearless.run.checkpoint import latest_checkpoint
from tearless.run.tracking import read_metrics

pytestmark = pytest.mark.slow
pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
START_S = 180  # a node's start on a loaded 2-core machine
RUN_S = 900  # the run's start-up (two rank processes, each loading torch) and its steps
STEPS = 8  # enough steps after the first checkpoint (step 2) that the SIGKILL lands before the end

# Another job: a detached actor with no CPU (the ranks take both), which reports its process id.
KEEPER = """
import os, sys, ray
ray.init(address=sys.argv[1], namespace="another-job")
@ray.remote(num_cpus=0)
class Keeper:
    def pid(self):
        return os.getpid()
keeper = Keeper.options(name="keeper", lifetime="detached").remote()
print(ray.get(keeper.pid.remote()))
"""
# The cluster as a new driver sees it: the number of live nodes and the detached actor's process id.
LOOK = """
import json, sys, time, ray
ray.init(address=sys.argv[1], namespace="another-job")
deadline = time.monotonic() + float(sys.argv[2])
while sum(n["Alive"] for n in ray.nodes()) < 2 and time.monotonic() < deadline:
    time.sleep(0.5)
try:
    keeper = ray.get(ray.get_actor("keeper").pid.remote(), timeout=60)
except ValueError:  # no actor of that name yet
    keeper = None
print(json.dumps({"nodes": sum(n["Alive"] for n in ray.nodes()), "keeper": keeper}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Cluster:
    """Two ``ray start --block`` processes, each in a session of its own, and what they started."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env, self.port = env, free_port()
        self.address = f"127.0.0.1:{self.port}"
        # A short temporary directory: Ray's socket paths under it must fit in 107 bytes.
        self.temp = tempfile.mkdtemp(prefix="tl-ray-", dir="/tmp")
        self.nodes: list[subprocess.Popen] = []
        self.started: set[int] = set()
        head = ["--head", f"--port={self.port}", "--include-dashboard=false", f"--temp-dir={self.temp}"]
        self._start([*head, "--num-cpus=1"])
        self._start([f"--address={self.address}", "--num-cpus=1"])

    def _start(self, args: list[str]) -> None:
        log = open(Path(self.temp) / f"node{len(self.nodes)}.log", "w")
        self.nodes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ray.scripts.scripts",
                    "start",
                    "--block",
                    "--disable-usage-stats",
                    *args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        )
        if len(self.nodes) == 1:  # the head must listen before the second node joins
            self.look(START_S)

    def look(self, wait_s: float = 0.0) -> dict:
        """Live nodes and the keeper's pid, through a new driver (after ``wait_s`` for two nodes)."""
        out = subprocess.run(
            [sys.executable, "-c", LOOK, self.address, str(wait_s)], env=self.env, capture_output=True,
            text=True, timeout=START_S + wait_s,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def ranks(self) -> dict[int, int]:
        """Process id → node index (0 = head) of each live ``ray::Rank`` actor process of this cluster
        (a node's processes descend from its ``ray start``; other clusters on the machine are not
        looked at)."""
        found = {}
        for i, node in enumerate(self.nodes):
            for pid in descendants(node.pid):
                self.started.add(pid)
                try:
                    if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::Rank") and alive(pid):
                        found[pid] = i
                except OSError:
                    continue
        return found

    def stop(self) -> None:
        """SIGKILL both nodes' process groups and every descendant recorded, then wait them out."""
        self.ranks()  # records every descendant
        for node in self.nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)  # the group it leads: what it started stays in it
            except OSError:
                pass
            node.kill()
        for pid in self.started:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for node in self.nodes:
            node.wait(timeout=60)
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture
def cluster():
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": str(REPO),
    }
    c = Cluster(env)
    try:
        assert c.look(START_S)["nodes"] == 2
        yield c
    finally:
        c.stop()


def train(args: list[str], env: dict[str, str], output: Path) -> subprocess.Popen:
    """``tearless train`` with its stdout and stderr in ``output``."""
    with open(output, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tearless", "train", *args], stdout=out, stderr=subprocess.STDOUT, env=env
        )


def wait_until(condition, seconds: float, what) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(0.5)


@pytest.mark.timeout(2400)
def test_a_run_on_a_two_node_cluster_survives_its_drivers_sigkill_and_leaves_the_cluster_alone(
    cluster, overrides, tmp_path
):
    keeper = subprocess.run(
        [sys.executable, "-c", KEEPER, cluster.address], env=cluster.env, capture_output=True, text=True,
        timeout=START_S,
    )  # fmt: skip
    assert keeper.returncode == 0, keeper.stderr[-3000:]
    keeper_pid = int(keeper.stdout.strip().splitlines()[-1])

    run = tmp_path / "run"
    args = overrides(
        run, "trainer.val_before_train=false", f"trainer.total_training_steps={STEPS}", "trainer.save_freq=2",
        "trainer.placement=ray", "trainer.nnodes=2", "trainer.n_gpus_per_node=1", "trainer.num_threads=1",
        f"ray_init.address={cluster.address}", "trainer.worker_timeout_s=900",
        f"ray_init.runtime_env.env_vars.PYTHONPATH={REPO}",
    )  # fmt: skip
    first_err = tmp_path / "first.txt"
    driver = train(args, cluster.env, first_err)
    try:
        # One rank on each node.
        wait_until(lambda: len(cluster.ranks()) == 2 or driver.poll() is not None, RUN_S, first_err.read_text)
        assert sorted(cluster.ranks().values()) == [0, 1], cluster.ranks()
        wait_until(
            lambda: latest_checkpoint(run) is not None or driver.poll() is not None,
            RUN_S,
            first_err.read_text,
        )
        assert driver.poll() is None, first_err.read_text()
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    # A step of the tiny model can take well under the poll's half second: the kill lands at the first
    # checkpoint or a few steps after it, never at the end (the driver was still running).
    killed_at = int(latest_checkpoint(run).name.rsplit("_", 1)[1])
    assert 2 <= killed_at < STEPS, killed_at
    # The job's ranks end with their driver; the nodes and the other job's actor stay.
    wait_until(lambda: not cluster.ranks(), 120, lambda: f"ranks left: {cluster.ranks()}")
    seen = cluster.look()
    assert seen == {"nodes": 2, "keeper": keeper_pid} and alive(keeper_pid), seen

    resumed_err = tmp_path / "resumed.txt"
    resumed = train([*args, "trainer.resume_mode=auto"], cluster.env, resumed_err)
    try:
        assert resumed.wait(timeout=RUN_S) == 0, resumed_err.read_text()
    finally:
        if resumed.poll() is None:
            resumed.kill()
            resumed.wait()
    steps = [m["step"] for m in read_metrics(run / "metrics.jsonl") if "step" in m]
    assert steps[-1] == STEPS and set(range(1, STEPS + 1)) <= set(steps), steps
    assert f"global_step_{killed_at}" in resumed_err.read_text(), resumed_err.read_text()[-2000:]
    seen = cluster.look()
    assert seen == {"nodes": 2, "keeper": keeper_pid} and alive(keeper_pid), seen
