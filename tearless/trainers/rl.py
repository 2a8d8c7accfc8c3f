"""The RL trainer of the PPO family (GRPO, RLOO, REINFORCE++, ReMax, OPO, … are estimator choices).

One step (``RLTrainer.train_step``), each part one call to the worker group
(:mod:`tearless.workers.group`), whatever the placement:

  1. rollout and reward: the generating ranks sample ``rollout.n`` responses per prompt and score them;
  2. old log-probs (skipped when the update is provably on-policy), reference log-probs (when a KL
     term is on) and critic values (for GAE);
  3. KL in the reward (optional) and advantages, grouped by each prompt's ``uid``, here;
  4. critic and actor updates: PPO epochs over mini-batches, micro-batched, globally normalised.

Validation, metrics, rollout samples and checkpoints happen around it in ``fit``. With
``async_training.enable`` step 1 takes a batch generated ahead, up to ``max_staleness`` policy
versions old; both loops take their batches from one source (:mod:`tearless.trainers.source`).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from tearless import faults
from tearless.algos import compute_advantage, make_kl_controller
from tearless.algos.groups import num_groups
from tearless.config import Config, resume_compat, to_dict
from tearless.config.derived import critic_enabled, on_policy, roles
from tearless.config.identity import fingerprint_changes, fingerprints
from tearless.cpu import configure_cpu
from tearless.data import PromptDataset, PromptLoader, load_many
from tearless.data.prompts import check_vocabulary
from tearless.models.calibrate import PrecisionChoice, choose_cpu_dtype
from tearless.models.loading import check_model_dir, load_tokenizer
from tearless.models.precision import compute_dtype
from tearless.rewards.steps import rollout_token_rewards
from tearless.rollout.batch import Rollout
from tearless.rollout.correction import rollout_correction, rollout_rejection
from tearless.rollout.engine import engine_capabilities
from tearless.rollout.sync_probe import METRIC as SYNC_PROBE_METRIC
from tearless.rollout.sync_probe import max_difference, mismatch_message, probe_bound, probe_ids
from tearless.run import checkpoint as ckpt
from tearless.run.timer import Timer
from tearless.run.tracking import Tracker, read_metrics, truncate_jsonl
from tearless.tasks.bootstrap import TaskSpec, default_cache_dir
from tearless.trainers import runlock
from tearless.trainers.metrics import data_metrics, zero_variance_group_ratio
from tearless.trainers.records import ROLLOUTS_FILE, append_step, truncate_records
from tearless.trainers.reward_errors import RewardErrors
from tearless.trainers.source import BatchSource, PromptDraw, SourceSettings
from tearless.trainers.validation import format_validation, validate
from tearless.trainers.warmup import prepare_task
from tearless.workers.actor import reward_kl
from tearless.workers.build import hybrid_rollout_dtype, precision_mismatch, role_key, rollout_dtype
from tearless.workers.critic import critic_value_stats, explained_variance
from tearless.workers.placement import make_workers
from tearless.workers.spec import RankSpec, resolve_device


def step_generator(seed: int, step: int, stream: int) -> torch.Generator:
    """Randomness of step ``step`` derived from the seed alone, so a resumed run draws what the
    uninterrupted run drew."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + stream)


class TrainingStopped(RuntimeError):
    """The run stopped itself (``trainer.max_bad_steps`` non-finite steps in a row); the message says why
    and which checkpoint to resume from."""


