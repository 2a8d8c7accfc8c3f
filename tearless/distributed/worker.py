"""One rank of a worker group: the plain actor / reference / critic classes over FSDP2-sharded models.

A ``RankWorker`` lives in its own process (a Ray actor) and joins a ``torch.distributed`` process
group (gloo on CPU, NCCL on GPU). It holds the same :class:`~tearless.workers.actor.Actor`,
:class:`~tearless.workers.actor.LogProbWorker` and :class:`~tearless.workers.critic.Critic` as the
single-process trainer, built on sharded models, and runs the update schedule the driver planned
(:func:`tearless.distributed.partition.plan_updates`).

Loss scaling. The single-process update minimises, per mini-batch, Σ_mb L_mb with every L_mb
normalised by the mini-batch's global token (or sequence) count, so Σ_mb ∇L_mb is the gradient of the
whole mini-batch. Here rank r holds a slice of the micro-batches; FSDP's reduce-scatter *averages*
gradients over the W ranks, giving (1/W) Σ_r Σ_{mb∈r} ∇L_mb. Each rank therefore back-propagates
W · L_mb, and the average is exactly Σ_mb ∇L_mb. Ranks with fewer micro-batches than the busiest one
run padding passes (one real row, loss × 0) so that every rank joins the same collectives.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from tearless.config import Config
from tearless.cpu import configure_cpu
from tearless.distributed.fsdp import (
    clip_grad_norm,
    full_state_dict,
    load_optimizer,
    move_optimizer_state,
    save_optimizer,
    shard_model,
)
from tearless.models.loading import load_causal_lm, resolve_dtype
from tearless.models.value import load_value_model
from tearless.workers.actor import Actor, LogProbWorker, micro_batches
from tearless.workers.critic import Critic, critic_settings

ROLES = ("actor", "ref", "critic")


@dataclasses.dataclass
class WorkerSpec:
    """What every rank of a group builds: its roles, where each role's weights come from, the config."""

    cfg: Config
    roles: tuple[str, ...]
    paths: dict[str, str]
    total_steps: int
    device: str  # "cpu" or "cuda"
    timeout_s: float


def pad_micro_batches(chunks: list[TensorDict], count: int) -> list[TensorDict]:
    """``chunks`` followed by one-row padding chunks up to ``count`` (see the module docstring)."""
    return chunks + [chunks[0][:1]] * (count - len(chunks))


