"""The RL trainer of the PPO family (GRPO, RLOO, REINFORCE++, ReMax, OPO, … are estimator choices).

One step (``RLTrainer.train_step``), each part one call to the worker group
(:mod:`tearless.workers.group`), whatever the placement:

  1. rollout and reward: the generating ranks sample ``rollout.n`` responses per prompt and score them;
  2. old log-probs (skipped when the update is provably on-policy), reference log-probs (when a KL
     term is on) and critic values (for GAE);
  3. KL in the reward (optional) and advantages, grouped by each prompt's ``uid``, in the driver
     (:mod:`tearless.trainers.returns`);
  4. critic and actor updates: PPO epochs over mini-batches, micro-batched, globally normalised.

Validation, metrics, rollout samples and checkpoints happen around it in ``fit``. What the trainer
reads before its first step is :mod:`tearless.trainers.setup`'s, the facts derived from the config
the plan's (:mod:`tearless.config.plan`), the counts of bad steps and the run's warnings
:mod:`tearless.trainers.health`'s. With
``async_training.enable`` step 1 takes a batch generated ahead, up to ``max_staleness`` policy
versions old; both loops take their batches from one source (:mod:`tearless.trainers.source`).
"""

from __future__ import annotations

import functools
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from tearless import faults
from tearless.algos import make_kl_controller
from tearless.algos.groups import num_groups
from tearless.config import Config, resume_compat, to_dict
from tearless.config.memory import announce_memory
from tearless.config.plan import build_plan
from tearless.cpu import configure_cpu
from tearless.rollout.batch import Rollout
from tearless.rollout.correction import correct_rollout
from tearless.rollout.sync_probe import METRIC as SYNC_PROBE_METRIC
from tearless.rollout.sync_probe import (
    checksum_message,
    max_difference,
    mismatch_message,
    probe_bound,
    probe_ids,
)
from tearless.run import checkpoint as ckpt
from tearless.run.timer import Timer
from tearless.run.tracking import restore_record, truncate_jsonl
from tearless.trainers import runlock
from tearless.trainers.health import StepHealth
from tearless.trainers.metrics import data_metrics, distill_metrics, zero_variance_group_ratio
from tearless.trainers.progress import run_tracker, say_if_complete
from tearless.trainers.records import ROLLOUTS_FILE, append_step, step_records, truncate_records
from tearless.trainers.returns import advantages, token_rewards
from tearless.trainers.reward_errors import RewardErrors
from tearless.trainers.setup import (
    prompt_loader,
    prompt_sets,
    resolve_files,
    resume_point,
    rule_scored_validation,
    run_fingerprints,
    run_tokenizer,
)
from tearless.trainers.source import BatchSource, PromptDraw
from tearless.trainers.validation import format_validation, validate
from tearless.workers.calibrate import announce_autocast, resolve_auto
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
        t = cfg.trainer
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        configure_cpu(t.num_threads, t.keep_freed_memory)
        files = resolve_files(cfg, self.log)
        self.fingerprints = run_fingerprints(cfg, files)
        self.tokenizer = run_tokenizer(cfg, files)
        self.train_set, self.val_set = prompt_sets(cfg, files, self.tokenizer, reward_fn, self.log)
        self.rule_validation = rule_scored_validation(cfg, reward_fn, self.val_set, self.log)
        self.loader = prompt_loader(cfg, self.train_set)
        self.total_steps = t.total_training_steps or t.total_epochs * self.loader.num_batches
        self.run_dir = Path(t.default_local_dir)
        self.prompts = PromptDraw(self.loader)
        self.policy_version = 0  # actor updates so far (the version rollouts record, docs/async.md)
        self.reward_errors = RewardErrors(cfg.reward_model.tolerate_failed_steps, self.log)
        self.start_step, resume_dir, self._resume_state = resume_point(
            cfg, self.run_dir, self.fingerprints, self.log
        )
        # The run's derived facts, once; the driver's device, not the workers' (auto on a CPU head
        # measures no GPU, and announce_memory checks none).
        driver_device = resolve_device(t.device)
        self.plan = resolve_auto(
            cfg, build_plan(cfg, files, self.total_steps), gpu=driver_device == "cuda", log=log
        )
        self.health = StepHealth(cfg, self.plan.response_length, self.total_steps, log)
        announce_memory(cfg, files.model_path, driver_device, self.log, files.teacher_path, plan=self.plan)
        spec = RankSpec(
            cfg,
            roles=self.plan.roles,
            rollout=True,
            model_path=files.model_path,
            total_steps=self.total_steps,
            device=t.device,  # auto: each rank decides in its own process
            resume_dir=None if resume_dir is None else str(resume_dir),
            reward_fn=reward_fn,
            plan=self.plan,
        )
        self.workers = make_workers(spec, self.tokenizer.pad_token_id, run_dir=self.run_dir)
        announce_autocast(self.plan, self.workers.device, self.log, self.workers.world_of)
        if (note := self.plan.eager_despite_compile(self.workers.world_of("actor"))) is not None:
            self.log(note)
        # The hybrid built-in engine sampling in another precision than the trainer's π_old forward:
        # π_old is recomputed so rollout_corr/* shows the mismatch.
        self.precision_mismatch = self.plan.precision_mismatch(self.workers.device)
        alg = cfg.algorithm
        self.kl_ctrl = make_kl_controller(
            alg.kl_ctrl.type, alg.kl_ctrl.kl_coef, alg.kl_ctrl.target_kl, alg.kl_ctrl.horizon
        )
        if resume_dir:
            self._load_state(resume_dir)
        # Every load into an engine holding its own weights is checked against the trainer
        # (tearless.rollout.sync_probe).
        self.sync_probe = (
            probe_ids(self.train_set[0], self.tokenizer) if self.plan.capabilities.holds_own_weights else None
        )
        self.sync_probe_dtype = self.plan.rollout_dtype(self.workers.device)
        # The one source of batches: synchronous (k = 0), or generating up to k steps ahead
        # (async_training, docs/async.md).
        self.source = BatchSource(
            self.workers,
            self.prompts,
            self.plan.source,
            version=lambda: self.policy_version,
            report_errors=self.reward_errors.report,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    # ---------------------------------------------------------------- checkpoints
    def _load_state(self, path: Path) -> None:
        state = self._resume_state
        self.workers.load(str(path), state["workers"])
        self.health.skipped = {role: float(s["skipped_steps"]) for role, s in state["workers"].items()}
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        # the ranks applied it to their optimizers
        resume_compat.apply_config({}, self.kl_ctrl, self.cfg.algorithm.kl_ctrl)
        self.prompts.position = state["batches_consumed"]
        warmup = self.cfg.trainer.critic_warmup
        self.policy_version = int(state.get("policy_version", max(0, self.start_step - warmup)))
        self.health.bad_steps = int(state.get("bad_steps", 0))
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
            "bad_steps": self.health.bad_steps,
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
                    # A vision-language policy's processor: its tokenizer and its image processor.
                    (self.train_set.processor or self.tokenizer).save_pretrained(directory / name)
            return {"workers": workers}

        return ckpt.save_checkpoint(
            self.run_dir, step, state=state, keep=self.cfg.trainer.max_actor_ckpt_to_keep, write=write
        )

    # ---------------------------------------------------------------- one RL step
    def generate(
        self, prompts: list[dict], *, keys: list[int] | None, n: int, rule_scored: bool = False,
        **sampling: Any,
    ) -> Rollout:  # fmt: skip
        """``n`` scored responses per prompt from the worker group (``rule_scored``: by the rule scorers
        alone); reward errors are reported (and a round whose every sample failed stops the run) by
        :mod:`tearless.trainers.reward_errors`."""
        rollout = self.workers.generate(
            prompts, n=n, keys=keys, max_new_tokens=self.plan.response_length, version=self.policy_version,
            rule_scored=rule_scored, **sampling,
        )  # fmt: skip
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
                rewards = token_rewards(self.cfg, td, rollout, self.tokenizer, self.kl_ctrl, metrics)
                td["advantages"], td["returns"] = advantages(self.cfg, td, rewards, rollout)
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
                    with timer("sync_check"):  # the probe and the weight checksum
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
        # this step's samples (every prompt group's, or the first trainer.num_rollout_samples), unless
        # the rollout records have reached trainer.rollout_log_max_mb
        records = step_records(step, rollout, td["advantages"], self.tokenizer, t.num_rollout_samples)
        append_step(self.run_dir / ROLLOUTS_FILE, records, int(t.rollout_log_max_mb * 2**20))
        return metrics

    def verify_sync(self, step: int | None) -> float:
        """The sync probe's largest difference after the weight load of ``step`` (None: the first);
        beyond the rollout dtype's bound the run stops (:mod:`tearless.rollout.sync_probe`)."""
        policy, engines = self.workers.probe_sync(self.sync_probe)
        for _, fault in engines:
            if fault is not None:
                raise TrainingStopped(checksum_message(step, fault))
        diff = max(max_difference(e, policy) for e, _ in engines)
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
            not self.plan.on_policy(num_groups(td["uid_index"]))
            or alg.use_kl_in_reward
            or any(v is not None for v in (rc.rollout_is, rc.rollout_rs, rc.rollout_token_veto_threshold))
            or not self.plan.capabilities.exact_log_probs
            or self.precision_mismatch
        ):
            with timer("old_log_prob"):
                td["old_log_prob"], _ = self.workers.compute_log_prob("actor", td)
            weights, keep, corr = correct_rollout(
                td["old_log_prob"], rollout.out.log_probs, td["response_mask"], rc
            )
            metrics.update(corr)
            if weights is not None:
                td["rollout_is_weights"] = weights
            if keep is not None:
                td["rollout_rs_mask"] = keep
        if arr.actor.use_kl_loss or alg.use_kl_in_reward:
            with timer("ref"):
                td["ref_log_prob"], _ = self.workers.compute_log_prob("ref", td)
        if self.plan.distills:  # the teacher scores the student's own samples, as the reference does
            with timer("teacher"):
                td["teacher_log_prob"], _ = self.workers.compute_log_prob("teacher", td)
            # The student's log-probs: π_old's when computed, else the sampler's, which equal them
            # exactly here (π_old is skipped only for an engine with exact log-probs, in one precision).
            student = td["old_log_prob"] if "old_log_prob" in td.keys() else rollout.out.log_probs
            td["student_log_prob"] = student
            metrics.update(distill_metrics(td["teacher_log_prob"], student, td["response_mask"]))
        if self.plan.critic:
            with timer("values"):
                td["values"] = self.workers.compute_values(td)

    # ---------------------------------------------------------------- validation
    def validate(self) -> dict[str, float]:
        """Greedy accuracy, and with ``val_kwargs.do_sample`` mean@n and pass@k, per data_source."""
        cfg = self.cfg
        return validate(
            self.val_set,
            functools.partial(self.generate, rule_scored=self.rule_validation),
            cfg.actor_rollout_ref.rollout.val_kwargs,
            seed=cfg.trainer.seed,
            batch_size=cfg.data.val_batch_size,
            log=self.log,
        )

    # ---------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps``; return the run directory and validation before and after.

        Holds the run directory's lock throughout (:mod:`tearless.trainers.runlock`)."""
        with runlock.acquire(self.run_dir):
            return self._fit()

    def _prepare_run_dir(self) -> None:
        """The run directory's records as of the start step, and the config as given."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Steps after the checkpoint we start from are replayed, so their old records go (all of them
        # when starting from scratch in a used directory).
        last = self.start_step if self.start_step > 0 else -1
        truncate_jsonl(self.run_dir / "metrics.jsonl", last, log=self.log)
        truncate_records(self.run_dir / ROLLOUTS_FILE, last)
        state = self._resume_state
        restore_record(self.run_dir / "metrics.jsonl", self.start_step, state and state.get("step_metrics"))
        (self.run_dir / "config.json").write_text(json.dumps(to_dict(self.cfg), indent=1, default=str))

    def _fit(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.trainer
        self._prepare_run_dir()
        tracker = run_tracker(self.run_dir, cfg, total_steps=self.total_steps, callbacks=self.callbacks)
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
            again = "use another trainer.experiment_name (or trainer.default_local_dir)"
            say_if_complete(tracker, self.run_dir, self.start_step, self.total_steps, again)
            step = self.start_step
            while step < self.total_steps:
                step += 1
                metrics = self.train_step(step)
                stop = self.health.count_bad_step(metrics)
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
                self.health.warn(metrics)
                tracker.log(metrics, step)
                if stop:
                    raise TrainingStopped(self.health.stop_message(step, summary["checkpoint"]))
            if "after" in summary:
                tracker.write(format_validation("after training", summary["after"]))
        finally:
            tracker.close()
            self.workers.close()
        summary["seconds"] = time.perf_counter() - started
        summary["steps"] = self.total_steps
        return summary
