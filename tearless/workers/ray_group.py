"""The Ray placement: pools of :class:`~tearless.workers.rank.Rank` actors, one process each.

Pools. By default (``trainer.colocate=true``) one pool of ``trainer.nnodes × n_gpus_per_node``
ranks holds every model role and generates (the hybrid engine); with ``colocate=false`` each role
gets a pool of that size (a LoRA reference stays with the actor: it is the actor with its adapters
off). With ``actor_rollout_ref.rollout.nnodes × n_gpus_per_node > 0`` generation moves to a pool of
that many separate rollout ranks (the split placement), which the training ranks broadcast the new
policy to after every update (:mod:`tearless.distributed.weight_sync`).

Scheduling. Each pool reserves its ranks with one Ray placement group per node (a bundle per rank:
one GPU, or ``trainer.num_cpus_per_worker`` CPUs) packed on that node, so that a pool's ranks on a
node share it and rank r sits in bundle r of its node. A pool's ranks join a ``torch.distributed``
group whose rendezvous is on rank 0's routable node address (Ray's view of it). Ray itself is
joined at ``ray_init.address`` (``auto``, ``ray://…``, an IP), or started locally; worker
environment variables go in ``ray_init.runtime_env.env_vars``.

Failures. Every wait is bounded by ``trainer.worker_timeout_s``; the first rank that raises or
dies ends the call with an error naming its pool, rank, process id and host and carrying its
traceback, and every pool is stopped (a surviving rank would sit in a collective until its own
timeout).
"""

from __future__ import annotations

import json
import logging
import re
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tearless import reaper
from tearless.config import to_dict
from tearless.config.schema import RayInitConfig
from tearless.workers.group import WorkerGroup
from tearless.workers.rank import Rank, RankMethod
from tearless.workers.spec import RankSpec, role_settings

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_POLL_S = 0.5
_CLOSE_S = 10.0


class WorkerError(RuntimeError):
    """A worker failed, died or did not answer in time; the message names it."""


class RayStartError(RuntimeError):
    """``ray.init`` did not return within ``ray_init.start_timeout_s``; the message says what to check."""


def ensure_ray(ri: RayInitConfig, cpus_per_worker: int, num_workers: int) -> None:
    """Join the cluster at ``ray_init.address`` (``ri``; or ``RAY_ADDRESS``), or start a local one (no
    dashboard) that counts at least ``cpus_per_worker`` (``trainer.num_cpus_per_worker``) CPUs per
    worker, so that the pools fit on a small machine; ``ray_init.runtime_env`` applies to every worker
    of the run."""
    import os

    import ray

    if ray.is_initialized():
        return
    address = ri.address or os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    runtime_env = to_dict(ri.runtime_env)
    if runtime_env.get("env_vars"):
        kwargs["runtime_env"] = {"env_vars": {k: str(v) for k, v in runtime_env["env_vars"].items()}}
    # ray.init installs its C++ failure-signal handler for SIGTERM over the Python one: a SIGTERM then
    # printed a stack dump and exited -6 instead of reaching the CLI's clean stop (tearless.cli).
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    if address:
        _bounded(lambda: ray.init(address=address, **kwargs), ri.start_timeout_s)
    else:
        needed = num_workers * cpus_per_worker
        _bounded(
            lambda: ray.init(num_cpus=ri.num_cpus or max(os.cpu_count() or 1, needed), **kwargs),
            ri.start_timeout_s,
        )
        reaper.start()  # the local cluster ends with this process, even after a SIGKILL
    if threading.current_thread() is threading.main_thread():
        for sig, handler in handlers.items():
            if callable(handler):
                signal.signal(sig, handler)


class _NoSigtermWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


_NO_SIGTERM_WARNING = _NoSigtermWarning()