class RankWorker:
    """Rank ``rank`` of ``world``; every method but ``info`` and ``address`` needs ``setup`` first."""

    def __init__(self, rank: int, world: int, spec: WorkerSpec) -> None:
        self.rank, self.world, self.spec = rank, world, spec
        self.roles: dict[str, Any] = {}

    def info(self) -> dict[str, Any]:
        """Where this rank runs: its process id and host name (for error messages and kill tests)."""
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname()}

    def address(self) -> str:
        """A free TCP address on this host for the process group's rendezvous (asked of rank 0)."""
        host = socket.gethostbyname(socket.gethostname())
        with socket.socket() as s:
            s.bind(("", 0))
            return f"tcp://{host}:{s.getsockname()[1]}"

    def setup(self, init_method: str) -> None:
        """Join the process group, then load, shard and wrap each role's model."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        cfg, spec = self.spec.cfg, self.spec
        configure_cpu(cfg.trainer.num_threads, cfg.trainer.keep_freed_memory)
        torch.manual_seed(cfg.trainer.seed)
        cuda = spec.device == "cuda"
        if cuda:
            torch.cuda.set_device(0)  # Ray exposes one GPU per worker as device 0
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=init_method,
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=spec.timeout_s),
        )
        self.device = torch.device("cuda" if cuda else "cpu")
        self.mesh = init_device_mesh(self.device.type, (self.world,))
        arr = cfg.actor_rollout_ref
        for role in spec.roles:
            if role == "actor":
                model = self._shard(
                    load_causal_lm(
                        spec.paths["actor"],
                        dtype=arr.model.dtype,
                        gradient_checkpointing=arr.model.enable_gradient_checkpointing,
                    ),
                    arr.actor.fsdp_config,
                )
                self.roles["actor"] = Actor(
                    model,
                    arr.actor,
                    rollout_n=arr.rollout.n,
                    temperature=arr.rollout.temperature,
                    total_steps=spec.total_steps,
                    log_prob_micro_batch_size=arr.rollout.log_prob_micro_batch_size_per_gpu,
                )
            elif role == "ref":
                model = load_causal_lm(spec.paths["ref"], dtype=arr.model.dtype).requires_grad_(False)
                self.roles["ref"] = LogProbWorker(
                    self._shard(model, arr.ref.fsdp_config),
                    temperature=arr.rollout.temperature,
                    micro_batch_size=arr.ref.log_prob_micro_batch_size_per_gpu,
                )
            elif role == "critic":
                model = load_value_model(
                    spec.paths["critic"],
                    dtype=arr.model.dtype,
                    gradient_checkpointing=cfg.critic.model.enable_gradient_checkpointing,
                )
                self.roles["critic"] = Critic(
                    self._shard(model, cfg.critic.model.fsdp_config),
                    critic_settings(cfg),
                    rollout_n=arr.rollout.n,
                    total_steps=spec.total_steps,
                )
            else:
                raise ValueError(f"unknown worker role {role!r}; roles are {', '.join(ROLES)}")
        for worker in self.roles.values():
            if hasattr(worker, "optimizer") and self._offload_optimizer(worker):
                move_optimizer_state(worker.optimizer, "cpu")

    def _shard(self, model: torch.nn.Module, fsdp_cfg) -> torch.nn.Module:
        cuda = self.device.type == "cuda"
        if cuda and not fsdp_cfg.param_offload:
            model = model.to(self.device)
        shard_model(
            model,
            self.mesh,
            param_offload=fsdp_cfg.param_offload and cuda,
            param_dtype=resolve_dtype(fsdp_cfg.param_dtype) if cuda else None,
            reshard_after_forward=fsdp_cfg.reshard_after_forward,
        )
        if cuda:
            model.tearless_compute_device = self.device
        return model

    def _offload_optimizer(self, worker) -> bool:
        cfg = self.spec.cfg
        fsdp_cfg = (
            cfg.critic.model.fsdp_config
            if isinstance(worker, Critic)
            else cfg.actor_rollout_ref.actor.fsdp_config
        )
        return fsdp_cfg.optimizer_offload and self.device.type == "cuda"

    # ------------------------------------------------------------------ forward-only passes
    @torch.no_grad()
    def compute_log_prob(self, role: str, td: TensorDict, num_micro: int) -> torch.Tensor:
        """(rows, R) log-probs of this rank's rows under ``role``'s model, in ``num_micro`` passes."""
        worker = self.roles[role]
        chunks = micro_batches(td, size=worker.micro_batch_size)
        was_training = worker.model.training
        worker.model.eval()
        outs = [worker.forward(mb)[0].cpu() for mb in pad_micro_batches(chunks, num_micro)]
        worker.model.train(was_training)
        return torch.cat(outs[: len(chunks)])

    @torch.no_grad()
    def compute_values(self, td: TensorDict, num_micro: int) -> torch.Tensor:
        """(rows, R) critic values of this rank's rows, zero outside the response mask."""
        from tearless.models.value import response_values

        critic = self.roles["critic"]
        chunks = micro_batches(td, size=critic.s.forward_micro_batch_size_per_gpu)
        was_training = critic.model.training
        critic.model.eval()
        outs = []
        for mb in pad_micro_batches(chunks, num_micro):
            values = response_values(
                critic.model, mb["prompt_ids"], mb["prompt_mask"], mb["response_ids"], mb["response_mask"]
            )
            outs.append(values.cpu() * mb["response_mask"])
        critic.model.train(was_training)
        return torch.cat(outs[: len(chunks)])

    # ------------------------------------------------------------------ updates
    def update(
        self, role: str, td: TensorDict, plans: list[tuple[list[int], dict, int]], use_detached_old: bool
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Run the planned optimizer steps on this rank's rows ``td``.

        ``plans`` holds, per optimizer step, this rank's rows (indices into ``td``), the mini-batch's
        global normalisers and the micro-batch count every rank runs. Returns (metrics that add up
        over ranks, metrics equal on every rank).
        """
        if role == "actor":
            worker = self.roles["actor"]
            s = worker.cfg
            micro_loss = lambda mb, norm: worker._micro_loss(mb, norm, use_detached_old)  # noqa: E731
            prefix, micro_size = "actor", s.ppo_micro_batch_size_per_gpu
            token_budget = s.ppo_max_token_len_per_gpu if s.use_dynamic_bsz else None
        else:
            worker = self.roles["critic"]
            s = worker.s
            micro_loss, prefix, micro_size = worker._micro_loss, "critic", s.ppo_micro_batch_size_per_gpu
            token_budget = s.ppo_max_token_len_per_gpu if s.use_dynamic_bsz else None
        offload = self._offload_optimizer(worker)
        worker.model.train()
        sums: dict[str, float] = defaultdict(float)
        grad_norms = 0.0
        for rows, norm, num_micro in plans:
            mini = td[rows]
            worker.optimizer.zero_grad(set_to_none=True)
            chunks = micro_batches(mini, size=None if token_budget else micro_size, token_budget=token_budget)
            for i, mb in enumerate(pad_micro_batches(chunks, num_micro)):
                loss, metrics = micro_loss(mb, norm)
                real = i < len(chunks)
                (loss * (self.world if real else 0.0)).backward()
                if real:
                    for k, v in metrics.items():
                        sums[k] += float(v)
            if offload:
                move_optimizer_state(worker.optimizer, self.device)
            grad_norm = clip_grad_norm(worker.params, s.grad_clip)
            if torch.isfinite(grad_norm):
                worker.optimizer.step()
            else:
                worker.skipped_steps += 1
                worker.optimizer.zero_grad(set_to_none=True)
            if offload:
                move_optimizer_state(worker.optimizer, "cpu")
            grad_norms += float(grad_norm)
        steps = len(plans)
        shared = {
            f"{prefix}/grad_norm": grad_norms / steps,
            f"{prefix}/lr": worker.optimizer.param_groups[0]["lr"],
        }
        worker.scheduler.step()
        shared[f"{prefix}/skipped_steps"] = float(worker.skipped_steps)
        shared[f"{prefix}/num_optimizer_steps"] = float(steps)
        return {k: v / steps for k, v in sums.items()}, shared

    # ------------------------------------------------------------------ weights and checkpoints
    def state_dict(self, role: str) -> dict[str, torch.Tensor]:
        """The consolidated weights of ``role``'s model on rank 0 (empty elsewhere); a collective."""
        return full_state_dict(self.roles[role].model)

    def save(self, role: str, path: str) -> None:
        """Write ``role``'s sharded optimizer state under ``path`` (DCP; a collective)."""
        worker = self.roles[role]
        save_optimizer(worker.model, worker.optimizer, Path(path))

    def train_state(self, role: str) -> dict[str, Any]:
        """The replicated part of ``role``'s training state: LR schedule and skipped-step count."""
        worker = self.roles[role]
        return {"scheduler": worker.scheduler.state_dict(), "skipped_steps": worker.skipped_steps}

    def load(self, role: str, path: str, state: dict[str, Any]) -> None:
        """Restore ``role``'s optimizer shards from ``path`` (any saving world size) and ``state``."""
        worker = self.roles[role]
        load_optimizer(worker.model, worker.optimizer, Path(path))
        worker.scheduler.load_state_dict(state["scheduler"])
        worker.skipped_steps = state["skipped_steps"]
