import json

import pytest
import torch

from tearless.config import ConfigError, load_config
from tearless.flow.config import FlowConfig
from tearless.flow.models import load_flow_model
from tearless.flow.pretrain import pretrain
from tearless.flow.sampler import gaussian_log_prob
from tearless.flow.tasks import Points2D
from tearless.flow.trainer import FlowGRPOTrainer, clipped_step_loss, flow_advantages
from tests.tolerances import module_terms, sum_tol


def test_flow_advantages_hand_worked():
    # Prompt 0: rewards (1, 0, 0, 0), mean 0.25; prompt 1: (0.5 × 4), mean 0.5 → exactly 0.
    # Batch std of the 8 rewards, mean 0.375, population (÷ 8, Flow-GRPO's numpy std):
    # sqrt((0.390625 + 3·0.140625 + 4·0.015625)/8) = sqrt(0.875/8) = 0.330719.
    rewards = torch.tensor([1.0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5])
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    std = (0.875 / 8) ** 0.5
    adv = flow_advantages(rewards, ids, std_scope="batch", epsilon=1e-4, clip_max=5.0)
    expected = [0.75 / (std + 1e-4)] + [-0.25 / (std + 1e-4)] * 3 + [0.0] * 4
    assert adv.tolist() == pytest.approx(expected)
    # Per-prompt population std of (1, 0, 0, 0) is sqrt(0.75/4) = 0.433013 (0.5 unbiased):
    # 0.75/0.433 = 1.732, clipped at 1.2; −0.25/0.433 = −0.577350.
    adv = flow_advantages(rewards, ids, std_scope="group", epsilon=1e-9, clip_max=1.2)
    assert adv.tolist() == pytest.approx([1.2, *[-0.25 / 0.1875**0.5] * 3, 0, 0, 0, 0])
    # Statistics that must hold: zero mean within each group, std one across the batch scale.
    g = torch.Generator().manual_seed(0)
    r = torch.rand(64, generator=g)
    ids = torch.arange(4).repeat_interleave(16)
    adv = flow_advantages(r, ids, std_scope="batch", epsilon=0.0, clip_max=100.0)
    # Group means (sums of 16 rewards in [0, 1]) and the batch std (a sum of 64) computed here and
    # in flow_advantages in other orders, and a division undone by a multiplication.
    tol = sum_tol(16 + 64, 1.0, safety=2)
    std = r.std(correction=0)
    assert adv.view(4, 16).mean(-1).abs().max() < tol / float(std)  # the same, in units of std
    torch.testing.assert_close(adv * std, r - r.view(4, 16).mean(-1).repeat_interleave(16), atol=tol, rtol=0)


def test_clip_masks_the_gradient_of_samples_past_the_range():
    # Four samples whose per-step ratio moved to e^{±0.05} (outside 1 ± 0.01). The clipped branch wins
    # (zero gradient) where the move already went the way the advantage wants; elsewhere it does not.
    next_x = torch.zeros(4, 3)
    old_mean = torch.full((4, 3), 0.3)
    old = gaussian_log_prob(next_x, old_mean, 0.5)
    # log-prob (mean over elements) of a mean μ: −μ²/(2·0.25) + const; pick μ for Δlogπ = ±0.05.
    up = (0.09 - 0.025) ** 0.5  # −μ²/0.5 = −0.18 + 0.05  → ratio e^{+0.05}
    down = (0.09 + 0.025) ** 0.5  # ratio e^{−0.05}
    mean = torch.tensor([[up] * 3, [up] * 3, [down] * 3, [down] * 3], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    log_prob = gaussian_log_prob(next_x, mean, 0.5)
    assert (log_prob - old).tolist() == pytest.approx([0.05, 0.05, -0.05, -0.05], abs=1e-5)
    loss, metrics = clipped_step_loss(log_prob, old, adv, clip_range=0.01)
    loss.backward()
    grad_rows = mean.grad.abs().sum(-1)
    assert grad_rows[0] == 0 and grad_rows[3] == 0  # A>0 & ratio>1+ε, A<0 & ratio<1−ε: clipped
    assert grad_rows[1] > 0 and grad_rows[2] > 0  # moved against the advantage: still pushed back
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)


def small_cfg(tmp_path, *overrides):
    return load_config(
        None,
        [
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.logger=[jsonl]",
            "sample.eval_samples_per_prompt=64",
            *overrides,
        ],
        schema=FlowConfig,
    )


@pytest.fixture(scope="module")
def base_points():
    torch.manual_seed(0)
    task = Points2D()
    model = task.build_model()
    pretrain(task, model, steps=1500, batch_size=256, lr=2e-3, seed=0)
    return task, model.state_dict()


def fresh_model(base_points):
    task, state = base_points
    model = task.build_model()
    model.load_state_dict(state)
    return task, model


