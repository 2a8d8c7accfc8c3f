"""The diffusers SD3 adapter on a tiny randomly initialised SD3 pipeline built from configs, offline.

The pipeline has all its parts (transformer, scheduler, VAE, two CLIP text encoders with a char-level
CLIP tokenizer) except T5, which SD3 allows to be absent (its embeddings are then zeros). Not covered:
pretrained weights, T5, a GPU.
"""

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tearless.config import load_config  # noqa: E402
from tearless.flow.config import FlowConfig  # noqa: E402
from tearless.flow.sampler import sample_ode, sample_sde, step_log_prob, step_params  # noqa: E402
from tearless.flow.sd3 import SD3PromptTask, load_sd3, load_sd3_pipeline, scheduler_sigmas  # noqa: E402
from tearless.flow.trainer import FlowGRPOTrainer  # noqa: E402
from tests.tolerances import module_terms, sum_tol  # noqa: E402

TEXT_DIM, POOLED_DIM = 16, 8


def char_tokenizer(root):
    """A CLIP tokenizer whose vocabulary is every byte-level character (no merges): char-level BPE."""
    import json

    from transformers import CLIPTokenizer

    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(256 - len(printable))]
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in chars:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(root / "vocab.json"), str(root / "merges.txt"), model_max_length=16)


def clip_encoder(vocab_size, seed):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=4,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return CLIPTextModelWithProjection(config)


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("tiny-sd3")
    tokenizer = char_tokenizer(root)
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
    vae = diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
        scaling_factor=1.5,
        shift_factor=0.1,
    )
    pipeline = diffusers.StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=clip_encoder(len(tokenizer), 1),
        tokenizer=tokenizer,
        text_encoder_2=clip_encoder(len(tokenizer), 2),
        tokenizer_2=tokenizer,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipeline.save_pretrained(root / "pipeline")
    return root / "pipeline"


@pytest.fixture(scope="module")
def pipeline(pipeline_dir):
    return load_sd3_pipeline(pipeline_dir, text_encoder_3=None, tokenizer_3=None)


def redness(images, prompts):
    """Reward on decoded images: how much red beats the other channels."""
    return images[:, 0].mean((1, 2)) - images[:, 1:].mean((1, 2, 3))


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
            # The same Euler step, the step size possibly rounded from another precision: three
            # roundings of values up to |x| + |dt·v|.
            step = float((sigmas[i + 1] - sigmas[i]) * v.abs().max())
            atol = sum_tol(3, float(x.abs().max()) + abs(step))
            torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)
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


def test_our_ode_sampler_reproduces_the_pipelines_own_sampling(pipeline, pipeline_dir):
    prompts = ["a red square", "blue"]
    task = SD3PromptTask(pipeline, prompts, redness, height=16, width=16, max_sequence_length=16)
    assert task.sample_shape == (4, 8, 8)
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    theirs = pipeline(
        prompt=prompts,
        num_inference_steps=4,
        guidance_scale=1.0,
        latents=noise.clone(),
        output_type="latent",
        max_sequence_length=16,
        height=16,
        width=16,
    ).images
    model = load_sd3(pipeline_dir)[0]
    ours = sample_ode(model, task.cond(torch.arange(2)), noise, scheduler_sigmas(pipeline.scheduler, 4))
    # Our forwards against the pipeline's (its own timestep conversion and batching): 4 steps, each
    # a forward (module_terms bounds its chain of sums) whose velocity is about the latents' size,
    # with step sizes adding up to 1 (safety 2: the velocity's error plus the latents' own).
    atol = sum_tol(4 * module_terms(model), float(theirs.abs().max()), safety=2)
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)


def test_flow_grpo_on_the_pipeline_with_lora_and_an_image_reward(pipeline, pipeline_dir, tmp_path):
    from PIL import Image

    task = SD3PromptTask(
        pipeline, ["a red square", "a green circle"], redness, height=16, width=16, max_sequence_length=16
    )
    model, scheduler = load_sd3(pipeline_dir)
    cfg = load_config(
        None,
        [
            "sample.num_steps=3",
            "sample.eval_num_steps=3",
            "sample.eval_samples_per_prompt=2",
            "train.prompts_per_epoch=2",
            "train.group_size=4",
            "train.updates_per_epoch=1",
            "train.epochs=2",
            "sample.guidance_scale=2.0",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={tmp_path}",
        ],
        schema=FlowConfig,
    )
    trainer = FlowGRPOTrainer(
        cfg,
        task,
        model,
        train_sigmas=scheduler_sigmas(scheduler, 3),
        eval_sigmas=scheduler_sigmas(scheduler, 3),
    )
    lora_names = [n for n, p in trainer.policy.named_parameters() if p.requires_grad]
    assert lora_names and all("lora_" in n for n in lora_names)
    assert any("add_q_proj" in n for n in lora_names)
    before = [p.detach().clone() for p in trainer.params]
    summary = trainer.fit()
    assert summary["after"]["reward"] != summary["before"]["reward"]
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.params, strict=True))
    # The checkpoint is a diffusers transformer directory with the LoRA merged in.
    merged = diffusers.SD3Transformer2DModel.from_pretrained(tmp_path / "global_step_2" / "actor")
    x, t, cond = torch.randn(2, 4, 2, 2), torch.full((2,), 0.5), task.cond(torch.arange(2))
    with torch.no_grad():
        want = trainer.policy(x, t, cond)
        # W + s·B·A rounded once into the merged weights, against W·x + s·B·(A·x): the forward's sums
        # in another order (safety 2 for the merge's extra rounding and the rank-r branch).
        atol = sum_tol(module_terms(trainer.policy), float(want.abs().max()), safety=2)
        torch.testing.assert_close(type(model)(merged)(x, t, cond), want, atol=atol, rtol=0)
    # Before/after grid of decoded RGB images: 2 prompts × (before, after) rows of 2.
    assert Image.open(summary["grid"]).size == ((2 * 17 - 1) * 4, (4 * 17 - 1) * 4)


def test_noise_aware_normaliser_is_tempflows_constant_on_the_sd3_schedule():
    # TempFlow-GRPO multiplies each step's loss by 2.25·σ_t√h: 2.25 = 1/mean(σ_t√h) over the 9 trained
    # steps of the 10-step, shift-3, a = 0.7 SD3 schedule. tearless derives it from the schedule.
    sigmas = scheduler_sigmas(diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), 10)
    stds = [step_params(sigmas, j, 0.7).std for j in range(9)]
    assert 9 / sum(stds) == pytest.approx(2.25, abs=0.005)