class RLTrainer:
    """The RL trainer. ``RLTrainer(cfg).fit()`` runs the whole training in the configured placement."""

    def __init__(
        self,
        cfg: Config,
        *,
        reward_fn: Callable[..., Any] | None = None,
        log=print,
        callbacks: Sequence[Callable[[int, dict], None]] = (),
    ) -> None:
        # callbacks: ``callback(step, metrics)`` after each logged step (tearless.api.Trainer's).
        self.cfg, self.log, self.callbacks = cfg, log, list(callbacks)
        self._auto_precision: set[str] = set()  # param_dtype keys resolved from auto
        t, data, arr = cfg.trainer, cfg.data, cfg.actor_rollout_ref
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        configure_cpu(t.num_threads, t.keep_freed_memory)
        model_path, train_files, val_files, tools = self._resolve_paths()
        # The files the run reads, by content (kept in checkpoints, compared on resume): a model or
        # data file rewritten at the same path makes another run.
        self.fingerprints = fingerprints(
            {
                "actor_rollout_ref.model.path": model_path,
                "actor_rollout_ref.model.tokenizer_path": arr.model.tokenizer_path,
                "critic.model.path": cfg.critic.model.path,
                "data.train_files": train_files,
            }
        )
        tok_key = "actor_rollout_ref.model." + ("tokenizer_path" if arr.model.tokenizer_path else "path")
        self.tokenizer = load_tokenizer(arr.model.tokenizer_path or model_path, key=tok_key)
        check_vocabulary(self.tokenizer, model_path, tok_key)
        dkw = dict(
            max_prompt_length=data.max_prompt_length,
            truncation=data.truncation,
            filter_overlong_prompts=data.filter_overlong_prompts,
            chat_template=data.chat_template,
            template_kwargs=dict(data.apply_chat_template_kwargs),
        )
        train_rows = load_many(train_files)
        if data.train_max_samples > 0:
            train_rows = train_rows[: data.train_max_samples]
        self.train_set = PromptDataset(train_rows, self.tokenizer, source=str(train_files), **dkw)
        val_rows = load_many(val_files)
        if data.val_max_samples > 0:
            val_rows = val_rows[: data.val_max_samples]
        self.val_set = PromptDataset(val_rows, self.tokenizer, source=str(val_files), **dkw)
        for name, dataset in (("training", self.train_set), ("validation", self.val_set)):
            if dataset.num_unknown:
                self.log(
                    f"warning: {dataset.num_unknown} of {len(dataset)} {name} prompts hold the tokenizer's "
                    "unknown token: the model cannot read part of them (check the tokenizer, or the "
                    "chat template's text)"
                )
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
        self.prompts = PromptDraw(self.loader)
        self.policy_version = 0  # actor updates so far (the version rollouts record, docs/async.md)
        self.bad_steps = 0  # RL steps in a row with a skipped (non-finite) optimizer step
        self.flat_steps, self.warned_no_signal = 0, False  # steps in a row with mostly flat groups
        self.skipped = {"actor": 0.0, "critic": 0.0}  # optimizer steps skipped so far, per role
        self.response_length = arr.rollout.response_length or data.max_response_length
        self.reward_errors = RewardErrors(cfg.reward_model.tolerate_failed_steps, self.log)
        self.start_step, resume_dir = self._find_resume()
        self._resolve_auto_precision(str(model_path))
        spec = RankSpec(
            cfg,
            roles=roles(cfg),
            rollout=True,
            model_path=str(model_path),
            total_steps=self.total_steps,
            device=t.device,  # auto: each rank decides in its own process
            resume_dir=None if resume_dir is None else str(resume_dir),
            reward_fn=reward_fn,
            tool_config=tools,
        )
        self.workers = make_workers(spec, self.tokenizer.pad_token_id, run_dir=self.run_dir)
        # The hybrid built-in engine sampling in another precision than the trainer's π_old forward
        # (rollout.dtype vs actor param_dtype): π_old is recomputed so rollout_corr/* shows the mismatch.
        self.precision_mismatch = precision_mismatch(cfg, self.workers.device)
        self._announce_autocast(spec.roles, self.workers.device)
        alg = cfg.algorithm
        self.kl_ctrl = make_kl_controller(
            alg.kl_ctrl.type, alg.kl_ctrl.kl_coef, alg.kl_ctrl.target_kl, alg.kl_ctrl.horizon
        )
        if resume_dir:
            self._load_state(resume_dir)
        # Every load into an engine holding its own weights is checked against the trainer
        # (tearless.rollout.sync_probe).
        self.capabilities = engine_capabilities(arr.rollout.name)  # of the rollout engine
        self.sync_probe = (
            probe_ids(self.train_set[0], self.tokenizer) if self.capabilities.holds_own_weights else None
        )
        self.sync_probe_dtype = rollout_dtype(cfg, self.workers.device)
        # The one source of batches: synchronous (k = 0), or generating up to k steps ahead
        # (async_training, docs/async.md).
        self.source = BatchSource(
            self.workers,
            self.prompts,
            SourceSettings.from_config(
                cfg, total_steps=self.total_steps, max_new_tokens=self.response_length
            ),
            version=lambda: self.policy_version,
            report_errors=self.reward_errors.report,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    # ---------------------------------------------------------------- setup helpers
    def _resolve_paths(self) -> tuple[str, Any, Any, str | None]:
        """Model, training and validation data, and tool YAML: the config's, or the embedded task's."""
        cfg = self.cfg
        model_path, train_files, val_files = (
            cfg.actor_rollout_ref.model.path,
            cfg.data.train_files,
            cfg.data.val_files,
        )
        tools = None
        if model_path is not None:
            # A Hub ID becomes its cached snapshot here, once, so every rank and engine reads one directory.
            model_path = str(check_model_dir(model_path, "actor_rollout_ref.model.path"))
        if model_path is None or train_files is None:
            files = prepare_task(
                TaskSpec.from_config(cfg.task), cfg.task.cache_dir, fresh=cfg.task.fresh, log=self.log
            )
            model_path = model_path or files.model_dir
            tools = files.tool_config_path
            if train_files is None:
                train_files, val_files = files.train_file, files.val_file
        return model_path, train_files, val_files, tools

    def _resolve_auto_precision(self, model_path: str) -> None:
        """Replace every ``fsdp_config.param_dtype=auto`` (the default for a pretrained model) by a dtype
        before any rank is built: bfloat16 on GPU; on CPU the measured choice of
        :func:`~tearless.models.calibrate.choose_cpu_dtype` for the role's model. One line per choice."""
        cfg = self.cfg
        sections = {
            "actor_rollout_ref.actor": (cfg.actor_rollout_ref.actor.fsdp_config, model_path, "actor"),
            "actor_rollout_ref.ref": (cfg.actor_rollout_ref.ref.fsdp_config, model_path, "ref"),
            "critic.model": (cfg.critic.model.fsdp_config, cfg.critic.model.path or model_path, "critic"),
        }
        active = roles(cfg)
        by_path: dict[str, list[str]] = {}
        for prefix, (fsdp, path, role) in sections.items():
            if fsdp.param_dtype == "auto" and role in active:  # a role not built stays unresolved
                by_path.setdefault(path, []).append(prefix)
        gpu = resolve_device(cfg.trainer.device) == "cuda"
        for path, prefixes in by_path.items():
            if gpu:
                choice = PrecisionChoice("bfloat16", "a GPU: bf16 tensor cores")
            else:
                from transformers import AutoConfig  # only a pretrained model's run resolves auto

                choice = choose_cpu_dtype(
                    AutoConfig.from_pretrained(path),
                    cache_dir=default_cache_dir(),
                    threads=torch.get_num_threads(),
                )
            for prefix in prefixes:
                sections[prefix][0].param_dtype = choice.dtype
                self._auto_precision.add(prefix + ".fsdp_config.param_dtype")
            self.log(choice.line(", ".join(prefixes)))

    def _announce_autocast(self, roles: Sequence[str], device: str) -> None:
        """One line naming the roles that compute under bf16 autocast on CPU (it changes speed and
        rounding; on a CPU whose bf16 is slower than float32 the user should know it is on). Keys
        resolved from ``auto`` had their own line (:meth:`_resolve_auto_precision`)."""
        if device != "cpu":
            return
        keys = [
            role_key(r)
            for r in roles
            if compute_dtype(self._param_dtype(r), device, "", warn=False) != torch.float32
            and role_key(r) not in self._auto_precision
        ]
        if (
            not engine_capabilities(self.cfg.actor_rollout_ref.rollout.name).holds_own_weights
            and hybrid_rollout_dtype(self.cfg, device, warn=False) != torch.float32
        ):
            keys.append("actor_rollout_ref.rollout.dtype")
        if keys:
            self.log(
                f"bf16 autocast is on ({', '.join(keys)}): matmuls in bfloat16, master weights, optimizer "
                "state and losses in float32; set those keys to float32 to turn it off"
            )

    def _param_dtype(self, role: str) -> str | None:
        cfg = self.cfg
        return (
            cfg.critic.model if role == "critic" else getattr(cfg.actor_rollout_ref, role)
        ).fsdp_config.param_dtype

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
        from_path = t.resume_from_path if t.resume_mode == "resume_path" else None
        path = ckpt.checkpoint_to_resume(self.run_dir, from_path, log=self.log)
        if path is None:
            return 0, None
        self._resume_state = ckpt.load_state(path)
        resume_compat.check_resume(self._resume_state.get("config"), self.cfg, path, log=self.log)
        changed = fingerprint_changes(self._resume_state.get("fingerprints"), self.fingerprints)
        if changed:
            raise resume_compat.ResumeMismatch(
                f"cannot resume from {path}: files of the run changed since it was written "
                f"({'; '.join(changed[:5])}{'; …' if len(changed) > 5 else ''}). Put the old files back to "
                "resume, or start a new run with another trainer.experiment_name"
            )
        if "workers" not in self._resume_state:
            raise ValueError(
                f"{path} was written by an older tearless whose optimizer state format this one does not "
                "read; start a new run from its actor/ weights with actor_rollout_ref.model.path and "
                "trainer.resume_mode=disable"
            )
        return int(self._resume_state["global_step"]), path

    def _load_state(self, path: Path) -> None:
        state = self._resume_state
        self.workers.load(str(path), state["workers"])
        self.skipped = {role: float(s["skipped_steps"]) for role, s in state["workers"].items()}
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        resume_compat.apply_config({}, self.kl_ctrl, self.cfg)  # the ranks applied it to their optimizers
        self.prompts.position = state["batches_consumed"]
        warmup = self.cfg.trainer.critic_warmup
        self.policy_version = int(state.get("policy_version", max(0, self.start_step - warmup)))
        self.bad_steps = int(state.get("bad_steps", 0))
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.log(f"resumed from {path} at step {self.start_step}")

    def save(self, step: int, metrics: dict[str, Any] | None = None) -> Path:
        """Checkpoint ``global_step_{step}``. ``metrics`` (the step's metrics line) is kept in it, so a
        crash between the save and the metrics write cannot lose the line (see :meth:`fit`)."""
        state = {
            "global_step": step,
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            # Prompt batches of steps trained so far: in-flight generations are redrawn on resume.
            "batches_consumed": self.source.resume_position(),
            "policy_version": self.policy_version,
            "bad_steps": self.bad_steps,
            # Plain JSON values only, so the state loads with torch.load(weights_only=True).
            "config": json.loads(json.dumps(to_dict(self.cfg), default=str)),
            "fingerprints": self.fingerprints,
            "step_metrics": {
                k: float(v) if isinstance(v, (int, float)) else str(v) for k, v in (metrics or {}).items()
            },
        }

        def write(directory: Path) -> dict[str, Any]:
            workers = self.workers.save(str(directory))
            for name in ("actor", "actor_merged"):
                if (directory / name).is_dir():
                    self.tokenizer.save_pretrained(directory / name)
            return {"workers": workers}

        return ckpt.save_checkpoint(
            self.run_dir, step, state=state, keep=self.cfg.trainer.max_actor_ckpt_to_keep, write=write
        )

    # ---------------------------------------------------------------- one RL step
    def generate(self, prompts: list[dict], *, keys: list[int] | None, n: int, **sampling: Any) -> Rollout:
        """``n`` scored responses per prompt from the worker group; reward errors are reported (and a
        round whose every sample failed stops the run) by :mod:`tearless.trainers.reward_errors`."""
        rollout = self.workers.generate(
            prompts,
            n=n,
            keys=keys,
            max_new_tokens=self.response_length,
            version=self.policy_version,
            **sampling,
        )
        self.reward_errors.report(rollout.errors, len(rollout.items))
        return rollout

    def train_step(self, step: int) -> dict[str, float]:
        """One RL step: rollout and reward → log-probs and values → advantages → updates."""
        t = self.cfg.trainer
        timer = Timer()
        with timer("step"):
            rollout, metrics = self.source.batch(step, timer)
            uids = rollout.uids
            td = rollout.tensors()
            self.forward_passes(td, rollout, metrics, timer)
            with timer("adv"):
                rewards = self.token_rewards(td, rollout, metrics)
                td["advantages"], td["returns"] = self.advantages(td, rewards, rollout)
            if "rollout_rs_mask" in td.keys():  # masked IS: rejected tokens leave both updates
                td["response_mask"] = td["response_mask"] * td["rollout_rs_mask"]
            faults.point("update", step)
            if "values" in td.keys():
                with timer("update_critic"):
                    metrics.update(self.workers.update_critic(td, generator=step_generator(t.seed, step, 2)))
                metrics["critic/vf_explained_var"] = explained_variance(
                    td["values"], td["returns"], td["response_mask"]
                )
                metrics.update(critic_value_stats(td["values"], td["response_mask"]))
            if step > t.critic_warmup:
                with timer("update_actor"):
                    metrics.update(self.workers.update_policy(td, generator=step_generator(t.seed, step, 1)))
                self.policy_version += 1
                with timer("update_weights"):  # to separate rollout workers (split placement)
                    received = self.workers.sync_weights(self.policy_version)
                self.source.sync_idle(timer, received)
                if self.sync_probe is not None:
                    metrics[SYNC_PROBE_METRIC] = self.verify_sync(step)
            self.workers.check_weights(step, (td["prompt_ids"][:1], td["prompt_mask"][:1]))
        out = rollout.out
        metrics.update(
            data_metrics(
                scores=rollout.scores,
                rewards=rewards,
                advantages=td["advantages"],
                returns=td["returns"],
                response_mask=out.response_mask,
                prompt_mask=out.prompt_mask,
                truncated=out.truncated,
                correct=rollout.correct,
            )
        )
        metrics["train/zero_variance_group_ratio"] = zero_variance_group_ratio(rollout.scores, uids)
        metrics.update(timer.metrics())
        tokens = int(out.prompt_mask.sum() + out.response_attention_mask.sum())
        seconds = timer.seconds["step"]
        metrics.update(
            {
                "perf/total_num_tokens": float(tokens),
                "perf/time_per_step": seconds,
                "perf/throughput": tokens / max(seconds, 1e-9),
            }
        )
        self._dump_samples(step, rollout, td["advantages"])
        return metrics

    def verify_sync(self, step: int | None) -> float:
        """The sync probe's largest difference after the weight load of ``step`` (None: the first);
        beyond the rollout dtype's bound the run stops (:mod:`tearless.rollout.sync_probe`)."""
        policy, engines = self.workers.probe_sync(self.sync_probe)
        diff = max(max_difference(e, policy) for e in engines)
        bound = probe_bound(self.sync_probe_dtype)
        if not diff <= bound:  # a NaN difference stops the run too
            raise TrainingStopped(mismatch_message(step, diff, bound, self.sync_probe_dtype))
        return diff

    def forward_passes(self, td: TensorDict, rollout: Rollout, metrics: dict, timer: Timer) -> None:
        """Old log-probs (and the rollout-vs-trainer mismatch), reference log-probs and values."""
        cfg = self.cfg
        arr, alg = cfg.actor_rollout_ref, cfg.algorithm
        rc = alg.rollout_correction
        if rc.bypass_mode:  # π_old := the behaviour policy, the rollout's own log-probs
            td["old_log_prob"] = rollout.out.log_probs
        elif (
            not on_policy(arr.actor, num_groups(td["uid_index"]))
            or alg.use_kl_in_reward
            or any(v is not None for v in (rc.rollout_is, rc.rollout_rs, rc.rollout_token_veto_threshold))
            or not self.capabilities.exact_log_probs
            or self.precision_mismatch
        ):
            with timer("old_log_prob"):
                td["old_log_prob"], _ = self.workers.compute_log_prob("actor", td)
            behaviour, mask = rollout.out.log_probs, td["response_mask"]
            weights, corr = rollout_correction(
                td["old_log_prob"],
                behaviour,
                mask,
                level=rc.rollout_is,
                threshold=rc.rollout_is_threshold,
                lower=rc.rollout_is_threshold_lower,
            )
            keep, rejected = rollout_rejection(
                td["old_log_prob"],
                behaviour,
                mask,
                level=rc.rollout_rs,
                threshold=rc.rollout_rs_threshold,
                lower=rc.rollout_rs_threshold_lower,
                veto=rc.rollout_token_veto_threshold,
            )
            metrics.update({**corr, **rejected})
            if weights is not None:
                td["rollout_is_weights"] = weights
            if keep is not None:
                td["rollout_rs_mask"] = keep
        if arr.actor.use_kl_loss or alg.use_kl_in_reward:
            with timer("ref"):
                td["ref_log_prob"], _ = self.workers.compute_log_prob("ref", td)
        if critic_enabled(cfg):
            with timer("values"):
                td["values"] = self.workers.compute_values(td)

    def token_rewards(self, td: TensorDict, rollout: Rollout, metrics: dict) -> torch.Tensor:
        """(B, R) rewards: each score on its response's last model token (and step scores on their
        steps' last tokens), minus the KL penalty when it is in the reward (the KL controller updated)."""
        mask = td["response_mask"]
        # Each score on the last model token of its response, and step scores (when the scorer gave
        # any) on the last token of each reasoning step (tearless.rewards.steps).
        rewards, td["step_mask"] = rollout_token_rewards(
            rollout.scores,
            rollout.extras,
            rollout.texts,
            rollout.out,
            self.tokenizer,
            self.cfg.reward_model.step_reward,
        )
        alg = self.cfg.algorithm
        if alg.use_kl_in_reward:
            kl, current_kl = reward_kl(td["old_log_prob"], td["ref_log_prob"], mask, alg.kl_penalty)
            rewards = rewards - self.kl_ctrl.value * kl
            metrics["actor/reward_kl_penalty"] = current_kl
            metrics["actor/reward_kl_penalty_coeff"] = self.kl_ctrl.value
            self.kl_ctrl.update(current_kl, n_steps=len(mask))
        return rewards

    def advantages(
        self, td: TensorDict, rewards: torch.Tensor, rollout: Rollout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Advantages and returns of the configured estimator, grouped by uid (ReMax's baseline: the
        score of each response's prompt's greedy response, generated with the samples)."""
        alg = self.cfg.algorithm
        return compute_advantage(
            alg.adv_estimator,
            token_level_rewards=rewards,
            response_mask=td["response_mask"],
            index=rollout.uids,
            gamma=alg.gamma,
            lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
            reward_baselines=rollout.baselines,
            values=td.get("values", None),
            step_mask=td["step_mask"],
        )

    def _dump_samples(self, step: int, rollout: Rollout, advantages: torch.Tensor) -> None:
        """Append this step's samples (every prompt group's, or the first ``trainer.num_rollout_samples``)
        to the rollout records, unless the file has reached ``trainer.rollout_log_max_mb``."""
        t = self.cfg.trainer
        items, mask = rollout.items, rollout.out.response_mask
        records = []
        count = len(items) if t.num_rollout_samples < 0 else min(t.num_rollout_samples, len(items))
        for i in range(count):
            valid = mask[i].bool()
            record = {
                "step": step,
                "uid": items[i]["uid"],
                "data_source": items[i]["data_source"],
                "prompt": self.tokenizer.decode(items[i]["input_ids"], skip_special_tokens=False),
                "response": rollout.texts[i],
                "ground_truth": str(items[i]["ground_truth"]),
                "score": float(rollout.scores[i]),
                "reward_extra": rollout.extras[i],
                "advantage": float(advantages[i][valid][0]) if valid.any() else 0.0,
                "response_length": int(valid.sum()),
                "truncated": bool(rollout.out.truncated[i]),
            }
            if "tool_calls" in items[i]:
                record["tool_calls"] = items[i]["tool_calls"]
            records.append(record)
        append_step(self.run_dir / ROLLOUTS_FILE, records, int(t.rollout_log_max_mb * 2**20))

    # ---------------------------------------------------------------- validation
    def validate(self) -> dict[str, float]:
        """Greedy accuracy, and with ``val_kwargs.do_sample`` mean@n and pass@k, per data_source."""
        cfg = self.cfg
        return validate(
            self.val_set,
            self.generate,
            cfg.actor_rollout_ref.rollout.val_kwargs,
            seed=cfg.trainer.seed,
            batch_size=cfg.data.val_batch_size,
            log=self.log,
        )

    # ---------------------------------------------------------------- the loop
    def _restore_checkpointed_record(self) -> None:
        """Append the resumed checkpoint's own metrics line if the crash came before it was written."""
        state = getattr(self, "_resume_state", None)
        record = state.get("step_metrics") if state else None
        path = self.run_dir / "metrics.jsonl"
        if not record:
            return
        steps = [r.get("step") for r in read_metrics(path)]
        if self.start_step not in steps:
            with open(path, "a") as f:
                f.write(json.dumps({"step": self.start_step, **record}) + "\n")

    def _warn_truncation(self, metrics: dict[str, float]) -> None:
        """Warn once when most of a step's responses hit the response cap (answers cut before they end)."""
        share = metrics.get("response_length/clip_ratio", 0.0)
        if share > 0.5 and not getattr(self, "_warned_truncation", False):
            self._warned_truncation = True
            self.log(
                f"warning: {share:.0%} of this step's responses reached the cap of {self.response_length} "
                "tokens and were cut before they ended; raise data.max_response_length"
            )

    def _warn_no_signal(self, metrics: dict[str, float]) -> None:
        """Warn once when most prompt groups of two steps in a row got equal rewards for every response
        while the step's mean score sat in the lower half of its range (the flat groups are mostly
        failures): group-relative advantages are then zero and those groups teach nothing. Groups flat
        because every answer is right (a run that has learned its task) are no cause for a warning."""
        ratio = metrics.get("train/zero_variance_group_ratio", 0.0)
        low, high = metrics.get("critic/score/min", 0.0), metrics.get("critic/score/max", 0.0)
        failing = metrics.get("critic/score/mean", 0.0) <= (low + high) / 2
        flat = ratio > 0.5 and failing and self.cfg.actor_rollout_ref.rollout.n > 1
        self.flat_steps = self.flat_steps + 1 if flat else 0
        if self.flat_steps == 2 and not self.warned_no_signal:
            self.warned_no_signal = True
            rollout = self.cfg.actor_rollout_ref.rollout
            self.log(
                f"warning: {ratio:.0%} of this step's prompt groups (and most of the last step's) got the "
                "same reward for every response, so they carry no learning signal "
                "(train/zero_variance_group_ratio); raise actor_rollout_ref.rollout.temperature (now "
                f"{rollout.temperature}) or actor_rollout_ref.rollout.n (now {rollout.n}), or use prompts "
                "the model solves sometimes"
            )

    def _count_bad_step(self, metrics: dict[str, float]) -> None:
        """Track optimizer steps skipped this step (from the roles' counters) and the run of bad steps."""
        before = sum(self.skipped.values())
        for role in self.skipped:
            self.skipped[role] = metrics.get(f"{role}/skipped_steps", self.skipped[role])
        self.bad_steps = self.bad_steps + 1 if sum(self.skipped.values()) > before else 0
        metrics["training/bad_steps_in_a_row"] = float(self.bad_steps)
        metrics["training/total_steps"] = float(self.total_steps)  # the report tells finished from stopped

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

    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps``; return the run directory and validation before and after.

        Holds the run directory's lock throughout (:mod:`tearless.trainers.runlock`)."""
        with runlock.acquire(self.run_dir):
            return self._fit()

    def _fit(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.trainer
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Steps after the checkpoint we start from are replayed, so their old records go (all of them
        # when starting from scratch in a used directory).
        truncate_jsonl(
            self.run_dir / "metrics.jsonl", self.start_step if self.start_step > 0 else -1, log=self.log
        )
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
            callbacks=self.callbacks,
        )
        tracker.start_at(self.start_step)
        summary: dict[str, Any] = {"run_dir": str(self.run_dir), "start_step": self.start_step}
        started = time.perf_counter()
        try:
            if self.sync_probe is not None:
                self.verify_sync(None)
            if t.val_only or (self.start_step == 0 and t.val_before_train):
                timer = Timer()
                with timer("testing"):
                    summary["before"] = self.validate()
                if self.start_step == 0:  # a val_only pass over a resumed run is not a step of it
                    tracker.log({**summary["before"], **timer.metrics()}, 0)
                title = f"at step {self.start_step}" if t.val_only else "before training"
                tracker.write(format_validation(title, summary["before"]))
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
                metrics = self.train_step(step)
                self._count_bad_step(metrics)
                stop = 0 < t.max_bad_steps <= self.bad_steps
                epoch = (self.prompts.position - 1) // self.loader.num_batches
                metrics.update({"training/global_step": float(step), "training/epoch": float(epoch)})
                last = step == self.total_steps
                if last or (t.test_freq > 0 and step % t.test_freq == 0):
                    timer = Timer()
                    with timer("testing"):
                        val = self.validate()
                    metrics.update(val)
                    metrics.update(timer.metrics())
                    summary["after"] = val
                if (
                    stop
                    or (last and t.save_final_checkpoint)
                    or (t.save_freq > 0 and step % t.save_freq == 0)
                ):
                    timer = Timer()
                    with timer("save_checkpoint"):
                        summary["checkpoint"] = str(self.save(step, metrics))
                    metrics.update(timer.metrics())
                faults.point("metrics", step)
                self._warn_truncation(metrics)
                self._warn_no_signal(metrics)
                tracker.log(metrics, step)
                if stop:
                    raise TrainingStopped(self._bad_steps_message(step, summary["checkpoint"]))
            if "after" in summary:
                tracker.write(format_validation("after training", summary["after"]))
        finally:
            tracker.close()
            self.workers.close()
        summary["seconds"] = time.perf_counter() - started
        summary["steps"] = self.total_steps
        return summary
