"""The Ray + FSDP2 placement against the single-process trainer, on 2 CPU worker processes (gloo).

One Ray session serves the module. Every run has the same config: 4 steps of PPO with GAE (so that
a critic is sharded, trained and checkpointed too), cosine LR (so that the schedule moves and a
lost scheduler state would show), KL loss (so that the reference runs too), two mini-batches per
step and two PPO epochs with shuffling (so that the old log-probs, the update plan and the
micro-batch padding all matter), a checkpoint at every step.

- ``local``: the single-process trainer: the reference numbers.
- ``chain``, one run directory: 2 workers run steps 1-2, then rank 1 is SIGKILLed while step 3 is
  scored (checkpoint 2 is the last complete one) → resumed on 1 worker per role in split pools
  (``trainer.colocate=false``), which saves step 3 and is stopped during step 4 → resumed on 2
  colocated workers for step 4. Every step must match ``local``.

Tolerances: sharding changes the order of float additions (reduce-scatter of gradient halves,
norms summed from shards), so values agree to float32 rounding of those sums (tests/tolerances.py),
not bit for bit: see :func:`assert_same_steps`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tearless import train
from tearless.distributed.group import WorkerError
from tearless.tasks.arithmetic import compute_score as arithmetic_score
from tearless.trainers.tracking import read_metrics
from tests.tolerances import eps, gradient_terms, loss_rel, sum_tol

pytestmark = pytest.mark.slow

STEPS = 4
TIMEOUT_S = 60
COMPARED = (
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/lr",
    "critic/score/mean",
    "response_length/mean",
    "critic/vf_loss",
    "critic/grad_norm",
    "critic/values/mean",
    "critic/lr",
)


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def args(overrides, run_dir, *extra):
    """The conftest's small run (8 prompts × 4 responses, jsonl) with an update that exercises every
    part of the schedule, and the workers' settings."""
    return overrides(
        run_dir,
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # two optimizer steps per RL step
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.shuffle=true",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=0",  # λ = 1, 0.85, 0.5, 0.15
        "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
        "data.val_max_samples=8",
        "trainer.val_before_train=false",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=1",
        "trainer.num_threads=1",
        # The workers never share prompt forwards; the single-process reference must do the same sums
        # for the 1e-6 comparison (sharing is the same maths with different rounding).
        "actor_rollout_ref.model.share_prompt_forward=false",
        f"trainer.worker_timeout_s={TIMEOUT_S}",
        *extra,
    )


def workers(n):
    return ["trainer.placement=ray", f"trainer.n_gpus_per_node={n}"]


class Interrupt:
    """A reward function that, while scoring step ``at_step`` of ``run_dir``, SIGKILLs a worker
    (``kill_rank``) or raises (``kill_rank=None``), once."""

    def __init__(self, run_dir, at_step, kill_rank=None):
        self.run_dir, self.at_step, self.kill_rank = run_dir, at_step, kill_rank
        self.fired_at = None

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        last = json.loads(lines[-1])["step"] if lines else 0
        if self.fired_at is None and last == self.at_step - 1:
            self.fired_at = time.monotonic()
            if self.kill_rank is None:
                raise KeyboardInterrupt("stopped by the test")
            info = json.loads((self.run_dir / "workers_actor+ref+critic.json").read_text())
            os.kill(info[self.kill_rank]["pid"], signal.SIGKILL)
        return arithmetic_score(solution_str, ground_truth, extra_info)


