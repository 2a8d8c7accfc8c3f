"""Every placement against the single-process trainer, on CPU worker processes (Ray, FSDP2 over gloo).

One Ray session serves the module. Sampling is keyed by each sample's identity
(:mod:`tearless.rollout.seeds`), so a run on 1, 2 or 3 ranks draws the same responses, and the tests
compare placements end to end: the rollouts (every response's text and score, from the rollout
records), the losses and the weights.

- ``ppo``: PPO with GAE (a critic, sharded and checkpointed), a KL loss (the reference), two
  mini-batches and two PPO epochs with shuffling, a cosine LR schedule, a checkpoint every step. The
  reference runs 4 steps in one process; the ``chain`` runs them as 2 workers (steps 1-2, rank 1
  killed in step 3) → 3 workers (step 3, rank 2 killed in step 4) → one process (step 4), each
  resuming the last.
- ``lora``: GRPO with LoRA adapters (the reference is the actor with adapters off) on one process,
  and one process (step 1) → 2 workers in a pool per role (step 2).
- ``tools``: the Search-R1 multi-turn agent loop on a tiny multihop task, one process against 2
  training workers with a separate rollout worker (the split placement), which receive the policy
  over a broadcast group after every update.

Tolerances: sharding changes the order of float additions (reduce-scatter of gradient halves, norms
summed from shards), so numbers agree to float32 rounding of those sums (tests/tolerances.py).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tearless import train
from tearless.run.tracking import read_metrics
from tearless.tasks.arithmetic import compute_score as arithmetic_score
from tearless.trainers.records import read_records
from tearless.workers import ray_group
from tearless.workers.rank import Rank
from tearless.workers.ray_group import WorkerError
from tests.conftest import search_r1_overrides
from tests.tolerances import eps, gradient_terms, logprob_tol, loss_rel, sum_tol

pytestmark = pytest.mark.slow

TIMEOUT_S = 90
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
    # The workers unpickle the tests' reward functions, so they import test modules as pytest does
    # (this one as ``distributed.test_ray_fsdp``, the helpers as ``tests.…``).
    root = Path(__file__).resolve().parents[2]
    path = [str(root), str(root / "tests"), os.environ.get("PYTHONPATH")]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, path))}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    yield ray
    ray.shutdown()


def common(overrides, run_dir, *extra):
    """The conftest's small run with every response recorded, one thread per process, and the plain
    forward in the single process too (the sharded ranks never share prompt forwards; sharing is the
    same maths in another order)."""
    return overrides(
        run_dir,
        "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
        "data.val_max_samples=8",
        "trainer.val_before_train=false",
        "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=null",  # the chains compare every step's checkpoint
        "trainer.num_threads=1",
        "trainer.num_rollout_samples=64",
        "actor_rollout_ref.model.share_prompt_forward=false",
        f"trainer.worker_timeout_s={TIMEOUT_S}",
        *extra,
    )


PPO = (
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # two optimizer steps per RL step
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.shuffle=true",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "algorithm.adv_estimator=gae",
    "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=0",  # λ = 1, 0.85, 0.5, 0.15
    "trainer.total_training_steps=4",
)
LORA = (
    "actor_rollout_ref.model.lora_rank=8",
    "actor_rollout_ref.model.lora_alpha=16",
    "actor_rollout_ref.actor.optim.lr=2e-3",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "trainer.total_training_steps=2",
)


def workers(n, *extra):
    return ["trainer.placement=ray", f"trainer.n_gpus_per_node={n}", *extra]


def steps(n):
    return f"trainer.total_training_steps={n}"


class Traffic:
    """What crosses Ray's object store in every call to the ranks: the largest tensor payload of a
    call (arguments or results), and which processes returned a share of a generation."""

    def __init__(self, monkeypatch):
        self.largest, self.generating = 0, set()
        submit, wait_all = ray_group.Pool.submit, ray_group.wait_all

        def recording_submit(pool, method, per_rank, ranks=None):
            for args in per_rank:
                self.largest = max(self.largest, tensor_bytes(args))
            return submit(pool, method, per_rank, ranks)

        def recording_wait(pending, what, timeout_s):
            results = wait_all(pending, what, timeout_s)
            for r in results:
                self.largest = max(self.largest, tensor_bytes(r))
                if isinstance(r, dict) and "pid" in r:
                    self.generating.add(r["pid"])
            return results

        monkeypatch.setattr(ray_group.Pool, "submit", recording_submit)
        monkeypatch.setattr(ray_group, "wait_all", recording_wait)


def tensor_bytes(value) -> int:
    """Bytes of every tensor inside ``value`` (nested containers, tensordicts, dataclasses)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if hasattr(value, "items"):
        return sum(tensor_bytes(v) for _, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if hasattr(value, "__dataclass_fields__"):
        return sum(tensor_bytes(getattr(value, f)) for f in value.__dataclass_fields__)
    return 0


def model_bytes(model_dir) -> int:
    return sum(
        t.numel() * t.element_size() for t in load_file(Path(model_dir) / "model.safetensors").values()
    )


class KillRank:
    """A reward function that SIGKILLs worker ``rank`` (its pid from the run directory) while step
    ``at_step`` is scored; it runs inside the ranks, so each rank's copy may fire."""

    def __init__(self, run_dir, at_step, rank):
        self.run_dir, self.at_step, self.rank = Path(run_dir), at_step, rank

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        if lines and json.loads(lines[-1])["step"] == self.at_step - 1:
            pool = next(self.run_dir.glob("workers_actor*.json"))
            os.kill(json.loads(pool.read_text())[self.rank]["pid"], signal.SIGKILL)
        return arithmetic_score(solution_str, ground_truth, extra_info)


def rollouts(run_dir):
    """step → [(response text, score)] of every response, in batch order."""
    by_step: dict[int, list] = {}
    for rec in read_records(Path(run_dir) / "rollouts.jsonl.gz"):
        by_step.setdefault(rec["step"], []).append((rec["response"], rec["score"], rec["uid"]))
    return by_step


def assert_same_steps(a_dir, b_dir, step_list, model_dir, *, optimizer_steps_per_step, roles=("actor",)):
    """Rollouts, metrics and weights of run ``b_dir`` equal to those of ``a_dir`` at ``step_list``.

    Rollouts: the same responses and scores exactly (keyed sampling; the logits they were drawn from
    differ in the last bits between layouts, so a draw landing within ~1e-7 of a CDF boundary could
    flip, a chance of order 1e-4 over these tests' draws). Losses, KLs and norms: the update's sums in
    another order (loss_rel). Weights: each AdamW step rounds twice (the decay, then the step) to
    float32, so the runs may land 2 ulps apart per optimizer step (2·eps·|θ|), and the steps differ by
    the gradients' rounding relative to the distance travelled since the start, with safety 10: AdamW
    divides by √v̂ + ε, so an entry whose gradient is close to ε turns its rounding into a larger share
    of its step than a plain gradient step would.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    start = load_file(Path(model_dir) / "model.safetensors")  # actor and critic start here
    tokens = 32 * 64  # a step's responses × the longest response any test allows
    rel = loss_rel(config, tokens)
    ra, rb = rollouts(a_dir), rollouts(b_dir)
    a = {r["step"]: r for r in read_metrics(Path(a_dir) / "metrics.jsonl")}
    b = {r["step"]: r for r in read_metrics(Path(b_dir) / "metrics.jsonl")}
    for step in step_list:
        assert rb[step] == ra[step], step
        for key in COMPARED:
            if key in a[step]:
                assert b[step][key] == pytest.approx(a[step][key], rel=rel), (step, key)
        optimizer_steps = step * optimizer_steps_per_step
        terms = gradient_terms(config, tokens)
        for role in roles:
            files = sorted((Path(a_dir) / f"global_step_{step}" / role).glob("*.safetensors"))
            assert files, (step, role)
            for file in files:
                wa = load_file(file)
                wb = load_file(Path(b_dir) / f"global_step_{step}" / role / file.name)
                assert wa.keys() == wb.keys()
                for name in wa:
                    w0 = start.get(name, torch.zeros_like(wa[name]))  # heads and adapters start elsewhere
                    if w0.shape != wa[name].shape:
                        w0 = torch.zeros_like(wa[name])
                    moved = float((wa[name] - w0).abs().max())
                    atol = optimizer_steps * 2 * eps(wa[name].dtype) * float(wa[name].abs().max())
                    atol += sum_tol(terms, moved, safety=10)
                    torch.testing.assert_close(
                        wb[name], wa[name], rtol=0, atol=atol, msg=f"{step} {role} {name}"
                    )


# ---------------------------------------------------------------------------------------------- PPO
@pytest.fixture(scope="module")
def ppo_local(overrides, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ppo-local")
    train(None, common(overrides, run_dir, *PPO), log=lambda _: None)
    return run_dir


@pytest.fixture(scope="module")
def ppo_chain(ray_session, overrides, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ppo-chain")
    with pytest.MonkeyPatch.context() as mp:
        traffic = Traffic(mp)
        started = time.monotonic()
        with pytest.raises(WorkerError) as died:
            train(
                None,
                common(overrides, run_dir, *PPO, *workers(2)),
                reward_fn=KillRank(run_dir, 3, 1),
                log=lambda _: None,
            )
        failed_after = time.monotonic() - started
        after_death = sorted(p.name for p in run_dir.glob("global_step_*"))
        two = json.loads(next(run_dir.glob("workers_actor*.json")).read_text())
        index = json.loads((run_dir / "global_step_2" / "optim" / "actor" / "index.json").read_text())
        # Stopped, not shortened: the cosine schedule spans trainer.total_training_steps.
        with pytest.raises(WorkerError):
            train(
                None,
                common(overrides, run_dir, *PPO, *workers(3)),
                reward_fn=KillRank(run_dir, 4, 2),
                log=lambda _: None,
            )
        three = json.loads(next(run_dir.glob("workers_actor*.json")).read_text())
    summary = train(None, common(overrides, run_dir, *PPO), log=lambda _: None)
    return dict(
        run_dir=run_dir,
        error=str(died.value),
        failed_after=failed_after,
        after_death=after_death,
        pids={pid for w in (two, three) for pid in [x["pid"] for x in w]},
        traffic=traffic,
        index=index,
        summary=summary,
    )


def test_ppo_on_two_then_three_workers_then_one_process_matches_the_single_process_run(
    ppo_local, ppo_chain, task
):
    # 2 mini-batches × 2 PPO epochs per step, for the actor and the critic
    assert_same_steps(
        ppo_local, ppo_chain["run_dir"], range(1, 5), task.model_dir, optimizer_steps_per_step=4,
        roles=("actor", "critic"),
    )  # fmt: skip
    assert ppo_chain["summary"]["start_step"] == 3
    assert [r["step"] for r in read_metrics(ppo_chain["run_dir"] / "metrics.jsonl")] == [1, 2, 3, 4]
    # the LR schedule moves, so a resume that lost the scheduler state would show
    assert len({r["actor/lr"] for r in read_metrics(ppo_local / "metrics.jsonl")}) == 4


def test_packed_compiled_ppo_on_two_workers_matches_the_padded_single_process_run(
    ray_session, ppo_local, overrides, tmp_path_factory, task
):
    # use_remove_padding under FSDP2: each rank packs its micro-batches (actor, reference, critic),
    # and the actor's and reference's decoder layers run compiled (use_torch_compile) between FSDP2's
    # gathers.
    run_dir = tmp_path_factory.mktemp("ppo-packed")
    packed = (
        "actor_rollout_ref.model.use_remove_padding=true",
        "critic.model.use_remove_padding=true",
        "actor_rollout_ref.actor.use_torch_compile=true",
        "trainer.worker_timeout_s=600",  # a fresh Ray pool on a loaded 2-core machine starts slowly
    )
    train(None, common(overrides, run_dir, *PPO, *packed, *workers(2)), log=lambda _: None)
    assert_same_steps(
        ppo_local, run_dir, range(1, 5), task.model_dir, optimizer_steps_per_step=4, roles=("actor", "critic")
    )


def test_every_rank_generated_its_share_and_no_weights_crossed_the_object_store(ppo_chain, task):
    traffic = ppo_chain["traffic"]
    assert traffic.generating == ppo_chain["pids"]  # all 2 + 3 ranks returned generated rows
    # The largest payload of any call (a step's token batch, log-probs, scores) against the weights.
    assert 0 < traffic.largest < model_bytes(task.model_dir) / 4, traffic.largest


def test_checkpoints_are_consolidated_and_resharded_safely(ppo_chain):
    from transformers import AutoModelForCausalLM

    ckpt = ppo_chain["run_dir"] / "global_step_4"
    model = AutoModelForCausalLM.from_pretrained(ckpt / "actor")  # no merge step needed
    assert sum(p.numel() for p in model.parameters()) > 0
    # step 2 was saved by 2 ranks: a shard each and an index, no pickle anywhere
    assert ppo_chain["index"]["world_size"] == 2
    assert {p.name for p in (ppo_chain["run_dir"] / "global_step_2" / "optim" / "actor").iterdir()} == {
        "index.json", "rank0.safetensors", "rank1.safetensors",
    }  # fmt: skip
    assert not list(ppo_chain["run_dir"].rglob("*.distcp")) and not list(
        ppo_chain["run_dir"].rglob(".metadata")
    )


def test_killed_worker_stops_the_run_naming_it(ppo_chain):
    error = ppo_chain["error"]
    assert "died" in error and "pid" in error and "rank" in error, error
    assert ppo_chain["after_death"] == ["global_step_1", "global_step_2"]  # nothing of step 3 was saved


# ---------------------------------------------------------------------------------------------- LoRA
@pytest.fixture(scope="module")
def lora_runs(ray_session, overrides, tmp_path_factory):
    local = tmp_path_factory.mktemp("lora-local")
    train(None, common(overrides, local, *LORA), log=lambda _: None)
    chain = tmp_path_factory.mktemp("lora-chain")
    train(None, common(overrides, chain, *LORA, steps(1)), log=lambda _: None)
    train(None, common(overrides, chain, *LORA, *workers(2, "trainer.colocate=false")), log=lambda _: None)
    return local, chain


def test_lora_in_one_process_then_two_workers_matches_the_single_process_run(lora_runs, task):
    local, chain = lora_runs
    assert_same_steps(local, chain, (1, 2), task.model_dir, optimizer_steps_per_step=1)
    assert {"workers_actor.json"} <= {p.name for p in chain.glob("workers_*.json")}  # ref in the actor's pool
    assert (chain / "global_step_2" / "actor" / "adapter_model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------- tools
@pytest.fixture(scope="module")
def tool_runs(ray_session, tmp_path_factory):
    cache = tmp_path_factory.mktemp("multihop")

    def run(run_dir, *extra):
        return train(
            None,
            search_r1_overrides(
                cache,
                run_dir,
                "task.num_val=4",
                "trainer.num_rollout_samples=64",
                "trainer.save_freq=1",
                "trainer.num_threads=1",
                "trainer.val_before_train=false",
                "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
                "actor_rollout_ref.model.share_prompt_forward=false",
                f"trainer.worker_timeout_s={TIMEOUT_S}",
                *extra,
            ),
            preset="search_r1",
            log=lambda _: None,
        )

    local = tmp_path_factory.mktemp("tools-local")
    run(local)
    split = tmp_path_factory.mktemp("tools-split")
    run(
        split,
        *workers(2),
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
    )
    return local, split, cache


def test_multi_turn_tool_use_on_separate_rollout_workers_matches_the_single_process_run(tool_runs):
    local, split, cache = tool_runs
    model_dir = next(Path(cache).rglob("config.json")).parent
    assert_same_steps(local, split, (1, 2), model_dir, optimizer_steps_per_step=1)
    calls = [c for rec in read_records(split / "rollouts.jsonl.gz") for c in rec["tool_calls"]]
    assert calls  # the agent loop ran on the rollout worker, with its tools
    metrics = read_metrics(split / "metrics.jsonl")
    assert all(r["timing_s/update_weights"] > 0 for r in metrics)  # the policy was broadcast each step
    pools = {p.name for p in split.glob("workers_*.json")}
    assert pools == {"workers_actor+ref.json", "workers_rollout.json"}


# ---------------------------------------------------------------------------------------------- failures
def test_a_worker_exception_reaches_the_driver_with_its_traceback(ray_session, task, overrides):
    from tensordict import TensorDict

    from tearless.config import load_config
    from tearless.workers.ray_group import Pool
    from tearless.workers.spec import RankSpec

    cfg = load_config(None, common(overrides, "unused"))
    spec = RankSpec(
        cfg, roles=("ref",), rollout=False, model_path=str(task.model_dir), total_steps=1, device="cpu"
    )
    pool = Pool(spec, 1, name="ref", nodes=1, timeout_s=TIMEOUT_S)
    pool.call(Rank.setup, [(None,)], "setup")
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    td = TensorDict({k: torch.ones(1, 2, dtype=torch.long) for k in keys}, batch_size=[1])
    with pytest.raises(WorkerError) as info:
        pool.call(Rank.compute_log_prob, [("actor", td, 1)], "actor log-probs")  # this pool holds no actor
    message = str(info.value)
    assert "ref worker rank 0 (pid" in message and "actor log-probs" in message
    # the remote traceback: the failing line of the worker's code and the exception
    assert "rank.py" in message and "self.roles[role]" in message and "KeyError: 'actor'" in message
    assert "\x1b[" not in message
    assert pool.handles == []  # the pool was stopped


def test_a_worker_that_does_not_answer_in_time_is_named_and_stopped(ray_session, task, overrides):
    from tearless.config import load_config
    from tearless.workers.ray_group import Pool
    from tearless.workers.spec import RankSpec

    cfg = load_config(None, common(overrides, "unused"))
    spec = RankSpec(
        cfg, roles=("ref",), rollout=False, model_path=str(task.model_dir), total_steps=1, device="cpu"
    )
    # Starting a worker process takes seconds; a 50 ms limit on the first call cannot be met.
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"ref.*(no answer to start|no room).*0\.05"):
        Pool(spec, 1, name="ref", nodes=1, timeout_s=0.05)
    assert time.monotonic() - started < 10


# ------------------------------------------------------------------------------------------- user modules
def test_a_user_registered_loss_reaches_the_ray_ranks(ray_session, overrides, tmp_path):
    """The policy loss is looked up on the rank that updates (another process): it knows the user's
    ``user_vanilla`` only because it imported ``external_lib`` itself, and then it updates as vanilla."""
    user = (
        "actor_rollout_ref.model.external_lib=config.user_registry",
        "actor_rollout_ref.actor.policy_loss.loss_mode=user_vanilla",
    )
    runs = {}
    for name, extra in (("vanilla", ()), ("user", user)):
        # skip_zero_adv_rows knows only the built-in loss names: off in both runs
        no_skip = "actor_rollout_ref.actor.skip_zero_adv_rows=false"
        train(
            None,
            common(overrides, tmp_path / name, steps(1), *workers(1), no_skip, *extra),
            log=lambda _: None,
        )
        runs[name] = read_metrics(tmp_path / name / "metrics.jsonl")[-1]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
        assert runs["user"][key] == runs["vanilla"][key], key


def test_a_distillation_teacher_in_its_own_pool_matches_the_single_process_run(
    ray_session, overrides, task, tmp_path
):
    """The teacher is a role like the reference: with ``trainer.colocate=false`` it gets a pool of its
    own (2 ranks, FSDP2-sharded), and its log-probs of the same samples give the single process's
    signal. The teacher: the task's model with its weights perturbed, so the signal is not zero."""
    from transformers import AutoConfig

    from tearless.models.loading import load_causal_lm, load_tokenizer

    teacher = load_causal_lm(task.model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    teacher.save_pretrained(tmp_path / "teacher")
    load_tokenizer(task.model_dir).save_pretrained(tmp_path / "teacher")
    distill = (
        "algorithm.adv_estimator=on_policy_distill",
        f"actor_rollout_ref.teacher.model.path={tmp_path / 'teacher'}",
        steps(1),
    )
    runs = {}
    for name, extra in (("local", ()), ("ray", workers(2, "trainer.colocate=false"))):
        train(None, common(overrides, tmp_path / name, *distill, *extra), log=lambda _: None)
        runs[name] = read_metrics(tmp_path / name / "metrics.jsonl")[-1]
    local, ray = runs["local"], runs["ray"]
    assert local["critic/score/mean"] == ray["critic/score/mean"]  # the same samples (keyed sampling)
    assert local["distill/reverse_kl"] > 0.01  # a perturbed teacher disagrees
    # A token-mean of log-probs: each within logprob_tol of the other placement's (sharded sums in
    # another order), so the means and their difference within two of them.
    tol = 2 * logprob_tol(AutoConfig.from_pretrained(task.model_dir))
    for key in ("distill/reverse_kl", "distill/teacher_log_prob", "distill/student_log_prob"):
        assert abs(local[key] - ray[key]) <= tol, (key, local[key], ray[key], tol)
