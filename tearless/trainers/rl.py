"""The RL trainer of the PPO family (GRPO, RLOO, REINFORCE++, ReMax, OPO, … are estimator choices).

One step, in order (``RLTrainer.train_step``):
  1. rollout: sample ``rollout.n`` responses per prompt with the built-in KV-cache sampler;
  2. reward: decode and score each response (process pool, per-sample timeout), the score placed
     on its last valid token;
  3. old log-probs (skipped when the update is provably on-policy) and reference log-probs (only
     when a KL term is on);
  4. KL in reward (optional) and advantages, grouped by each prompt's ``uid``;
  5. actor update: PPO epochs over mini-batches, micro-batched, globally normalised.
Validation, metrics, rollout samples and checkpoints happen around it in ``fit``.
"""

from __future__ import annotations

import json
import random
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from tearless import faults
from tearless.algos import compute_advantage, filter_groups, make_kl_controller
from tearless.config import Config, to_dict
from tearless.cpu import configure_cpu
from tearless.data import PromptDataset, PromptLoader, load_many
from tearless.distributed import uses_ray
from tearless.models.loading import load_causal_lm, load_tokenizer
from tearless.models.value import load_value_model
from tearless.rewards import load_reward_function, make_reward_manager
from tearless.rewards.steps import rollout_token_rewards, step_fields
from tearless.rollout.correction import rollout_correction
from tearless.rollout.hf import HFRollout, RolloutOutput, concat_rollouts, select_rows
from tearless.trainers import checkpoint as ckpt
from tearless.trainers.metrics import Timer, data_metrics, pass_at_k, zero_variance_group_ratio
from tearless.trainers.records import ROLLOUTS_FILE, append_step, truncate_records
from tearless.trainers.tracking import Tracker, read_metrics, truncate_jsonl
from tearless.workers.actor import Actor, AdapterOffLogProbWorker, LogProbWorker, reward_kl
from tearless.workers.critic import Critic, critic_settings, critic_value_stats, explained_variance


def critic_enabled(cfg: Config) -> bool:
    """A critic is trained when ``critic.enable`` says so, or (null) when the estimator is GAE."""
    enable = cfg.critic.enable
    return cfg.algorithm.adv_estimator == "gae" if enable is None else bool(enable)


def score_positions(mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's last token with mask 1, where its score goes (0 for an empty row).

    Not ``mask.sum(-1) - 1``: in a multi-turn rollout the mask has holes where tool output is, and
    the last model token sits after them.
    """
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)
    return torch.where(mask.any(-1), last, 0)


def uid_index(uids: list[str]) -> torch.Tensor:
    """Each row's group as a small integer (first appearance order), so tensors can carry the uid."""
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(u, len(ids)) for u in uids], dtype=torch.long)