def test_first_update_is_on_policy_and_the_reference_starts_equal(tmp_path, base_points):
    task, model = fresh_model(base_points)
    cfg = small_cfg(tmp_path, "train.epochs=1", "train.updates_per_epoch=1")
    trainer = FlowGRPOTrainer(cfg, task, model)
    metrics = trainer.epoch(0)
    # One update on freshly sampled data with LoRA's B = 0: ratio 1 (up to the row order of the
    # mini-batch, which the update shuffles), policy = reference. The recomputed rows are the same
    # dot products as the sampler's, at other positions of the batch: a GEMM sums each row in the
    # same order whatever its position (0.0 measured with 1 and 2 threads and AVX-512, AVX2 and
    # SSE4.2 kernels); 1e-7 leaves a few ulps of the log-ratios for a kernel that treats a tail block
    # of rows differently.
    assert abs(metrics["actor/ppo_kl"]) < 1e-7
    assert metrics["actor/pg_clipfrac"] == 0.0
    # Exactly: the policy (B = 0 adds exact zeros) and the reference (adapters off) forward the same
    # rows in the same order, so the same means; their KL is exactly 0.
    assert metrics["actor/kl_loss"] == 0.0
    assert metrics["actor/grad_norm"] > 0
    # After the update the KL to the reference (adapters off) is positive.
    prompt_ids = trainer._prompts(1)
    traj = trainer.rollout(prompt_ids, torch.Generator().manual_seed(0))
    adv = torch.ones(len(prompt_ids))
    out = trainer.update(traj, prompt_ids, adv, torch.arange(len(prompt_ids)))
    assert out["actor/kl_loss"] > 0


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        (
            "train.lora=false",
            "train.kl_variant=official",
            "train.ema=true",
            "train.ema_every=1",
            "train.noise_aware_weighting=true",
        ),
    ],
)
def test_variants_run_and_drop_zero_advantage_samples(tmp_path, base_points, overrides):
    task, model = fresh_model(base_points)
    cfg = small_cfg(tmp_path, "train.epochs=2", *overrides)
    trainer = FlowGRPOTrainer(cfg, task, model, reward_fn=lambda x, ids: (ids == 0).float() * (x[:, 0] > 0))
    metrics = trainer.epoch(0)  # prompts 0-3: only prompt 0 can score, so 3 of 4 groups are all zero
    assert metrics["reward/zero_std_ratio"] == 0.75
    assert metrics["batch/kept_fraction"] == 0.25
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


@pytest.mark.slow
def test_flow_grpo_raises_the_2d_reward_and_saves_a_loadable_checkpoint(tmp_path, base_points):
    task, model = fresh_model(base_points)
    cfg = small_cfg(tmp_path, "train.epochs=60", "trainer.test_freq=30")
    trainer = FlowGRPOTrainer(cfg, task, model)
    summary = trainer.fit()
    before, after = summary["before"], summary["after"]
    assert before["reward"] < 0.35
    assert after["reward"] > before["reward"] + 0.3
    assert after["on_mode"] > 0.9
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(61))
    assert "val/reward" in records[30] and "reward/mean" in records[1]
    saved, info = load_flow_model(tmp_path / "run" / "global_step_60" / "actor")
    assert info["task"] == "points2d" and (tmp_path / "run" / "global_step_60" / "COMPLETE").is_file()
    # The checkpoint holds the trained policy with LoRA merged in: same velocity, unlike the base.
    x, t, c = torch.randn(5, 2), torch.rand(5), torch.arange(5) % 4
    with torch.no_grad():
        want = trainer.policy(x, t, c)
        # Merged weights against the LoRA branch: the forward's sums in another order (safety 2 for
        # the merge's extra rounding and the rank-r branch).
        atol = sum_tol(module_terms(trainer.policy), float(want.abs().max()), safety=2)
        torch.testing.assert_close(saved(x, t, c), want, atol=atol, rtol=0)
        assert not torch.allclose(saved(x, t, c), fresh_model(base_points)[1](x, t, c), atol=1e-3)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("task.name=mnist", "task.name"),
        ("train.group_size=1", "train.group_size"),
        ("train.updates_per_epoch=3", "does not divide the 64 rollouts"),
        ("train.timestep_fraction=0.05", "train.timestep_fraction"),
        ("train.timesteps=[0,10]", "train.timesteps"),
        # one index, not a list: was a TypeError out of list(2)
        (
            "train.timesteps=2",
            "train.timesteps: 2 is not a list of step indices. Write a list, e.g. train.timesteps=[2]",
        ),
        ("train.timesteps=[true]", "train.timesteps"),
        ("train.std_scope=global", "train.std_scope"),
        ("train.kl_variant=paper", "train.kl_variant"),
        ("sample.log_prob_reduce=max", "sample.log_prob_reduce"),
        ("train.clip_rnage=0.1", "Did you mean train.clip_range"),
    ],
)
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(None, [override], schema=FlowConfig)


def test_trained_steps_and_shift():
    cfg = load_config(None, [], schema=FlowConfig)
    assert cfg.trained_steps() == list(range(9)) and cfg.shift() == 1.0
    cfg = load_config(None, ["train.timesteps=[3,1]", "task.name=shapes"], schema=FlowConfig)
    assert cfg.trained_steps() == [1, 3] and cfg.shift() == 3.0
    assert cfg.pretrain_settings()["steps"] == 3000


def test_ema_hand_worked_and_swapped_back():
    from tearless.flow.trainer import EMA

    p = torch.nn.Parameter(torch.zeros(2))
    ema = EMA([p], decay=0.9)
    with torch.no_grad():
        p.fill_(1.0)
    ema.update()  # 0.9·0 + 0.1·1
    ema.update()  # 0.9·0.1 + 0.1·1 = 0.19
    with ema.swapped():
        assert p.tolist() == pytest.approx([0.19, 0.19])
    assert p.tolist() == [1.0, 1.0]


def test_a_reward_of_the_wrong_shape_is_refused(tmp_path, base_points):
    task, model = fresh_model(base_points)
    trainer = FlowGRPOTrainer(small_cfg(tmp_path), task, model, reward_fn=lambda x, ids: x[:, :1])
    with pytest.raises(ValueError, match=r"returned shape \(64, 1\), expected \(64,\)"):
        trainer.epoch(0)