def _bounded(start: Any, timeout_s: float) -> None:
    """Run ``start`` (``ray.init``) in a thread while this one waits at most ``timeout_s``.

    When Ray's prestarted workers die during ``ray.init`` (the kernel's OOM killer), the driver waits
    in Ray's C++ ``CoreWorker`` constructor without end or word; a signal handler of the interpreter
    runs only in the main thread between bytecodes, so there a SIGTERM waited too (or reached Ray's
    C++ handler: a stack dump). Here the main thread polls the starting thread (which releases the
    GIL while it waits), so a signal stops the command at once, in one line, and a start past the
    bound raises :class:`RayStartError` naming Ray's session logs. A start abandoned this way is left
    to the process's exit (the thread is a daemon; the command's reaper ends what Ray had started).
    """
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            start()
        except BaseException as e:  # handed to the waiting thread, which raises it
            outcome.append(e)
            return
        outcome.append(None)
        # Ray's local cluster processes get a parent-death signal, which Linux ties to the thread
        # that started them: this thread must live as long as the process, or the GCS dies with it.
        threading.Event().wait()

    # Ray says at every start from a thread that it set no SIGTERM handler: that is the point here.
    logging.getLogger("ray._private.worker").addFilter(_NO_SIGTERM_WARNING)  # once: the same object
    thread = threading.Thread(target=run, name="tearless-ray-init", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not outcome and time.monotonic() < deadline:
        thread.join(_POLL_S)
    if not outcome:
        raise RayStartError(
            f"Ray did not start within {timeout_s:g} s (ray_init.start_timeout_s): ray.init is waiting for "
            "Ray's processes. Check Ray's session logs in /tmp/ray/session_latest/logs (raylet.out, "
            "gcs_server.out, python-core-driver-*.log), whether the kernel's OOM killer ended Ray's "
            "workers (dmesg), and ray_init.address; then rerun, or raise ray_init.start_timeout_s"
        )
    if outcome[0] is not None:
        raise outcome[0]


class Pool:
    """``world`` Ray actors holding ranks of one pool, and the calls to them."""

    def __init__(
        self,
        spec: RankSpec,
        world: int,
        *,
        name: str,
        nodes: int,
        timeout_s: float,
        independent: bool = False,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name, self.world, self.timeout_s = name, world, timeout_s
        self.handles: list[Any] = []
        self.groups: list[Any] = []
        # trainer.device=auto asks for GPUs when the cluster has them; each rank then resolves
        # auto in its own process (a CPU-only head node decides nothing for its workers).
        gpu = spec.device == "cuda" or (spec.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        cpus = spec.sections.trainer.num_cpus_per_worker
        per_node = -(-world // nodes)
        bundle = {"GPU": 1, "CPU": cpus} if gpu else {"CPU": cpus}
        for start in range(0, world, per_node):
            count = min(per_node, world - start)
            self.groups.append(placement_group([dict(bundle) for _ in range(count)], strategy="STRICT_PACK"))
        self.workers = [{"rank": r, "pid": None, "host": None} for r in range(world)]
        ready, _ = ray.wait([g.ready() for g in self.groups], num_returns=len(self.groups), timeout=timeout_s)
        if len(ready) < len(self.groups):
            self.close()
            raise WorkerError(
                f"{name}: the Ray cluster had no room for {world} workers of {bundle} within "
                f"trainer.worker_timeout_s={timeout_s:g} s; free resources, lower trainer.n_gpus_per_node "
                "or trainer.num_cpus_per_worker, or raise the timeout"
            )
        remote = ray.remote(Rank)
        for r in range(world):
            strategy = PlacementGroupSchedulingStrategy(self.groups[r // per_node], r % per_node)
            options = remote.options(num_cpus=cpus, num_gpus=1 if gpu else 0, scheduling_strategy=strategy)
            # Independent ranks (separate rollout workers) are each rank 0 of their own world of 1.
            self.handles.append(options.remote(0 if independent else r, 1 if independent else world, spec))
        self.workers = self.call(Rank.info, [()] * world, "start")
        for r, w in enumerate(self.workers):
            w["rank"] = r

    def label(self, rank: int) -> str:
        w = self.workers[rank]
        where = f"pid {w['pid']} on {w['host']}" if w["pid"] is not None else "process not started yet"
        return f"{self.name} worker rank {rank} ({where})"

    def submit(
        self, method: RankMethod, per_rank: Sequence[tuple], ranks: Sequence[int] | None = None
    ) -> list[tuple[Any, Pool, int]]:
        """Start ``method`` (a :class:`Rank` method) on the given ranks (all by default), each with its
        own arguments; the pending calls, for :func:`wait_all`."""
        ranks = range(self.world) if ranks is None else ranks
        # The one place a method becomes its name: a Ray actor handle is called as handle.<name>.remote.
        return [
            (getattr(self.handles[r], method.__name__).remote(*args), self, r)
            for r, args in zip(ranks, per_rank, strict=True)
        ]

    def call(self, method: RankMethod, per_rank: Sequence[tuple], what: str) -> list[Any]:
        return wait_all(self.submit(method, per_rank), what or method.__name__, self.timeout_s)

    def close(self) -> None:
        import ray

        for handle in self.handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # a dead actor cannot be killed twice; nothing else to do
                pass
        self.handles = []
        for group in self.groups:
            try:
                ray.util.remove_placement_group(group)
            except Exception:  # already removed with the cluster
                pass
        self.groups = []


def wait_all(pending: list[tuple[Any, Pool, int]], what: str, timeout_s: float) -> list[Any]:
    """Results of pending calls, in submission order, within ``timeout_s`` in all; on the first failure
    or at the timeout every involved pool is stopped and a :class:`WorkerError` names the worker."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayError

    refs = {ref: i for i, (ref, _, _) in enumerate(pending)}
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    waiting = list(refs)

    def stop() -> None:
        for pool in {id(p): p for _, p, _ in pending}.values():
            pool.close()

    while waiting:
        # Short waits: a signal's Python handler (SIGTERM, Ctrl-C: tearless.cli) runs only between
        # them, and one wait may last trainer.worker_timeout_s.
        left = max(0.0, deadline - time.monotonic())
        ready, waiting = ray.wait(waiting, num_returns=1, timeout=min(_POLL_S, left))
        if not ready and left > _POLL_S:
            continue
        if not ready:
            late = ", ".join(pending[refs[w]][1].label(pending[refs[w]][2]) for w in waiting)
            stop()
            raise WorkerError(
                f"{late}: no answer to {what} within trainer.worker_timeout_s={timeout_s:g} s; the workers "
                "were stopped. Raise trainer.worker_timeout_s if the step is legitimately slow."
            )
        ref = ready[0]
        _, pool, rank = pending[refs[ref]]
        try:
            results[refs[ref]] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except RayActorError as exc:
            label = pool.label(rank)
            stop()
            raise WorkerError(
                f"{label} died during {what} (its process exited or was killed); the workers were "
                f"stopped and nothing of this step was saved.\n{exc}"
            ) from None
        except GetTimeoutError:
            waiting.append(ref)
        except RayError as exc:
            label = pool.label(rank)
            stop()
            remote = _ANSI.sub("", str(exc))  # Ray colours the remote traceback for terminals
            raise WorkerError(f"{label} failed during {what}:\n{remote}") from None
    return [results[i] for i in range(len(pending))]


class RayWorkers(WorkerGroup):
    """The pools of one run (see the module docstring)."""

    def __init__(self, spec: RankSpec, pad_token_id: int, *, run_dir: Path | None = None) -> None:
        sections = spec.sections
        t, rollout = sections.trainer, sections.rollout
        self.plan, self.pad_token_id = spec.plan, pad_token_id
        self.settings = role_settings(spec)
        world = t.nnodes * t.n_gpus_per_node
        split = rollout.nnodes * rollout.n_gpus_per_node
        roles = spec.roles
        lora_ref = "ref" in roles and sections.model.lora_rank > 0
        if t.colocate:
            layout = {"+".join(roles): roles}
        else:  # a pool per role, but a LoRA reference is the actor's model with its adapters off
            layout = {r: ("actor", "ref") if r == "actor" and lora_ref else (r,) for r in roles}
            if lora_ref:
                del layout["ref"]
        ensure_ray(sections.ray_init, t.num_cpus_per_worker, world * len(layout) + split)
        self.pools: dict[str, Pool] = {}
        self.pool_of: dict[str, str] = {}
        self.broadcasts = 0  # weight broadcasts sent to the rollout pool
        self.receives: list[tuple[Any, Pool, int]] = []  # their receive calls not collected yet
        try:
            for name, pool_roles in layout.items():
                hybrid = "actor" in pool_roles and not split
                pool_spec = spec.replaced(roles=pool_roles, rollout=hybrid)
                pool = Pool(pool_spec, world, name=name, nodes=t.nnodes, timeout_s=t.worker_timeout_s)
                self.pools[name] = pool
                for role in pool_roles:
                    self.pool_of[role] = name
                if hybrid:
                    self.pool_of["rollout"] = name
            if split:
                rollout_spec = spec.replaced(roles=(), rollout=True, resume_dir=None)
                self.pools["rollout"] = Pool(
                    rollout_spec,
                    split,
                    name="rollout",
                    nodes=rollout.nnodes,
                    timeout_s=t.worker_timeout_s,
                    independent=True,
                )
                self.pool_of["rollout"] = "rollout"
            if run_dir is not None:
                run_dir.mkdir(parents=True, exist_ok=True)
                for name, pool in self.pools.items():
                    (run_dir / f"workers_{name}.json").write_text(json.dumps(pool.workers, indent=1))
            self.device = next(iter(self.pools.values())).workers[0]["device"]
            self._setup(split)
        except BaseException:
            self.close()
            raise

    def _setup(self, split: int) -> None:
        for name, pool in self.pools.items():
            if name == "rollout":
                pool.call(Rank.setup, [()] * pool.world, "setup (rollout engine and rewards)")
                continue
            (address,) = wait_all(pool.submit(Rank.address, [()], ranks=[0]), "rendezvous", pool.timeout_s)
            pool.call(Rank.setup, [(address,)] * pool.world, "setup (process group and models)")
        actor = self.pools[self.pool_of["actor"]]
        if split:
            (address,) = wait_all(
                actor.submit(Rank.address, [()], ranks=[0]), "weight-sync rendezvous", actor.timeout_s
            )
            sync_world = 1 + split
            pending = actor.submit(Rank.open_weight_sync, [(address, 0, sync_world)], ranks=[0])
            pending += self.pools["rollout"].submit(
                Rank.open_weight_sync, [(address, 1 + i, sync_world) for i in range(split)]
            )
            wait_all(pending, "weight-sync setup", actor.timeout_s)
            self.sync_weights()
        elif self.plan.capabilities.holds_own_weights:
            actor.call(Rank.sync_engine, [()] * actor.world, "first weight load into the engines")

    def world_of(self, pool: str) -> int:
        return self.pools[self.pool_of[pool]].world

    def _call(self, pool: str, method: RankMethod, per_rank: Sequence[tuple], what: str) -> list[Any]:
        return self.pools[self.pool_of[pool]].call(method, per_rank, what)

    def _submit(self, pool: str, method: RankMethod, per_rank: Sequence[tuple], what: str) -> Any:
        return self.pools[self.pool_of[pool]].submit(method, per_rank)

    def _wait(self, pending: Any, what: str) -> list[Any]:
        results = wait_all(pending, what, self.plan.sections.trainer.worker_timeout_s)
        self._collect_receives()
        return results

    def trained_pools(self) -> list[str]:
        pools = [self.pool_of["actor"]]
        if "critic" in self.pool_of and self.pool_of["critic"] not in pools:
            pools.append(self.pool_of["critic"])
        return [next(r for r in ("actor", "critic") if self.pool_of.get(r) == p) for p in pools]

    def sync_weights(self, version: int | None = None) -> float:
        """Split placement: the training ranks gather and send the policy while every rollout rank
        receives it, at once (after the generation calls submitted to it before). Returns the
        slowest rollout rank's seconds receiving.

        With partial rollouts (``async_training.partial_rollout``) the rollout ranks take it between
        two tokens of the call they are running (or in their queued receive call when idle); only
        the sending is waited for here, and 0 is returned. The queued receive calls are collected
        later (:meth:`_wait`), so that a failure among them still surfaces."""
        if "rollout" not in self.pools:
            return 0.0
        actor = self.pools[self.pool_of["actor"]]
        rollout = self.pools["rollout"]
        self.broadcasts += 1
        pending = actor.submit(Rank.send_weights, [(version,)] * actor.world)
        receives = rollout.submit(Rank.receive_weights, [(self.broadcasts,)] * rollout.world)
        if self.plan.sections.async_training.partial_rollout:
            self.receives += receives
            wait_all(pending, "weight broadcast", actor.timeout_s)
            return 0.0
        results = wait_all(pending + receives, "weight broadcast", actor.timeout_s)
        return max(float(r) for r in results[actor.world :])

    def _collect_receives(self) -> None:
        """Results of the queued receive calls that have finished (raising a worker's failure)."""
        import ray

        if not self.receives:
            return
        ready, _ = ray.wait([p[0] for p in self.receives], num_returns=len(self.receives), timeout=0)
        done = set(ready)
        wait_all([p for p in self.receives if p[0] in done], "weight broadcast (rollout side)", 1.0)
        self.receives = [p for p in self.receives if p[0] not in done]

    def close(self) -> None:
        """Ask every rank to close, for at most :data:`_CLOSE_S`, then kill the actors. The bound
        matters when a signal stops the run mid-call: a rank still inside it (a reward that hangs)
        would take the close only after that call, or after trainer.worker_timeout_s."""
        for pool in self.pools.values():
            try:
                if pool.handles:
                    wait_all(
                        pool.submit(Rank.close, [()] * pool.world), "close", min(pool.timeout_s, _CLOSE_S)
                    )
            except WorkerError:
                pass  # the pool was stopped by the failure or the bound; nothing left to close
            pool.close()