def _step_generator(seed: int, step: int, stream: int) -> torch.Generator:
    """Randomness of step ``step`` derived from the seed alone, so a resumed run draws what the
    uninterrupted run drew."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + stream)


class TrainingStopped(RuntimeError):
    """The run stopped itself (``trainer.max_bad_steps`` non-finite steps in a row); the message says why
    and which checkpoint to resume from."""


class RLTrainer:
    """Single-process RL trainer. ``RLTrainer(cfg).fit()`` runs the whole training."""

    def __init__(self, cfg: Config, *, reward_fn: Callable[..., Any] | None = None, log=print) -> None:
        self.cfg, self.log = cfg, log
        t = cfg.trainer
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        configure_cpu(t.num_threads, t.keep_freed_memory)
        self.device = torch.device(
            "cuda" if t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()) else "cpu"
        )
        model_path, train_files, val_files = self._resolve_paths()
        arr = cfg.actor_rollout_ref
        tok_key = "actor_rollout_ref.model." + ("tokenizer_path" if arr.model.tokenizer_path else "path")
        self.tokenizer = load_tokenizer(arr.model.tokenizer_path or model_path, key=tok_key)
        data = cfg.data
        dkw = dict(
            max_prompt_length=data.max_prompt_length,
            truncation=data.truncation,
            filter_overlong_prompts=data.filter_overlong_prompts,
        )
        self.train_set = PromptDataset(load_many(train_files), self.tokenizer, source=str(train_files), **dkw)
        val_rows = load_many(val_files)
        if data.val_max_samples > 0:
            val_rows = val_rows[: data.val_max_samples]
        self.val_set = PromptDataset(val_rows, self.tokenizer, source=str(val_files), **dkw)
        for name, dataset in (("training", self.train_set), ("validation", self.val_set)):
            if dataset.num_filtered:
                self.log(
                    f"data.filter_overlong_prompts: dropped {dataset.num_filtered} {name} prompts longer "
                    f"than data.max_prompt_length={data.max_prompt_length} tokens; {len(dataset)} remain"
                )
        # With dynamic sampling a step may draw several generation batches, so the loader's position
        # is a count of batches consumed (checkpointed), not the step number.
        gen_batch = (
            data.gen_batch_size if cfg.algorithm.filter_groups.enable and data.gen_batch_size else None
        )
        self.loader = PromptLoader(
            self.train_set,
            gen_batch or data.train_batch_size,
            shuffle=data.shuffle,
            seed=t.seed if data.seed is None else data.seed,
        )
        self.total_steps = t.total_training_steps or t.total_epochs * self.loader.num_batches
        self.run_dir = Path(t.default_local_dir)
        self.batches_consumed = 0
        self.bad_steps = 0  # RL steps in a row with a skipped (non-finite) optimizer step
        self.start_step, resume_dir = self._find_resume()
        self.model = self._load_actor_model(model_path, resume_dir)
        self.workers = None
        if uses_ray(cfg):
            self._start_workers(model_path, resume_dir)
        else:
            self.ref = None
            if (arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and arr.model.lora_rank > 0:
                self.ref = AdapterOffLogProbWorker(
                    self.model,
                    temperature=arr.rollout.temperature,
                    micro_batch_size=arr.ref.log_prob_micro_batch_size_per_gpu,
                    share_prompts=arr.model.share_prompt_forward,
                )
            elif arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
                ref_model = (
                    load_causal_lm(model_path, dtype=arr.model.dtype).to(self.device).requires_grad_(False)
                )
                self.ref = LogProbWorker(
                    ref_model,
                    temperature=arr.rollout.temperature,
                    micro_batch_size=arr.ref.log_prob_micro_batch_size_per_gpu,
                    share_prompts=arr.model.share_prompt_forward,
                )
            self.actor = Actor(
                self.model,
                arr.actor,
                rollout_n=arr.rollout.n,
                temperature=arr.rollout.temperature,
                total_steps=self.total_steps,
                log_prob_micro_batch_size=arr.rollout.log_prob_micro_batch_size_per_gpu,
                share_prompts=arr.model.share_prompt_forward,
            )
            self.critic = self._make_critic(model_path, resume_dir) if critic_enabled(cfg) else None
        eos = {self.tokenizer.eos_token_id}
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        if arr.rollout.name == "vllm":
            from tearless.rollout.vllm import VLLMRollout

            self.rollout = VLLMRollout(
                str(resume_dir / "actor" if resume_dir else model_path),
                arr.rollout,
                dtype=arr.model.dtype,
                eos_token_ids=sorted(eos),
                pad_token_id=self.tokenizer.pad_token_id,
                seed=t.seed,
            )
        else:
            self.rollout = HFRollout(
                self.model, eos_token_ids=sorted(eos), pad_token_id=self.tokenizer.pad_token_id
            )
        self.response_length = arr.rollout.response_length or data.max_response_length
        self.agent = self._make_agent() if arr.rollout.multi_turn.enable else None
        alg = cfg.algorithm
        self.kl_ctrl = make_kl_controller(
            alg.kl_ctrl.type, alg.kl_ctrl.kl_coef, alg.kl_ctrl.target_kl, alg.kl_ctrl.horizon
        )
        crf = cfg.custom_reward_function
        if reward_fn is None and crf.path:
            reward_fn = load_reward_function(crf.path, crf.name)
        self.reward = make_reward_manager(
            cfg.reward_model,
            reward_fn,
            dict(crf.reward_kwargs),
            max_response_length=self.response_length,
            device=str(self.device),
        )
        if resume_dir:
            self._load_state(resume_dir)

    # ---------------------------------------------------------------- setup helpers
    def _resolve_paths(self) -> tuple[str, Any, Any]:
        cfg = self.cfg
        self.task_tool_config: str | None = None
        model_path, train_files, val_files = (
            cfg.actor_rollout_ref.model.path,
            cfg.data.train_files,
            cfg.data.val_files,
        )
        if model_path is None or train_files is None:
            from tearless.tasks.bootstrap import TaskSpec, prepare_task

            task = cfg.task
            spec = TaskSpec.from_config(task)
            files = prepare_task(spec, task.cache_dir, fresh=task.fresh, log=self.log)
            model_path = model_path or files.model_dir
            self.task_tool_config = files.tool_config_path
            if train_files is None:
                train_files, val_files = files.train_file, files.val_file
        return model_path, train_files, val_files

    def _make_agent(self):
        """The multi-turn agent loop over the rollout engine, with the tools of multi_turn.tool_config_path
        (or of the embedded task)."""
        from tearless.rollout.agent import AgentLoop, AgentSettings
        from tearless.tools import load_tools

        mt = self.cfg.actor_rollout_ref.rollout.multi_turn
        path = mt.tool_config_path or self.task_tool_config
        if path is None:
            raise ValueError(
                "actor_rollout_ref.rollout.multi_turn.tool_config_path is null and the embedded task "
                f"{self.cfg.task.name!r} has no tools; point it at a tool YAML"
            )
        return AgentLoop(self.rollout, self.tokenizer, load_tools(path), AgentSettings.from_config(mt))

    def _generate(
        self, prompts: list[dict], *, n: int, **sampling: Any
    ) -> tuple[RolloutOutput, list[dict], dict[str, float]]:
        """``n`` responses per prompt, with the agent loop when multi-turn is on; returns the rollout,
        one item per response (carrying its ``tool_calls`` in multi-turn) and the loop's metrics."""
        if self.agent is None:
            out = self.rollout.generate(
                [p["input_ids"] for p in prompts], n=n, max_new_tokens=self.response_length, **sampling
            )
            return out, [p for p in prompts for _ in range(n)], {}
        res = self.agent.generate(prompts, n=n, max_new_tokens=self.response_length, **sampling)
        items = [
            {**p, "tool_calls": info["tool_calls"]}
            for p, info in zip([p for p in prompts for _ in range(n)], res.rows, strict=True)
        ]
        return res.out, items, res.metrics

    def _load_actor_model(self, model_path: str, resume_dir: Path | None) -> torch.nn.Module:
        """The actor's model: the checkpoint's or ``model.path``'s weights, with LoRA adapters (new,
        or the checkpoint's) when ``model.lora_rank > 0``."""
        m = self.cfg.actor_rollout_ref.model
        if m.lora_rank <= 0:
            path = resume_dir / "actor" if resume_dir else model_path
            return load_causal_lm(
                path, dtype=m.dtype, gradient_checkpointing=m.enable_gradient_checkpointing
            ).to(self.device)
        from tearless.models.lora import add_lora, load_lora

        base = load_causal_lm(
            model_path, dtype=m.dtype, gradient_checkpointing=m.enable_gradient_checkpointing
        ).to(self.device)
        if resume_dir:
            gc = m.enable_gradient_checkpointing
            return load_lora(base, resume_dir / "actor", gradient_checkpointing=gc)
        return add_lora(
            base,
            rank=m.lora_rank,
            alpha=m.lora_alpha,
            target_modules=m.target_modules,
            gradient_checkpointing=m.enable_gradient_checkpointing,
        )

    def _make_critic(self, model_path: str, resume_dir: Path | None) -> Critic:
        """The value model (from the checkpoint, critic.model.path or the actor's weights) and its worker,
        with the critic's null settings inherited from the actor's."""
        c = self.cfg.critic
        path = resume_dir / "critic" if resume_dir else (c.model.path or model_path)
        model = load_value_model(
            path,
            dtype=self.cfg.actor_rollout_ref.model.dtype,
            gradient_checkpointing=c.model.enable_gradient_checkpointing,
        ).to(self.device)
        return Critic(
            model,
            critic_settings(self.cfg),
            rollout_n=self.cfg.actor_rollout_ref.rollout.n,
            total_steps=self.total_steps,
        )

    def _start_workers(self, model_path: str, resume_dir: Path | None) -> None:
        """Ray placement (:mod:`tearless.distributed`): the actor, reference and critic run in FSDP2-sharded
        worker processes; this process keeps a full copy of the policy for rollout and consolidated
        checkpoints, refreshed by the actor group after every update."""
        from tearless.distributed.placement import RayWorkers

        cfg, arr = self.cfg, self.cfg.actor_rollout_ref
        roles, paths = ["actor"], {"actor": str(resume_dir / "actor" if resume_dir else model_path)}
        if arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
            roles.append("ref")
            paths["ref"] = str(model_path)
        critic_model = None
        if critic_enabled(cfg):
            roles.append("critic")
            critic_path = resume_dir / "critic" if resume_dir else (cfg.critic.model.path or model_path)
            paths["critic"] = str(critic_path)
            critic_model = load_value_model(paths["critic"], dtype=arr.model.dtype)
        self.workers = RayWorkers(
            cfg,
            roles=roles,
            paths=paths,
            total_steps=self.total_steps,
            device=self.device.type,
            sync_to=[self._push_weights],
            critic_model=critic_model,
            run_dir=self.run_dir,
        )
        self.actor, self.ref, self.critic = self.workers.actor, self.workers.ref, self.workers.critic

    def _push_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Where the Ray actor group sends the updated weights: the driver's copy of the policy
        (rollout and checkpoints) and the rollout engine when it keeps its own (vLLM)."""
        self.model.load_state_dict(state)
        if hasattr(self.rollout, "update_weights"):
            self.rollout.update_weights(state)

    def _find_resume(self) -> tuple[int, Path | None]:
        t = self.cfg.trainer
        if t.resume_mode == "disable":
            old = ckpt.complete_checkpoints(self.run_dir)
            if old:
                # Training from scratch here would mix its checkpoints with the old run's, and resume or
                # pruning could later pick the wrong ones.
                raise FileExistsError(
                    f"trainer.resume_mode=disable but {self.run_dir} already holds checkpoints "
                    f"({old[-1].name}, …); use another trainer.experiment_name or trainer.default_local_dir, "
                    "or delete them"
                )
            return 0, None
        path = (
            Path(t.resume_from_path)
            if t.resume_mode == "resume_path"
            else ckpt.latest_checkpoint(self.run_dir)
        )
        if path is None:
            return 0, None
        state = ckpt.load_state(path)
        self._resume_state = state
        return int(state["global_step"]), path

    def _load_state(self, path: Path) -> None:
        state = self._resume_state
        if self.workers is not None:
            self.workers.load(path, state)
        elif "optimizer" not in state:
            raise ValueError(
                f"{path} was written by a trainer.placement=ray run (optimizer shards in {path / 'dcp'}); "
                "resume it with trainer.placement=ray on any number of workers"
            )
        else:
            self.actor.optimizer.load_state_dict(state["optimizer"])
            self.actor.scheduler.load_state_dict(state["scheduler"])
            self.actor.skipped_steps = state["skipped_steps"]
            if self.critic is not None:
                self.critic.optimizer.load_state_dict(state["critic_optimizer"])
                self.critic.scheduler.load_state_dict(state["critic_scheduler"])
                self.critic.skipped_steps = int(state.get("critic_skipped_steps", 0))
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.batches_consumed = state["batches_consumed"]
        self.bad_steps = int(state.get("bad_steps", 0))
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.log(f"resumed from {path} at step {self.start_step}")

    def save(self, step: int, metrics: dict[str, Any] | None = None) -> Path:
        """Checkpoint ``global_step_{step}``. ``metrics`` (the step's metrics line) is kept in it, so a
        crash between the save and the metrics write cannot lose the line (see :meth:`fit`)."""
        state = {
            "global_step": step,
            "skipped_steps": self.actor.skipped_steps,
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "batches_consumed": self.batches_consumed,
            "bad_steps": self.bad_steps,
            # Plain JSON values only, so the state loads with torch.load(weights_only=True).
            "config": json.loads(json.dumps(to_dict(self.cfg), default=str)),
            "step_metrics": {
                k: float(v) if isinstance(v, (int, float)) else str(v) for k, v in (metrics or {}).items()
            },
        }
        extra = {}
        if self.workers is not None:
            state["workers"] = self.workers.trainer_state()
        else:
            state["optimizer"] = self.actor.optimizer.state_dict()
            state["scheduler"] = self.actor.scheduler.state_dict()
            if self.critic is not None:
                state["critic_optimizer"] = self.critic.optimizer.state_dict()
                state["critic_scheduler"] = self.critic.scheduler.state_dict()
                state["critic_skipped_steps"] = self.critic.skipped_steps
        if self.critic is not None:
            extra["critic"] = self.critic.model
        model_cfg = self.cfg.actor_rollout_ref.model
        if model_cfg.lora_rank > 0 and model_cfg.lora_save_merged:
            from tearless.models.lora import MergedLoraView

            extra["actor_merged"] = MergedLoraView(self.model, self.tokenizer)
        return ckpt.save_checkpoint(
            self.run_dir,
            step,
            model=self.model,
            tokenizer=self.tokenizer,
            state=state,
            keep=self.cfg.trainer.max_actor_ckpt_to_keep,
            extra_models=extra,
            write_shards=self.workers.save_shards if self.workers is not None else None,
        )

    # ---------------------------------------------------------------- one RL step
    def score(
        self, items: list[dict], out: RolloutOutput
    ) -> tuple[torch.Tensor, torch.Tensor, dict, list[str], list[dict]]:
        """Decode and score responses; return scores (B,), correctness (B,), reward metrics, texts and
        each response's reward components (the scorer's extra keys)."""
        # The whole trajectory (tool output included) is what the scorer reads.
        texts = [
            self.tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
            for ids, m in zip(out.response_ids, out.response_attention_mask, strict=True)
        ]
        requests = [
            {
                "data_source": it["data_source"],
                "solution_str": s,
                "ground_truth": it["ground_truth"],
                "extra_info": it["extra_info"],
                "response_length": int(m.sum()),
                "prompt": it["raw_prompt"],
            }
            for it, s, m in zip(items, texts, out.response_mask, strict=True)
        ]
        lost_before = self.reward.lost_workers
        results = self.reward.score(requests)
        scores = torch.tensor([r.score for r in results], dtype=torch.float32)
        correct = torch.tensor(
            [bool(r.extra["acc"]) if "acc" in r.extra else r.score >= 1.0 for r in results]
        )
        extras: dict[str, list[float]] = defaultdict(list)
        for r in results:
            for k, v in r.extra.items():
                extras[k].append(float(v))
        metrics = {f"reward_extra/{k}/mean": sum(v) / len(v) for k, v in extras.items()}
        metrics["reward/failures"] = float(sum(r.error is not None for r in results))
        # Reward processes that died mid-sample (their samples were scored again by a fresh one).
        metrics["reward/lost_workers"] = float(self.reward.lost_workers - lost_before)
        # Each response's components, and its step scores if the scorer gave any (tearless.rewards.steps).
        components = [{**{k: float(v) for k, v in r.extra.items()}, **step_fields(r.steps)} for r in results]
        return scores, correct, metrics, texts, components

    def _next_prompts(self) -> list[dict]:
        epoch, i = divmod(self.batches_consumed, self.loader.num_batches)
        self.batches_consumed += 1
        return self.loader.batch(epoch, i)

    def collect(
        self, step: int, timer: Timer
    ) -> tuple[
        list[dict],
        RolloutOutput,
        list[str],
        torch.Tensor,
        torch.Tensor,
        dict[str, float],
        list[str],
        list[dict],
    ]:
        """Generate and score one step's responses.

        Returns (items, rollout, uids, scores, correct, reward metrics, texts, reward components), one
        entry per response, the ``n`` responses of a prompt adjacent and sharing a uid. With
        ``algorithm.filter_groups.enable`` (DAPO's dynamic sampling), groups whose scores are all equal
        carry no GRPO signal and are dropped, and more prompts are drawn until
        ``data.train_batch_size`` groups are kept or ``max_num_gen_batches`` rounds have run.
        """
        arr, fg = self.cfg.actor_rollout_ref, self.cfg.algorithm.filter_groups
        n, target = arr.rollout.n, self.cfg.data.train_batch_size
        parts: list[tuple] = []
        kept_prompts, rounds, drawn = 0, 0, 0
        while True:
            prompts = self._next_prompts()
            rounds += 1
            drawn += len(prompts)
            faults.point("rollout", step)
            with timer("gen"):
                out, items, gen_metrics = self._generate(
                    prompts,
                    n=n,
                    temperature=arr.rollout.temperature,
                    top_p=arr.rollout.top_p,
                    top_k=arr.rollout.top_k,
                    generator=_step_generator(self.cfg.trainer.seed, step, 0 if rounds == 1 else 10 + rounds),
                )
            uids = [f"{step}-{rounds}-{i // n}" for i in range(len(items))]
            faults.point("reward", step)
            with timer("reward"):
                scores, correct, metrics, texts, extras = self.score(items, out)
            metrics.update(gen_metrics)
            if not fg.enable:
                return items, out, uids, scores, correct, metrics, texts, extras
            keep = filter_groups(scores, uids).nonzero().squeeze(-1)
            keep = keep[: (target - kept_prompts) * n]
            kept_prompts += len(keep) // n
            parts.append((keep, items, out, uids, scores, correct, metrics, texts, extras))
            if kept_prompts >= target or (fg.max_num_gen_batches > 0 and rounds >= fg.max_num_gen_batches):
                break
        if kept_prompts == 0:
            raise RuntimeError(
                f"algorithm.filter_groups: every group of {drawn} prompts had equal scores after {rounds} "
                "generation rounds; raise algorithm.filter_groups.max_num_gen_batches or check the reward"
            )
        items, uids, texts, extras, outs, score_parts, correct_parts = [], [], [], [], [], [], []
        for keep, p_items, p_out, p_uids, p_scores, p_correct, _, p_texts, p_extras in parts:
            rows = keep.tolist()
            items += [p_items[j] for j in rows]
            uids += [p_uids[j] for j in rows]
            texts += [p_texts[j] for j in rows]
            extras += [p_extras[j] for j in rows]
            outs.append(select_rows(p_out, keep))
            score_parts.append(p_scores[keep])
            correct_parts.append(p_correct[keep])
        out = concat_rollouts(outs, self.tokenizer.pad_token_id)
        scores, correct = torch.cat(score_parts), torch.cat(correct_parts)
        metrics = dict(parts[-1][6])
        metrics["train/num_gen_batches"] = float(rounds)
        metrics["train/kept_prompt_ratio"] = kept_prompts / drawn
        return items, out, uids, scores, correct, metrics, texts, extras

    def train_step(self, step: int) -> dict[str, float]:
        """One RL step: collect → old/ref log-probs and values → advantages → critic and actor updates."""
        cfg, alg = self.cfg, self.cfg.algorithm
        timer = Timer()
        with timer("step"):
            items, out, uids, scores, correct, metrics, texts, extras = self.collect(step, timer)
            mask = out.response_mask
            token_scores, step_mask = rollout_token_rewards(
                scores,
                extras,
                texts,
                out,
                self.tokenizer,
                cfg.reward_model.step_reward,
            )
            td = TensorDict(
                {
                    "prompt_ids": out.prompt_ids,
                    "prompt_mask": out.prompt_mask,
                    "response_ids": out.response_ids,
                    "response_mask": mask,
                    "response_attention_mask": out.response_attention_mask,
                    "uid_index": uid_index(uids),
                },
                batch_size=[len(items)],
            )
            if out.entropy is not None:
                td["rollout_entropy"] = out.entropy
            n = cfg.actor_rollout_ref.rollout.n
            prompts = items[::n]
            rc = alg.rollout_correction
            if (
                not self.actor.on_policy(len(prompts))
                or alg.use_kl_in_reward
                or rc.rollout_is is not None
                or cfg.actor_rollout_ref.rollout.name != "hf"
            ):
                with timer("old_log_prob"):
                    td["old_log_prob"], _ = self.actor.compute_log_prob(td)
                weights, corr = rollout_correction(
                    td["old_log_prob"],
                    out.log_probs,
                    mask,
                    level=rc.rollout_is,
                    threshold=rc.rollout_is_threshold,
                )
                metrics.update(corr)
                if weights is not None:
                    td["rollout_is_weights"] = weights
            if self.ref is not None:
                with timer("ref"):
                    td["ref_log_prob"], _ = self.ref.compute_log_prob(td)
            if self.critic is not None:
                with timer("values"):
                    td["values"] = self.critic.compute_values(td)
            with timer("adv"):
                rewards = token_scores
                if alg.use_kl_in_reward:
                    kl, current_kl = reward_kl(td["old_log_prob"], td["ref_log_prob"], mask, alg.kl_penalty)
                    rewards = token_scores - self.kl_ctrl.value * kl
                    metrics["actor/reward_kl_penalty"] = current_kl
                    metrics["actor/reward_kl_penalty_coeff"] = self.kl_ctrl.value
                    self.kl_ctrl.update(current_kl, n_steps=len(items))
                baselines = self._remax_baselines(prompts, step) if alg.adv_estimator == "remax" else None
                advantages, returns = compute_advantage(
                    alg.adv_estimator,
                    token_level_rewards=rewards,
                    response_mask=mask,
                    index=uids,
                    gamma=alg.gamma,
                    lam=alg.lam,
                    norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
                    reward_baselines=baselines,
                    values=td.get("values", None),
                    step_mask=step_mask,
                )
                td["advantages"], td["returns"] = advantages, returns
            faults.point("update", step)
            if self.critic is not None:
                with timer("update_critic"):
                    metrics.update(
                        self.critic.update_critic(td, generator=_step_generator(cfg.trainer.seed, step, 2))
                    )
                metrics["critic/vf_explained_var"] = explained_variance(td["values"], returns, mask)
                metrics.update(critic_value_stats(td["values"], mask))
            if step > cfg.trainer.critic_warmup:
                with timer("update_actor"):
                    metrics.update(
                        self.actor.update_policy(td, generator=_step_generator(cfg.trainer.seed, step, 1))
                    )
                if self.workers is None and hasattr(self.rollout, "update_weights"):
                    self.rollout.update_weights(self.model.state_dict())  # the Ray actor group syncs itself
        metrics.update(
            data_metrics(
                scores=scores,
                rewards=rewards,
                advantages=advantages,
                returns=returns,
                response_mask=mask,
                prompt_mask=out.prompt_mask,
                truncated=out.truncated,
                correct=correct,
            )
        )
        metrics["train/zero_variance_group_ratio"] = zero_variance_group_ratio(scores, uids)
        metrics.update(timer.metrics())
        tokens = int(out.prompt_mask.sum() + out.response_attention_mask.sum())
        metrics.update(
            {
                "perf/total_num_tokens": float(tokens),
                "perf/time_per_step": timer.seconds["step"],
                "perf/throughput": tokens / max(timer.seconds["step"], 1e-9),
            }
        )
        self._dump_samples(step, items, uids, texts, scores, extras, advantages, mask, out.truncated)
        return metrics

    def _restore_checkpointed_record(self) -> None:
        """Append the resumed checkpoint's own metrics line if the crash came before it was written."""
        state = getattr(self, "_resume_state", None)
        record = state.get("step_metrics") if state else None
        path = self.run_dir / "metrics.jsonl"
        if not record or "jsonl" not in self.cfg.trainer.logger:
            return
        steps = [r.get("step") for r in read_metrics(path)]
        if self.start_step not in steps:
            with open(path, "a") as f:
                f.write(json.dumps({"step": self.start_step, **record}) + "\n")

    def _skipped_optimizer_steps(self) -> int:
        # The Ray placement's critic group does not count its skipped steps; its actor group does.
        return self.actor.skipped_steps + getattr(self.critic, "skipped_steps", 0)

    def _bad_steps_message(self, step: int, checkpoint: str) -> str:
        first = step - self.bad_steps + 1
        return (
            f"trainer.max_bad_steps={self.cfg.trainer.max_bad_steps}: steps {first}..{step} in a row had a "
            "non-finite loss or gradient norm, so their optimizer steps were skipped; stopping. "
            f"{checkpoint} holds the weights and optimizer state with none of the skipped updates in "
            "them. Lower actor_rollout_ref.actor.optim.lr, check the rewards and "
            "data for NaN/inf, or raise trainer.max_bad_steps (0 = never stop), then resume with "
            "trainer.resume_mode=auto"
        )

    def _remax_baselines(self, prompts: list[dict], step: int) -> torch.Tensor:
        """ReMax's baseline: the reward of each prompt's greedy response, repeated for its n samples."""
        out, items, _ = self._generate(prompts, n=1, do_sample=False)
        scores, _, _, _, _ = self.score(items, out)
        return scores.repeat_interleave(self.cfg.actor_rollout_ref.rollout.n)

    def _dump_samples(self, step, items, uids, texts, scores, extras, advantages, mask, truncated) -> None:
        """Append up to ``trainer.num_rollout_samples`` of this step's samples to the rollout records,
        unless the file has reached ``trainer.rollout_log_max_mb``."""
        t = self.cfg.trainer
        records = []
        for i in range(min(t.num_rollout_samples, len(items))):
            valid = mask[i].bool()
            record = {
                "step": step,
                "uid": uids[i],
                "data_source": items[i]["data_source"],
                "prompt": self.tokenizer.decode(items[i]["input_ids"], skip_special_tokens=False),
                "response": texts[i],
                "ground_truth": str(items[i]["ground_truth"]),
                "score": float(scores[i]),
                "reward_extra": extras[i],
                "advantage": float(advantages[i][valid][0]) if valid.any() else 0.0,
                "response_length": int(valid.sum()),
                "truncated": bool(truncated[i]),
            }
            if "tool_calls" in items[i]:
                record["tool_calls"] = items[i]["tool_calls"]
            records.append(record)
        append_step(self.run_dir / ROLLOUTS_FILE, records, int(t.rollout_log_max_mb * 2**20))

    # ---------------------------------------------------------------- validation
    def validate(self) -> dict[str, float]:
        """Greedy accuracy always; with ``val_kwargs.do_sample``, mean@n and pass@k too, per data_source.

        A sample is correct when its scorer's ``acc`` is true or, without one, its score is ≥ 1.
        """
        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        items = [self.val_set[i] for i in range(len(self.val_set))]
        metrics: dict[str, float] = {}
        for src, vals in self._val_pass(items, n=1, do_sample=False).items():
            metrics[f"val-core/{src}/acc/greedy"] = sum(c for _, c in vals) / len(vals)
            metrics[f"val-core/{src}/reward/greedy"] = sum(m for m, _ in vals) / len(vals)
        if vk.do_sample:
            sampled = self._val_pass(
                items,
                n=vk.n,
                temperature=vk.temperature,
                top_p=vk.top_p,
                top_k=vk.top_k,
                generator=_step_generator(self.cfg.trainer.seed, -1, 2),
            )
            for src, vals in sampled.items():
                metrics[f"val-core/{src}/reward/mean@{vk.n}"] = sum(m for m, _ in vals) / len(vals)
                metrics[f"val-core/{src}/acc/mean@{vk.n}"] = sum(c for _, c in vals) / (len(vals) * vk.n)
                k = 1
                while k <= vk.n:
                    passed = sum(pass_at_k(vk.n, c, k) for _, c in vals)
                    metrics[f"val-core/{src}/acc/pass@{k}"] = passed / len(vals)
                    k *= 2
        return metrics

    def _val_pass(self, items: list[dict], *, n: int, **sampling: Any) -> dict[str, list[tuple[float, int]]]:
        """Generate ``n`` responses per item; per data_source, (mean score, number correct) per prompt."""
        size = self.cfg.data.val_batch_size or len(items)
        per_source: dict[str, list[tuple[float, int]]] = defaultdict(list)
        for start in range(0, len(items), size):
            chunk = items[start : start + size]
            out, expanded, _ = self._generate(chunk, n=n, **sampling)
            scores, correct, _, _, _ = self.score(expanded, out)
            for j, it in enumerate(chunk):
                rows = slice(j * n, (j + 1) * n)
                per_source[it["data_source"]].append((float(scores[rows].mean()), int(correct[rows].sum())))
        return per_source

    # ---------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps``; return the run directory and validation before and after."""
        cfg, t = self.cfg, self.cfg.trainer
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Steps after the checkpoint we start from are replayed, so their old records go (all of them
        # when starting from scratch in a used directory).
        truncate_jsonl(self.run_dir / "metrics.jsonl", self.start_step if self.start_step > 0 else -1)
        truncate_records(self.run_dir / ROLLOUTS_FILE, self.start_step if self.start_step > 0 else -1)
        self._restore_checkpointed_record()
        (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=1, default=str))
        tracker = Tracker(
            self.run_dir,
            list(t.logger),
            total_steps=self.total_steps,
            config=to_dict(cfg),
            project=t.project_name,
            experiment=t.experiment_name,
            log_freq=t.log_freq,
        )
        tracker.start_at(self.start_step)
        summary: dict[str, Any] = {"run_dir": str(self.run_dir), "start_step": self.start_step}
        started = time.perf_counter()
        try:
            if t.val_only or (self.start_step == 0 and t.val_before_train):
                timer = Timer()
                with timer("testing"):
                    summary["before"] = self.validate()
                if self.start_step == 0:  # a val_only pass over a resumed run is not a step of it
                    tracker.log({**summary["before"], **timer.metrics()}, 0)
                title = f"at step {self.start_step}" if t.val_only else "before training"
                tracker.write(_format_val(title, summary["before"]))
            if t.val_only:
                summary.update(seconds=time.perf_counter() - started, steps=self.start_step)
                return summary
            if self.start_step >= self.total_steps:
                tracker.write(
                    f"the run in {self.run_dir} is already complete ({self.start_step} steps); use another "
                    "trainer.experiment_name (or trainer.default_local_dir) to train again"
                )
            step = self.start_step
            while step < self.total_steps:
                step += 1
                skipped_before = self._skipped_optimizer_steps()
                metrics = self.train_step(step)
                self.bad_steps = self.bad_steps + 1 if self._skipped_optimizer_steps() > skipped_before else 0
                metrics["training/bad_steps_in_a_row"] = float(self.bad_steps)
                stop = 0 < t.max_bad_steps <= self.bad_steps
                epoch = (self.batches_consumed - 1) // self.loader.num_batches
                metrics.update({"training/global_step": float(step), "training/epoch": float(epoch)})
                last = step == self.total_steps
                if last or (t.test_freq > 0 and step % t.test_freq == 0):
                    timer = Timer()
                    with timer("testing"):
                        val = self.validate()
                    metrics.update(val)
                    metrics.update(timer.metrics())
                    summary["after"] = val
                if stop or last or (t.save_freq > 0 and step % t.save_freq == 0):
                    timer = Timer()
                    with timer("save_checkpoint"):
                        summary["checkpoint"] = str(self.save(step, metrics))
                    metrics.update(timer.metrics())
                faults.point("metrics", step)
                tracker.log(metrics, step)
                if stop:
                    raise TrainingStopped(self._bad_steps_message(step, summary["checkpoint"]))
            if "after" in summary:
                tracker.write(_format_val("after training", summary["after"]))
        finally:
            tracker.close()
            self.reward.close()
            if self.workers is not None:
                self.workers.close()
        summary["seconds"] = time.perf_counter() - started
        summary["steps"] = self.total_steps
        return summary


def _format_val(title: str, metrics: dict[str, float]) -> str:
    lines = [f"held-out {title}:"] + [f"  {k:<40} {v:.4f}" for k, v in sorted(metrics.items())]
    return "\n".join(lines)
