"""One rank of a worker group: its models, optimizers, rollout engine, reward scoring and tool loop.

A :class:`Rank` is the same object in every placement: the single-process trainer holds one, in its
own process (world size 1, plain models); a Ray worker group holds one per worker process, joined
in a ``torch.distributed`` group (gloo on CPU, NCCL on GPU) over FSDP2-sharded models. The trainer
never sees a rank; it talks to the group (:mod:`tearless.workers.group`).

What a rank holds depends on the placement:

- ``roles``: the trained and forward-only models it shards (``actor``, ``ref``, ``teacher``, ``critic``);
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

import contextlib
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
from tearless.models.copies import copies_for
from tearless.models.loading import load_causal_lm, load_tokenizer, resolve_dtype
from tearless.models.logprobs import response_logprobs
from tearless.models.precision import configure_cuda, forward_only, set_compute_dtype
from tearless.models.weights import hf_weights, save_model
from tearless.run import guards
from tearless.run.timer import Timer
from tearless.workers.actor import Actor, AdapterOffLogProbWorker, LogProbWorker
from tearless.workers.build import ModelBuilder, build_rollout, rule_reward_manager
from tearless.workers.critic import Critic
from tearless.workers.optim_state import load_optimizer, save_optimizer
from tearless.workers.schedule import (
    UpdateFlags,
    UpdateSettings,
    all_ranks_agree,
    micro_batches,
    pad_micro_batches,
    run_plan,
)
from tearless.workers.scoring import score_responses
from tearless.workers.spec import RankSpec, resolve_device, role_settings

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
        import_external_libs(spec.sections.model)
        self.roles: dict[str, Any] = {}
        self.engine: Any = None
        self.reward: Any = None
        self.rule_reward: Any = None  # validation's rule scorers beside a reward model or judge
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
        self._start_process()
        self._join_group(init_method)
        spec = self.spec
        self.tokenizer = load_tokenizer(spec.sections.model.tokenizer_path or spec.model_path)
        self.models = ModelBuilder(spec, self.rank, self.world, self.mesh, self.device)
        settings = role_settings(spec)
        if "actor" in spec.roles:
            self._build_actor(settings["actor"])
        self._build_forward_only()
        if "critic" in spec.roles:
            self.roles["critic"] = Critic(
                self.models.value_model(),
                spec.plan.critic_section,
                settings=settings["critic"],
                total_steps=spec.total_steps,
                remove_padding=spec.sections.critic.model.use_remove_padding,
            )
        for role in TRAINED:
            if role in self.roles and self._optimizer_offloaded(role):
                move_optimizer_state(self.roles[role].optimizer, "cpu")
        if spec.rollout:
            # The engine samples from the trained actor (hybrid), from a policy the spec holds without
            # training it (tearless eval), or from a copy of its own (a separate rollout rank).
            held = "actor" in self.roles
            trained = self.roles["actor"].model if held else spec.models.get("actor")
            self.engine, self.reward, self.agent = build_rollout(spec, self.tokenizer, self.device, trained)
            # An engine holding its own copy of the policy beside the trained one (vLLM in the hybrid
            # placement) takes the new weights after every update.
            self.separate_engine = held and self.engine.capabilities.holds_own_weights

    def _start_process(self) -> None:
        """This process's threads, seeds and device: ``trainer.device=auto`` is decided here, in the
        rank's own process, not by the driver (the spec keeps the resolved name)."""
        t = self.spec.sections.trainer
        configure_cpu(t.num_threads, t.keep_freed_memory)
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        self.spec = self.spec.replaced(device=resolve_device(self.spec.device))
        self.device = torch.device(self.spec.device)
        if self.device.type == "cuda":
            configure_cuda()

    def _join_group(self, init_method: str | None) -> None:
        """Join the ranks' ``torch.distributed`` group and make their device mesh (``self.mesh``, None
        for a plain world-size-1 rank). FSDP2 shards the models of a group of ranks, and those of one
        GPU process that offloads a role's parameters or optimizer state to CPU memory (FSDP2's
        offload, over a one-rank group)."""
        spec = self.spec
        self.mesh = None
        self.owns_group = False
        if not (spec.plan.sharded(self.device.type, self.world) or spec.sharded):
            return
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if self.device.type == "cuda":
            torch.cuda.set_device(0)  # Ray gives each worker one GPU, visible as device 0
        dist.init_process_group(
            process_group_backend(self.device.type),
            init_method=init_method or self.address(),
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=spec.sections.trainer.worker_timeout_s),
        )
        self.owns_group = True
        self.mesh = init_device_mesh(self.device.type, (self.world,))

    def _forward_settings(self) -> dict[str, Any]:
        """The settings every log-prob forward shares (the actor's, the reference's, the teacher's);
        each role adds its own micro-batch size."""
        sections = self.spec.sections
        return dict(
            temperature=sections.rollout.temperature,
            share_prompts=sections.model.share_prompt_forward,
            remove_padding=sections.model.use_remove_padding,
            fused_kernels=sections.model.use_fused_kernels,
        )

    def _build_actor(self, settings: UpdateSettings) -> None:
        """The trained policy: its model, optimizer and schedule."""
        sections = self.spec.sections
        self.roles["actor"] = Actor(
            self.models.causal_lm("actor", trained=True),
            sections.actor,
            settings=settings,
            total_steps=self.spec.total_steps,
            log_prob_micro_batch_size=sections.rollout.log_prob_micro_batch_size_per_gpu,
            **self._forward_settings(),
        )

    def _build_forward_only(self) -> None:
        """The forward-only roles this rank holds: the reference (the LoRA actor's model with its
        adapters off, else its own frozen copy) and the teacher (the reference's forward over the
        teacher's own weights)."""
        spec, sections = self.spec, self.spec.sections
        forward_kw = dict(
            self._forward_settings(), entropy_chunking=sections.actor.entropy_from_logits_with_chunking
        )
        if "ref" in spec.roles:
            ref_kw = dict(forward_kw, micro_batch_size=sections.ref.log_prob_micro_batch_size_per_gpu)
            if sections.model.lora_rank > 0:
                self.roles["ref"] = AdapterOffLogProbWorker(self.roles["actor"].model, **ref_kw)
            else:
                self.roles["ref"] = LogProbWorker(self.models.causal_lm("ref", trained=False), **ref_kw)
        if "teacher" in spec.roles:
            self.roles["teacher"] = LogProbWorker(
                self.models.causal_lm("teacher", trained=False),
                micro_batch_size=sections.teacher.log_prob_micro_batch_size_per_gpu,
                **forward_kw,
            )

    # ------------------------------------------------------------------ rollout
    @contextlib.contextmanager
    def _rollout_weights(self) -> Iterator[None]:
        """The context generation runs in: the hybrid engine's trained weights gathered from their
        shards, or its compute copies in place (nothing to do for a plain model or a separate
        engine)."""
        if self.engine.capabilities.holds_own_weights or "actor" not in self.roles:
            yield
            return
        model = self.roles["actor"].model
        # Compute copies sample when the engine computes in their dtype; rollout.dtype=float32 samples
        # from the float32 masters.
        sampled = self.spec.plan.hybrid_rollout_dtype(self.spec.device, warn=False)
        with gathered(model, self.models.fsdp("actor").reshard_after_forward), copies_for(model, sampled):
            yield

    def generate_share(
        self,
        prompts: list[dict],
        n: int,
        keys: list[int] | None,
        max_new_tokens: int,
        sampling: dict[str, Any],
        version: int = 0,
        rule_scored: bool = False,
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
                if "multi_modal_inputs" in prompts[0]:  # a vision-language policy: each prompt's images
                    if self.engine.capabilities.raw_images:
                        extra["images"] = [p["multi_modal_prompt"] for p in prompts]
                    else:
                        extra["vision"] = [p["multi_modal_inputs"] for p in prompts]
                if self.weight_sync is not None and self.spec.sections.async_training.partial_rollout:
                    extra["between_tokens"] = self.take_new_weights
                out = self.engine.generate(
                    ids, n=n, max_new_tokens=max_new_tokens, keys=keys, **sampling, **extra
                )
                info = None
        items = [p for p in prompts for _ in range(n)]
        with timer("reward"):
            if self.agent is not None and self.agent.owns_reward:  # a RewardingLoop: envs, agent programs
                scored = self.agent.score(self.tokenizer, out, info)
            else:
                reward = self._rule_reward() if rule_scored else self.reward
                scored = score_responses(self.tokenizer, reward, items, out)
        self._busy_until_now()
        seconds = {**timer.seconds, "gen_idle": idle}
        if "between_tokens" in extra:
            seconds["weight_swap"], self._swap_seconds = self._swap_seconds, 0.0
        return {"out": out, "info": info, **scored, "seconds": seconds, "pid": os.getpid()}

    def _rule_reward(self) -> Any:
        """The rule scorers alone (built at the first call, kept): what validation scores with when the
        training reward is a reward model or a judge (:func:`~tearless.workers.build.rule_reward_manager`)."""
        if self.rule_reward is None:
            self.rule_reward = rule_reward_manager(self.spec, self.device)
        return self.rule_reward

    def _idle(self) -> float:
        """Seconds a rollout-only rank sat without work since its last call (0 for other ranks,
        whose time between generations goes to training)."""
        if self.roles or self._idle_since is None:
            return 0.0
        return time.perf_counter() - self._idle_since

    def _busy_until_now(self) -> None:
        self._idle_since = time.perf_counter()

    # ------------------------------------------------------------------ forward-only passes
    def _forward_mode(self, model: torch.nn.Module):
        # FSDP's all-gathers allocate parameters that later training passes reuse; inference-mode
        # tensors cannot take part in autograd, so sharded models use no_grad. A model under CPU bf16
        # autocast too: its weights' casts are then made once per forward, not once per matmul.
        if self.mesh is not None:
            return torch.no_grad()
        return forward_only(self.device, getattr(model, "tearless_compute_dtype", None))

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
            with self._forward_mode(worker.model), copies_for(worker.model), worker.forward_context():
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
            with self._forward_mode(critic.model), copies_for(critic.model):
                for mb in pad_micro_batches(chunks, num_micro):
                    outs.append(critic.values(mb).cpu() * mb["response_mask"])
        finally:
            critic.model.train(was_training)
        return torch.cat(outs[: len(chunks)]).clone()

    # ------------------------------------------------------------------ updates
    def update(
        self, role: str, td: TensorDict, steps: list[tuple], flags: UpdateFlags
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Run this rank's share of a role's planned optimizer steps (:func:`run_plan`: the role's
        ``micro_loss`` reads ``flags``, its settings are its own); after the actor's, a separate
        engine in this process takes the new weights."""
        unit = self.roles[role]
        offload = self._optimizer_offloaded(role)
        if offload:
            move_optimizer_state(unit.optimizer, self.device)
        with copies_for(unit.model):  # bf16 copies of the float32 masters, when the role has them
            additive, shared = run_plan(unit, td, steps, flags, world=self.world)
        if offload:
            move_optimizer_state(unit.optimizer, "cpu")
        if role == "actor" and self.separate_engine:
            start = time.perf_counter()
            shared["rollout/engine_sync_mb"] = self._sync_engine(unit.model) / 2**20
            shared["timing_s/engine_load_weights"] = time.perf_counter() - start
        return additive, shared

    def _sync_engine(self, model: torch.nn.Module) -> int:
        """Give this rank's separate engine the policy; return the bytes sent: the LoRA adapter alone
        (a PEFT directory the engine serves through its LoRA support) when it takes adapters, else
        every merged weight in the rollout dtype."""
        if getattr(self.engine, "adapters", False):
            path = self.engine.adapter_dir()
            save_model(model, path, write=True)  # every rank: each serves its own engine
            self.engine.use_adapter(path)
            return sum(f.stat().st_size for f in Path(path).iterdir())
        sent = 0

        def counted(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal sent
            for name, tensor in weights:
                sent += tensor.numel() * tensor.element_size()
                yield name, tensor

        dtype = resolve_dtype(self.spec.plan.rollout_dtype(self.spec.device))
        self.engine.load_weights(counted(hf_weights(model, dtype)))
        return sent

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
        self._sync_engine(self.roles["actor"].model)

    def probe_policy(self, ids: list[int]) -> torch.Tensor:
        """The actor's teacher-forced log-probs of ``ids[1:]`` at temperature 1, for the sync probe
        (:mod:`tearless.rollout.sync_probe`); every rank of a sharded actor runs the same forward."""
        model = self.roles["actor"].model
        row = torch.tensor([ids], dtype=torch.long)
        mask = torch.ones_like(row)
        was_training = model.training
        # The probe checks the weights the engine holds, so the trainer's side computes in the engine's
        # dtype: a model marked to compute in bf16 under autocast (param_dtype=auto on a CPU with native
        # bf16) against a float32 engine differed by 0.145 on SmolLM2 and stopped every such run. A
        # model with compute copies probes from them when the engine holds that dtype, else from its
        # float32 masters.
        engine_dtype = resolve_dtype(self.spec.plan.rollout_dtype(self.spec.device))
        marked = getattr(model, "tearless_compute_dtype", None)
        if marked is not None:
            set_compute_dtype(model, engine_dtype)
        model.eval()
        try:
            with self._forward_mode(model), copies_for(model, engine_dtype):
                lp, _ = response_logprobs(model, row[:, :1], mask[:, :1], row[:, 1:], mask[:, 1:])
        finally:
            model.train(was_training)
            if marked is not None:
                set_compute_dtype(model, marked)
        return lp[0].float().cpu().clone()

    def probe_engine(self, ids: list[int]) -> tuple[torch.Tensor, str | None] | None:
        """The engine's log-probs of ``ids[1:]`` and its weight checksum's fault (None: the sampled
        weights equal what was sent); None for the built-in engine (no separate copy)."""
        probe = getattr(self.engine, "probe_logprobs", None)
        return None if probe is None else (probe(ids), self.engine.weight_fault())

    def open_weight_sync(self, address: str, sync_rank: int, sync_world: int) -> None:
        """Join the weight-broadcast group of the split placement: training rank 0 (sync rank 0) and
        every rollout rank (gloo on CPU, NCCL on GPU)."""
        self.weight_sync = WeightBroadcast(
            address,
            sync_rank,
            sync_world,
            device=self.device,
            timeout_s=self.spec.sections.trainer.worker_timeout_s,
        )

    def send_weights(self, version: int | None = None) -> None:
        """Training ranks: gather the policy (policy ``version``) one tensor at a time; rank 0
        announces the broadcast and sends it to the rollout ranks."""
        if self.weight_sync is not None:
            self.weight_sync.announce(version)
        dtype = resolve_dtype(self.spec.plan.rollout_dtype(self.spec.device))
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
        dtype = resolve_dtype(self.spec.plan.rollout_dtype(self.spec.device))
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
        m = self.spec.sections.model
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
        sections = self.spec.sections
        for role in TRAINED:
            if role not in self.roles:
                continue
            unit = self.roles[role]
            load_optimizer(unit.model, unit.optimizer, Path(directory) / "optim" / role)
            unit.scheduler.load_state_dict(state[role]["scheduler"])
            unit.skipped_steps = int(state[role]["skipped_steps"])
            # Settings that resume was allowed to change (trainer.resume_allow_changes) take effect.
            optim = sections.critic.optim if role == "critic" else sections.actor.optim
            resume_compat.apply_config({role: (unit.optimizer, unit.scheduler, optim)})

    def check_weights(self, step: int, probe: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The bad-step guard's weight check (:func:`tearless.run.guards.check_weights`) on the
        trained roles this rank holds, agreed by all ranks."""
        actor, critic = self.roles.get("actor"), self.roles.get("critic")
        sections = self.spec.sections
        guards.check_weights(
            step,
            actor.model if actor is not None else None,
            critic.model if critic is not None else None,
            {"actor": sections.actor.optim.lr, "critic": sections.critic.optim.lr},
            sections.trainer.default_local_dir,
            probe,
            agree=lambda ok: all_ranks_agree(ok, self.world),
        )

    def close(self) -> None:
        """Stop the reward processes and the engine's own processes, close the weight broadcast and
        leave the process group this rank made (idempotent)."""
        close_engine = getattr(self.engine, "close", None)
        if close_engine is not None:
            close_engine()
        for manager in (self.reward, self.rule_reward):
            if manager is not None:
                manager.close()
        self.reward = self.rule_reward = None
        if self.weight_sync is not None:
            self.weight_sync.close()
            self.weight_sync = None
        if getattr(self, "owns_group", False):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.owns_group = False
