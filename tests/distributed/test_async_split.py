"""The asynchronous loop on separate rollout workers (Ray, CPU) samples exactly what the same
schedule samples in one process: the split placement only adds overlap, not another algorithm."""

from __future__ import annotations

import pytest

from tearless import train
from tearless.trainers.tracking import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_one_step_off_on_a_rollout_worker_matches_one_process(ray_session, overrides, tmp_path):
    common = (
        "async_training.enable=true",
        "async_training.max_staleness=1",
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.total_training_steps=3",
        "trainer.val_before_train=false",
        "data.val_max_samples=4",
        "trainer.num_threads=1",
        "trainer.worker_timeout_s=120",
    )
    train(None, overrides(tmp_path / "local", *common), log=lambda _: None)
    split = (
        "trainer.placement=ray",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
    )
    train(None, overrides(tmp_path / "split", *common, *split), log=lambda _: None)
    local, ray_run = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("local", "split"))
    assert [r["async/staleness_max"] for r in ray_run] == [0, 1, 1]
    for a, b in zip(local, ray_run, strict=True):
        # The rollout worker samples with a broadcast copy of the version-(s−2) weights, the single
        # process with those very weights: the same responses, hence the same scores.
        assert a["critic/score/mean"] == b["critic/score/mean"]
        assert a["response_length/mean"] == b["response_length/mean"]
        assert b["timing_s/update_weights"] > 0 and "timing_s/train_idle" in b
        assert a["rollout_corr/is_weight_mean"] == pytest.approx(b["rollout_corr/is_weight_mean"], abs=1e-5)