@pytest.fixture(scope="module")
def local(overrides, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("local")
    train(None, args(overrides, run_dir), log=lambda _: None)
    return run_dir


@pytest.fixture(scope="module")
def chain(ray_session, overrides, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("chain")
    kill = Interrupt(run_dir, at_step=3, kill_rank=1)
    with pytest.raises(WorkerError) as died:
        train(None, args(overrides, run_dir, *workers(2)), reward_fn=kill, log=lambda _: None)
    stopped_after = time.monotonic() - kill.fired_at
    after_death = sorted(p.name for p in run_dir.glob("global_step_*"))
    two_worker_state = torch.load(run_dir / "global_step_2" / "trainer_state.pt", weights_only=False)
    two_worker_shards = len(list((run_dir / "global_step_2" / "dcp" / "actor").glob("*.distcp")))
    with pytest.raises(KeyboardInterrupt):
        train(
            None,
            args(overrides, run_dir, *workers(1), "trainer.colocate=false"),
            reward_fn=Interrupt(run_dir, 4),
            log=lambda _: None,
        )
    split_pools = sorted(p.name for p in run_dir.glob("workers_*.json"))
    after_one = sorted(p.name for p in run_dir.glob("global_step_*"))
    summary = train(None, args(overrides, run_dir, *workers(2)), log=lambda _: None)
    return dict(
        run_dir=run_dir,
        error=str(died.value),
        stopped_after=stopped_after,
        after_death=after_death,
        after_one=after_one,
        split_pools=split_pools,
        two_worker_state=two_worker_state,
        two_worker_shards=two_worker_shards,
        summary=summary,
    )


OPTIMIZER_STEPS_PER_STEP = 4  # 2 mini-batches × 2 PPO epochs (args), for the actor and the critic
TOKENS_PER_STEP = 32 * 16  # 8 prompts × 4 responses of at most 16 tokens


def assert_same_steps(a_dir, b_dir, steps, model_dir):
    """Metrics and weights of run ``b_dir`` equal to those of ``a_dir`` at ``steps``, to rounding
    (both runs started from ``model_dir``).

    Losses, KLs and norms: the update's sums in another order (loss_rel). The learning rates, scores,
    lengths, clip fractions and the critic's first values (of a zeroed head) are computed from equal
    numbers and come out equal. Weights: each AdamW step rounds twice (the decay, then the step) to
    float32, so the runs may land 2 ulps apart per optimizer step (2·eps·|θ|), and the steps differ
    by the gradients' rounding relative to the distance travelled since the start, with safety 10:
    AdamW divides by √v̂ + ε, so an entry whose gradient is close to ε turns its rounding into a
    larger share of its step than a plain gradient step would.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    start = load_file(Path(model_dir) / "model.safetensors")  # actor and critic start here
    rel = loss_rel(config, TOKENS_PER_STEP)
    a = {r["step"]: r for r in read_metrics(a_dir / "metrics.jsonl")}
    b = {r["step"]: r for r in read_metrics(b_dir / "metrics.jsonl")}
    for step in steps:
        for key in COMPARED:
            assert b[step][key] == pytest.approx(a[step][key], rel=rel), (step, key)
        optimizer_steps = step * OPTIMIZER_STEPS_PER_STEP
        terms = gradient_terms(config, TOKENS_PER_STEP)
        for role in ("actor", "critic"):
            wa = load_file(a_dir / f"global_step_{step}" / role / "model.safetensors")
            wb = load_file(b_dir / f"global_step_{step}" / role / "model.safetensors")
            assert wa.keys() == wb.keys()
            for name in wa:
                w0 = start.get(name, torch.zeros_like(wa[name]))  # the critic's value head starts at 0
                moved = float((wa[name] - w0).abs().max())
                atol = optimizer_steps * 2 * eps(wa[name].dtype) * float(wa[name].abs().max())
                atol += sum_tol(terms, moved, safety=10)
                torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=atol, msg=f"{step} {role} {name}")


def test_two_ray_workers_match_the_single_process_run(local, chain, task):
    # steps 1 and 2 ran on 2 workers from the start, like any multi-worker run
    assert_same_steps(local, chain["run_dir"], (1, 2), task.model_dir)
    first = load_file(local / "global_step_1" / "actor" / "model.safetensors")
    last = load_file(local / f"global_step_{STEPS}" / "actor" / "model.safetensors")
    assert any(not first[k].equal(last[k]) for k in first)  # the weights really moved
    # the LR schedule moves, so a resume that lost the scheduler state would show
    assert len({r["actor/lr"] for r in read_metrics(local / "metrics.jsonl")}) == STEPS


def test_checkpoints_are_consolidated_and_sharded(chain):
    from transformers import AutoModelForCausalLM

    ckpt = chain["run_dir"] / f"global_step_{STEPS}"
    model = AutoModelForCausalLM.from_pretrained(ckpt / "actor")  # no merge step needed
    assert sum(p.numel() for p in model.parameters()) > 0
    assert (ckpt / "dcp" / "actor" / ".metadata").is_file()
    assert chain["two_worker_shards"] == 2  # one optimizer shard file per worker
    assert chain["two_worker_state"]["workers"]["world_size"] == 2
    assert "optimizer" not in chain["two_worker_state"]


def test_killed_worker_stops_the_run_naming_it(chain):
    assert "rank 1" in chain["error"] and "died" in chain["error"], chain["error"]
    assert "pid" in chain["error"]
    assert chain["stopped_after"] < TIMEOUT_S
    assert chain["after_death"] == ["global_step_1", "global_step_2"]  # nothing of step 3 was saved


def test_resume_two_to_one_to_two_workers_matches_the_single_process_run(local, chain, task):
    assert chain["after_one"] == ["global_step_1", "global_step_2", "global_step_3"]
    # the one-worker segment ran one pool per role
    assert {"workers_actor.json", "workers_ref.json", "workers_critic.json"} <= set(chain["split_pools"])
    assert chain["summary"]["start_step"] == 3
    steps = [r["step"] for r in read_metrics(chain["run_dir"] / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4]  # each step logged once, the interrupted ones replaced
    assert_same_steps(local, chain["run_dir"], range(1, STEPS + 1), task.model_dir)


def test_a_ray_checkpoint_refuses_the_local_placement(chain, overrides, tmp_path):
    run_dir = tmp_path / "copy"
    shutil.copytree(chain["run_dir"], run_dir)
    with pytest.raises(ValueError, match=r"trainer\.placement=ray"):
        train(None, args(overrides, run_dir, "trainer.total_training_steps=5"), log=lambda _: None)


def test_a_worker_exception_reaches_the_driver_with_its_traceback(ray_session, task, overrides):
    from tensordict import TensorDict

    from tearless.config import load_config
    from tearless.distributed.group import WorkerGroup
    from tearless.distributed.worker import WorkerSpec

    cfg = load_config(None, args(overrides, "unused"))
    spec = WorkerSpec(cfg, ("ref",), {"ref": str(task.model_dir)}, 1, "cpu", TIMEOUT_S)
    group = WorkerGroup(spec, 1, name="ref")
    td = TensorDict(
        {
            k: torch.ones(1, 2, dtype=torch.long)
            for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
        },
        batch_size=[1],
    )
    with pytest.raises(WorkerError) as info:
        group.call("compute_log_prob", "actor", td, 1)  # this group holds no actor
    message = str(info.value)
    assert "ref worker rank 0 (pid" in message and "compute_log_prob" in message
    # the remote traceback: the failing line of the worker's code and the exception
    assert "worker.py" in message and "self.roles[role]" in message and "KeyError: 'actor'" in message
    assert "\x1b[" not in message
    assert group.handles == []  # the group was stopped


def test_a_worker_that_does_not_answer_in_time_is_named_and_stopped(ray_session, task, overrides):
    from tearless.config import load_config
    from tearless.distributed.group import WorkerGroup
    from tearless.distributed.worker import WorkerSpec

    cfg = load_config(None, args(overrides, "unused"))
    # Starting a worker process takes seconds; a 50 ms limit on the first call cannot be met.
    spec = WorkerSpec(cfg, ("ref",), {"ref": str(task.model_dir)}, 1, "cpu", 0.05)
    started = time.monotonic()
    with pytest.raises(
        WorkerError, match=r"ref worker rank 0 .*no answer to start within trainer\.worker_timeout_s=0\.05"
    ):
        WorkerGroup(spec, 1, name="ref")
    assert time.monotonic() - started < 5
