"""The diffusers SD3 adapter on a tiny randomly initialised SD3 transformer and scheduler (offline).

Not covered here: the text encoders of a real pipeline (prompts are random embeddings) and any
pretrained weights.
"""

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tearless.config import load_config  # noqa: E402
from tearless.flow.config import FlowConfig  # noqa: E402
from tearless.flow.models import load_sd3, scheduler_sigmas  # noqa: E402
from tearless.flow.sampler import sample_sde, step_log_prob, step_params  # noqa: E402
from tearless.flow.trainer import FlowGRPOTrainer  # noqa: E402

TEXT_DIM, POOLED_DIM = 16, 8


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("tiny-sd3")
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        caption_projection_dim=16,
        pooled_projection_dim=POOLED_DIM,
        pos_embed_max_size=8,
    )
    transformer.save_pretrained(root / "transformer")
    diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(root / "scheduler")
    return root


def embeds(n, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "prompt_embeds": torch.randn(n, 5, TEXT_DIM, generator=g),
        "pooled_prompt_embeds": torch.randn(n, POOLED_DIM, generator=g),
    }


def test_ode_step_matches_the_diffusers_scheduler(pipeline_dir):
    model, scheduler = load_sd3(pipeline_dir)
    sigmas = scheduler_sigmas(scheduler, 4)
    assert len(sigmas) == 5 and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    x, cond = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1)), embeds(2, 2)
    with torch.no_grad():
        for i, timestep in enumerate(scheduler.timesteps):
            v = model(x, torch.full((2,), float(sigmas[i])), cond)
            ours = x + (sigmas[i + 1] - sigmas[i]) * v
            theirs = scheduler.step(v, timestep, x, return_dict=False)[0]
            assert torch.allclose(ours, theirs, atol=1e-6)
            x = theirs


def test_sde_log_probs_recompute_exactly_with_cfg(pipeline_dir):
    model, scheduler = load_sd3(pipeline_dir)
    sigmas = scheduler_sigmas(scheduler, 3)
    cond, uncond = embeds(2, 3), {k: torch.zeros_like(v) for k, v in embeds(2, 3).items()}
    g = torch.Generator().manual_seed(4)
    kwargs = {"guidance_scale": 4.5, "uncond": uncond}
    traj = sample_sde(model, cond, torch.randn(2, 4, 8, 8, generator=g), sigmas, generator=g, **kwargs)
    for j in range(3):
        p = step_params(sigmas, j, 0.7)
        with torch.no_grad():
            lp, _ = step_log_prob(model, traj.latents[:, j], traj.latents[:, j + 1], cond, p, **kwargs)
        assert torch.equal(lp, traj.log_probs[:, j])


class EmbeddingTask:
    """Two prompts given as fixed embeddings; reward = mean latent value (brighter is better)."""

    name = "sd3-toy"
    num_prompts = 2
    sample_shape = (4, 8, 8)

    def __init__(self):
        self.table = embeds(2, 5)

    def cond(self, ids):
        return {k: v[ids] for k, v in self.table.items()}

    def uncond(self, ids):
        return {k: torch.zeros_like(v[ids]) for k, v in self.table.items()}

    def reward(self, samples, ids):
        return samples.flatten(1).mean(-1)

    def metrics(self, samples, ids):
        return {"reward": float(self.reward(samples, ids).mean())}


def test_flow_grpo_epoch_with_lora_on_the_sd3_transformer(pipeline_dir, tmp_path):
    model, scheduler = load_sd3(pipeline_dir)
    cfg = load_config(
        None,
        [
            "sample.num_steps=3",
            "train.prompts_per_epoch=2",
            "train.group_size=2",
            "train.updates_per_epoch=1",
            "sample.guidance_scale=2.0",
            f"trainer.default_local_dir={tmp_path}",
        ],
        schema=FlowConfig,
    )
    trainer = FlowGRPOTrainer(cfg, EmbeddingTask(), model, train_sigmas=scheduler_sigmas(scheduler, 3))
    lora_names = [n for n, p in trainer.policy.named_parameters() if p.requires_grad]
    assert lora_names and all("lora_" in n for n in lora_names)
    assert any("add_q_proj" in n for n in lora_names)
    before = [p.detach().clone() for p in trainer.params]
    metrics = trainer.epoch(0)
    assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/kl_loss"] == 0.0
    assert metrics["batch/kept_fraction"] == 1.0
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.params, strict=True))


def test_noise_aware_normaliser_is_tempflows_constant_on_the_sd3_schedule():
    # TempFlow-GRPO multiplies each step's loss by 2.25·σ_t√h: 2.25 = 1/mean(σ_t√h) over the 9 trained
    # steps of the 10-step, shift-3, a = 0.7 SD3 schedule. tearless derives it from the schedule.
    sigmas = scheduler_sigmas(diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), 10)
    stds = [step_params(sigmas, j, 0.7).std for j in range(9)]
    assert 9 / sum(stds) == pytest.approx(2.25, abs=0.005)
