"""One rank of a worker group: its models, optimizers, rollout engine, reward scoring and tool loop.

A :class:`Rank` is the same object in every placement: the single-process trainer holds one, in its
own process (world size 1, plain models); a Ray worker group holds one per worker process, joined
in a ``torch.distributed`` group (gloo on CPU, NCCL on GPU) over FSDP2-sharded models. The trainer
never sees a rank; it talks to the group (:mod:`tearless.workers.group`).

What a rank holds depends on the placement:

- ``roles``: the trained and forward-only models it shards (``actor``, ``ref``, ``critic``);
- ``rollout``: a rollout engine, the reward manager and the multi-turn agent loop. In the hybrid
  (colocated) placement a training rank is also a rollout rank: the built-in engine samples from the
  very weights it trains (gathered from their shards for the rollout, no copy), a vLLM engine sleeps
  during the update and takes the new weights in this process. In the split placement, rollout
  ranks hold a plain copy of the policy that the training ranks broadcast to after each update.

Models of world-size-1 ranks load as usual, unless a GPU process offloads a role's parameters or
optimizer state to CPU memory: it then shards them over a one-rank group (FSDP2's offload). Sharded
models are read by rank 0 only and broadcast into
every rank's shards (:func:`tearless.distributed.fsdp.shard_from_rank0`), with float32 master
weights; on GPU, forward and backward run in ``fsdp_config.param_dtype`` (bf16 by default).
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from tearless.config import resume_compat
from tearless.config.external import import_external_libs
from tearless.cpu import configure_cpu
from tearless.distributed.fsdp import (
    gathered,
    move_optimizer_state,
    optimizer_state_moves,
    process_group_backend,
)
from tearless.distributed.weight_sync import WeightBroadcast
from tearless.models.loading import load_causal_lm, load_tokenizer, resolve_dtype
from tearless.models.logprobs import response_logprobs
from tearless.models.precision import configure_cuda
from tearless.models.weights import hf_weights, save_model
from tearless.run import guards
from tearless.run.timer import Timer
from tearless.workers.actor import Actor, AdapterOffLogProbWorker, LogProbWorker
from tearless.workers.build import ModelBuilder, build_rollout, rollout_dtype
from tearless.workers.critic import Critic, critic_settings
from tearless.workers.optim_state import load_optimizer, save_optimizer
from tearless.workers.schedule import (
    all_ranks_agree,
    micro_batches,
    pad_micro_batches,
    run_plan,
)
from tearless.workers.scoring import score_responses
from tearless.workers.spec import RankSpec, resolve_device, role_settings

ROLES = ("actor", "ref", "critic")
TRAINED = ("actor", "critic")
# A call to a rank is one of Rank's methods, passed as ``Rank.update`` (never its name as a string): a
# worker group calls it on its rank in this process, or by name on a Ray actor (ray_group.Pool.submit).
RankMethod = Callable[..., Any]


class Rank:
    """Rank ``rank`` of ``world``; every method but :meth:`info` and :meth:`address` needs
    :meth:`setup` first."""

    def __init__(self, rank: int, world: int, spec: RankSpec) -> None:
        self.rank, self.world, self.spec = rank, world, spec
        # Before any role is built: the losses its modules register (a Ray rank is another process).
        import_external_libs(spec.cfg)
        self.roles: dict[str, Any] = {}
        self.engine: Any = None
        self.reward: Any = None
        self.agent: Any = None
        self.weight_sync: Any = None
        self.separate_engine = False
        self.broadcasts = 0  # weight broadcasts received (split rollout ranks)
        self.held_version: int | None = None  # the policy version they carried, when known
        self._swap_seconds = 0.0  # receiving weights between two tokens (partial rollouts)
        self._idle_since: float | None = None  # a rollout-only rank: when its last call ended
        self._idle_seconds = 0.0  # … and its idle seconds not yet reported

    # ------------------------------------------------------------------ where and how it starts
    def info(self) -> dict[str, Any]:
        """Where this rank runs: its process id, host (for error messages and kill tests) and the
        device it trains on (``trainer.device`` resolved in this process)."""
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "device": resolve_device(self.spec.device),
        }

    def address(self) -> str:
        """A free TCP address for a rendezvous, on this node's routable IP (Ray's view of the node)."""
        host = "127.0.0.1"
        try:
            import ray

            if ray.is_initialized():
                host = ray.util.get_node_ip_address()
        except ImportError:
            pass
        with socket.socket() as s:
            s.bind((host, 0))
            return f"tcp://{host}:{s.getsockname()[1]}"

    def setup(self, init_method: str | None = None) -> None:
        """Join the process group (world > 1, or a one-rank group for a GPU process that offloads),
        then build the models, the engine and the scorers."""
        cfg, spec = self.spec.cfg, self.spec
        t, arr = cfg.trainer, cfg.actor_rollout_ref
        configure_cpu(t.num_threads, t.keep_freed_memory)
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        # trainer.device=auto is decided here, in the rank's own process, not by the driver.
        spec = self.spec = dataclasses.replace(spec, device=resolve_device(spec.device))
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            configure_cuda()
        self.mesh = None
        # FSDP2 shards the models of a group of ranks, and those of one GPU process that offloads a
        # role's parameters or optimizer state to CPU memory (FSDP2's offload, over a one-rank group).
        offload = self.device.type == "cuda" and any(
            f.param_offload or f.optimizer_offload
            for f in (arr.actor.fsdp_config, arr.ref.fsdp_config, cfg.critic.model.fsdp_config)
        )
        self.owns_group = False
        if self.world > 1 or spec.sharded or offload:
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh

            if self.device.type == "cuda":
                torch.cuda.set_device(0)  # Ray gives each worker one GPU, visible as device 0
            dist.init_process_group(
                process_group_backend(self.device.type),
                init_method=init_method or self.address(),
                rank=self.rank,
                world_size=self.world,
                timeout=timedelta(seconds=t.worker_timeout_s),
            )
            self.owns_group = True
            self.mesh = init_device_mesh(self.device.type, (self.world,))
        tok = arr.model.tokenizer_path or spec.model_path
        self.tokenizer = load_tokenizer(tok)
        self.models = ModelBuilder(spec, self.rank, self.world, self.mesh, self.device)
        settings = role_settings(cfg)
        if "actor" in spec.roles:
            self.roles["actor"] = Actor(
                self.models.causal_lm("actor", trained=True),
                arr.actor,
                settings=settings["actor"],
                temperature=arr.rollout.temperature,
                total_steps=spec.total_steps,
                log_prob_micro_batch_size=arr.rollout.log_prob_micro_batch_size_per_gpu,
                share_prompts=arr.model.share_prompt_forward,
                remove_padding=arr.model.use_remove_padding,
                fused_kernels=arr.model.use_fused_kernels,
            )
        if "ref" in spec.roles:
            ref_kw = dict(
                temperature=arr.rollout.temperature,
                micro_batch_size=arr.ref.log_prob_micro_batch_size_per_gpu,
                share_prompts=arr.model.share_prompt_forward,
                remove_padding=arr.model.use_remove_padding,
                fused_kernels=arr.model.use_fused_kernels,
            )
            if arr.model.lora_rank > 0:  # the actor's model with its adapters off
                self.roles["ref"] = AdapterOffLogProbWorker(self.roles["actor"].model, **ref_kw)
            else:
                self.roles["ref"] = LogProbWorker(self.models.causal_lm("ref", trained=False), **ref_kw)
        if "critic" in spec.roles:
            self.roles["critic"] = Critic(
                self.models.value_model(),
                critic_settings(cfg),
                settings=settings["critic"],
                total_steps=spec.total_steps,
                remove_padding=cfg.critic.model.use_remove_padding,
            )
        for role in TRAINED:
            if role in self.roles and self._optimizer_offloaded(role):
                move_optimizer_state(self.roles[role].optimizer, "cpu")
        if spec.rollout:
            trained = self.roles["actor"].model if "actor" in self.roles else None
            self.engine, self.reward, self.agent = build_rollout(spec, self.tokenizer, self.device, trained)
            # An engine holding its own copy of the policy beside the trained one (vLLM in the hybrid
            # placement) takes the new weights after every update.
            self.separate_engine = trained is not None and self.engine.capabilities.holds_own_weights

    # ------------------------------------------------------------------ rollout
    def _rollout_weights(self):
        """The context generation runs in: the hybrid engine's trained weights gathered from their
        shards (nothing to do for a plain model or a separate engine)."""
        from contextlib import nullcontext

        if self.engine.capabilities.holds_own_weights or "actor" not in self.roles:
            return nullcontext()
        return gathered(self.roles["actor"].model, self.models.fsdp("actor").reshard_after_forward)

    def generate_share(
        self,
        prompts: list[dict],
        n: int,
        keys: list[int] | None,
        max_new_tokens: int,
        sampling: dict[str, Any],
        version: int = 0,
    ) -> dict[str, Any] | None:
        """``n`` responses per prompt, scored: the rollout, per-response agent info (multi-turn), the
        scores (:func:`~tearless.workers.scoring.score_responses`) and the seconds of each part. A rank
        with no prompts still joins the gathering of the weights (a collective) and returns None.

        ``version`` is the policy version the driver expects this rank to hold; a split rollout rank
        knows its own (the one of the last broadcast it received), which is newer when it took an
        update between two tokens of an earlier call (partial rollouts). With the built-in engine,
        every token records the version it was sampled with (either engine); with
        ``async_training.partial_rollout``
        a split rollout rank takes new weights between two tokens (:meth:`take_new_weights`)."""
        timer = Timer()
        extra: dict[str, Any] = {}
        idle, self._idle_seconds = self._idle_seconds + self._idle(), 0.0
        with timer("gen"), self._rollout_weights():
            if not prompts:
                return None
            if self.agent is not None:
                res = self.agent.generate(prompts, n=n, max_new_tokens=max_new_tokens, keys=keys, **sampling)
                out, info = res.out, res.rows
            else:
                ids = [p["input_ids"] for p in prompts]
                extra["version"] = version if self.held_version is None else self.held_version
                if self.weight_sync is not None and self.spec.cfg.async_training.partial_rollout:
                    extra["between_tokens"] = self.take_new_weights
                out = self.engine.generate(
                    ids, n=n, max_new_tokens=max_new_tokens, keys=keys, **sampling, **extra
                )
                info = None
        items = [p for p in prompts for _ in range(n)]
        with timer("reward"):
            if getattr(self.agent, "owns_reward", False):  # environments and agent programs score
                scored = self.agent.score(self.tokenizer, out, info)
            else:
                scored = score_responses(self.tokenizer, self.reward, items, out)
        self._busy_until_now()
        seconds = {**timer.seconds, "gen_idle": idle}
        if "between_tokens" in extra:
            seconds["weight_swap"], self._swap_seconds = self._swap_seconds, 0.0
        return {"out": out, "info": info, **scored, "seconds": seconds, "pid": os.getpid()}

    def _idle(self) -> float:
        """Seconds a rollout-only rank sat without work since its last call (0 for other ranks,
        whose time between generations goes to training)."""
        if self.roles or self._idle_since is None:
            return 0.0
        return time.perf_counter() - self._idle_since

    def _busy_until_now(self) -> None:
        self._idle_since = time.perf_counter()

    # ------------------------------------------------------------------ forward-only passes
    def _forward_mode(self):
        # FSDP's all-gathers allocate parameters that later training passes reuse; inference-mode
        # tensors cannot take part in autograd, so sharded models use no_grad.
        return torch.no_grad() if self.mesh is not None else torch.inference_mode()

    def compute_log_prob(
        self, role: str, td: TensorDict, num_micro: int, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows, R) log-probs (and entropies) of this rank's rows under ``role``'s model, in
        ``num_micro`` passes (every rank of a sharded group runs the same number)."""
        worker = self.roles[role]
        chunks = micro_batches(td, size=worker.micro_batch_size)
        was_training = worker.model.training
        worker.model.eval()
        outs, ents = [], []
        try:
            with self._forward_mode(), worker.forward_context():
                for mb in pad_micro_batches(chunks, num_micro):
                    lp, ent = worker.forward(mb, with_entropy=with_entropy)
                    outs.append(lp.cpu())
                    ents.append(None if ent is None else ent.cpu())
        finally:
            worker.model.train(was_training)
        real = len(chunks)
        entropy = torch.cat(ents[:real]).clone() if with_entropy else None
        return torch.cat(outs[:real]).clone(), entropy

    def compute_values(self, td: TensorDict, num_micro: int) -> torch.Tensor:
        """(rows, R) critic values of this rank's rows, zero outside the loss mask."""
        critic = self.roles["critic"]
        chunks = micro_batches(td, size=critic.s.forward_micro_batch_size_per_gpu)
        was_training = critic.model.training
        critic.model.eval()
        outs = []
        try:
            with self._forward_mode():
                for mb in pad_micro_batches(chunks, num_micro):
                    outs.append(critic.values(mb).cpu() * mb["response_mask"])
        finally:
            critic.model.train(was_training)
        return torch.cat(outs[: len(chunks)]).clone()

    # ------------------------------------------------------------------ updates
    def update(
        self, role: str, td: TensorDict, steps: list[tuple], detached: bool = False
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Run this rank's share of a role's planned optimizer steps (:func:`run_plan`) with the
        role's loss and settings (``detached``: the actor's π_old is its detached π_θ); after the
        actor's, a separate engine in this process takes the new weights."""
        cfg = self.spec.cfg
        unit = self.roles[role]
        if role == "actor":

            def loss_fn(mb, norm):
                return unit.micro_loss(mb, norm, detached)
        else:
            loss_fn = unit.micro_loss
        offload = self._optimizer_offloaded(role)
        if offload:
            move_optimizer_state(unit.optimizer, self.device)
        additive, shared = run_plan(unit, td, steps, unit.settings, loss_fn, world=self.world)
        if offload:
            move_optimizer_state(unit.optimizer, "cpu")
        if role == "actor" and self.separate_engine:
            start = time.perf_counter()
            self.engine.load_weights(
                hf_weights(unit.model, resolve_dtype(rollout_dtype(cfg, self.spec.device)))
            )
            shared["timing_s/engine_load_weights"] = time.perf_counter() - start
        return additive, shared

    def _optimizer_offloaded(self, role: str) -> bool:
        """Whether ``role``'s optimizer state lives in CPU memory between updates and visits the GPU
        for each one (:func:`~tearless.distributed.fsdp.optimizer_state_moves`)."""
        fsdp = self.models.fsdp(role)
        return optimizer_state_moves(
            self.device.type, param_offload=fsdp.param_offload, optimizer_offload=fsdp.optimizer_offload
        )

    # ------------------------------------------------------------------ weights for separate engines
    def sync_engine(self) -> None:
        """Load the trained policy into this rank's separate engine (vLLM), e.g. before the first step."""
        actor = self.roles["actor"]
        dtype = resolve_dtype(rollout_dtype(self.spec.cfg, self.spec.device))
        self.engine.load_weights(hf_weights(actor.model, dtype))

    def probe_policy(self, ids: list[int]) -> torch.Tensor:
        """The actor's teacher-forced log-probs of ``ids[1:]`` at temperature 1, for the sync probe
        (:mod:`tearless.rollout.sync_probe`); every rank of a sharded actor runs the same forward."""
        model = self.roles["actor"].model
        row = torch.tensor([ids], dtype=torch.long)
        mask = torch.ones_like(row)
        was_training = model.training
        model.eval()
        try:
            with self._forward_mode():
                lp, _ = response_logprobs(model, row[:, :1], mask[:, :1], row[:, 1:], mask[:, 1:])
        finally:
            model.train(was_training)
        return lp[0].float().cpu().clone()

    def probe_engine(self, ids: list[int]) -> torch.Tensor | None:
        """The engine's log-probs of ``ids[1:]`` (None for the built-in engine: no separate copy)."""
        probe = getattr(self.engine, "probe_logprobs", None)
        return None if probe is None else probe(ids)

    def open_weight_sync(self, address: str, sync_rank: int, sync_world: int) -> None:
        """Join the weight-broadcast group of the split placement: training rank 0 (sync rank 0) and
        every rollout rank (gloo on CPU, NCCL on GPU)."""
        self.weight_sync = WeightBroadcast(
            address,
            sync_rank,
            sync_world,
            device=self.device,
            timeout_s=self.spec.cfg.trainer.worker_timeout_s,
        )

    def send_weights(self, version: int | None = None) -> None:
        """Training ranks: gather the policy (policy ``version``) one tensor at a time; rank 0
        announces the broadcast and sends it to the rollout ranks."""
        if self.weight_sync is not None:
            self.weight_sync.announce(version)
        dtype = resolve_dtype(rollout_dtype(self.spec.cfg, self.spec.device))
        for _, tensor in hf_weights(self.roles["actor"].model, dtype):
            if self.weight_sync is not None:
                self.weight_sync.broadcast(tensor.to(self.device).contiguous())

    def receive_weights(self, upto: int) -> float:
        """Rollout ranks: take the broadcasts of training rank 0 into the engine until ``upto`` of
        them have arrived (none left when a partial rollout took them between two tokens); returns
        the seconds from the first tensor's arrival to the engine holding them all."""
        seconds = 0.0
        while self.broadcasts < upto:
            tensors = self._received()
            first = next(tensors)  # waits for the training ranks to send: idle, not copying
            self._idle_seconds += self._idle()
            start = time.perf_counter()
            self._load(chain([first], tensors))
            self._busy_until_now()
            seconds += time.perf_counter() - start
        return seconds

    def take_new_weights(self) -> int | None:
        """Between two tokens of a partial rollout: None when no broadcast was announced since the
        last one received; otherwise receive every announced one and return the policy version of
        the weights now in the engine (the decode loop then re-prefills its responses)."""
        announced = self.weight_sync.announced()
        if announced <= self.broadcasts:
            return None
        start = time.perf_counter()
        while self.broadcasts < announced:
            self._load(self._received())
        self._swap_seconds += time.perf_counter() - start
        if self.held_version is None:
            raise RuntimeError(
                "weights without a policy version arrived during generation: only the first load "
                "(before any generation) may leave the version unknown"
            )
        return self.held_version

    def _load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(weights)
        self.broadcasts += 1
        self.held_version = self.weight_sync.version_of(self.broadcasts)

    def _received(self) -> Iterator[tuple[str, torch.Tensor]]:
        dtype = resolve_dtype(rollout_dtype(self.spec.cfg, self.spec.device))
        skeleton = load_causal_lm(self.spec.model_path, dtype="float32", meta=True)
        for name, like in skeleton.state_dict().items():
            yield name, self.weight_sync.broadcast(torch.empty(like.shape, dtype=dtype, device=self.device))

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str) -> dict[str, Any]:
        """Write the trained roles into checkpoint ``directory``: rank 0 the ``save_pretrained``
        directories (``actor/``, ``critic/``, and ``actor_merged/`` on request), every rank its
        optimizer shard (``optim/<role>/``). Returns each role's schedule and skipped-step count."""
        directory = Path(directory)
        write = self.rank == 0
        state: dict[str, Any] = {}
        m = self.spec.cfg.actor_rollout_ref.model
        for role in TRAINED:
            if role not in self.roles:
                continue
            unit = self.roles[role]
            save_model(unit.model, directory / role, write=write)
            if role == "actor" and m.lora_rank > 0 and m.lora_save_merged:
                save_model(unit.model, directory / "actor_merged", write=write, merged=True)
            save_optimizer(unit.model, unit.optimizer, directory / "optim" / role)
            state[role] = {"scheduler": unit.scheduler.state_dict(), "skipped_steps": unit.skipped_steps}
        return state

    def load(self, directory: str, state: dict[str, Any]) -> None:
        """Restore the trained roles' optimizer state (any saving placement) and schedules."""
        cfg = self.spec.cfg
        for role in TRAINED:
            if role not in self.roles:
                continue
            unit = self.roles[role]
            load_optimizer(unit.model, unit.optimizer, Path(directory) / "optim" / role)
            unit.scheduler.load_state_dict(state[role]["scheduler"])
            unit.skipped_steps = int(state[role]["skipped_steps"])
            # Settings that resume was allowed to change (trainer.resume_allow_changes) take effect.
            optim = cfg.critic.optim if role == "critic" else cfg.actor_rollout_ref.actor.optim
            resume_compat.apply_config({role: (unit.optimizer, unit.scheduler, optim)}, None, cfg)

    def check_weights(self, step: int, probe: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The bad-step guard's weight check (:func:`tearless.run.guards.check_weights`) on the
        trained roles this rank holds, agreed by all ranks."""
        actor, critic = self.roles.get("actor"), self.roles.get("critic")
        guards.check_weights(
            step,
            actor.model if actor is not None else None,
            critic.model if critic is not None else None,
            self.spec.cfg,
            probe,
            agree=lambda ok: all_ranks_agree(ok, self.world),
        )

    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far (non-finite), actor and critic together."""
        return sum(self.roles[r].skipped_steps for r in TRAINED if r in self.roles)

    def close(self) -> None:
        """Stop the reward processes and leave the process group this rank made (idempotent)."""
        if self.reward is not None:
            self.reward.close()
            self.reward = None
        if getattr(self, "owns_group", False):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.owns_group = False
