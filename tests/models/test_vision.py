"""A vision-language policy's numbers: the engine's sampling log-probs are the training pass's, on
every route of the pass, and they depend on the image; unsupported architectures are refused."""

from __future__ import annotations

import pytest
import torch

from tearless.data import PromptDataset, load_rows
from tearless.models.loading import load_causal_lm, load_tokenizer
from tearless.models.logprobs import response_logprobs
from tearless.models.vision import (
    check_supported,
    freeze_vision_tower,
    load_processor,
    stack_pixels,
    vision_model_type,
    vision_tower,
)
from tearless.rollout.hf import HFRollout
from tests.tolerances import LOGIT_BOUND, forward_terms, log_softmax_tol, module_terms, sum_tol


@pytest.fixture(scope="module")
def policy(vlm_task):
    model = load_causal_lm(vlm_task.model_dir)
    tok = load_tokenizer(vlm_task.model_dir)
    data = PromptDataset(load_rows(vlm_task.val_file), tok, processor=load_processor(vlm_task.model_dir))
    return model, tok, [data[i] for i in range(len(data))]


def tolerance(model) -> float:
    """Two differently batched forwards of a vision-language ``model``: the logit is a sum along the
    vision tower (Idefics3's encoder and connector; Qwen2-VL's ``visual``, its merger included) and the
    language model (tests/tolerances.py), its log-prob off by twice that plus the log-softmax's."""
    inner = model.model
    tower = [inner.visual] if hasattr(inner, "visual") else [inner.vision_model, inner.connector]
    terms = forward_terms(model.config.text_config) + sum(map(module_terms, tower))
    return 2 * sum_tol(terms, LOGIT_BOUND) + log_softmax_tol(model.config.text_config.vocab_size)


def test_the_task_model_is_an_idefics3_loaded_with_its_processor(vlm_task, policy):
    model, _, items = policy
    assert vision_model_type(vlm_task.model_dir) == "idefics3"
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    assert set(items[0]["multi_modal_inputs"]) == {"pixel_values", "pixel_attention_mask"}


def sample_and_score(model, tok, items, *, n: int, max_new_tokens: int, share_prompts: bool):
    """The engine's samples of ``items`` (``n`` each, keyed) with their pixels, the training pass's
    log-probs of them, and the rows' stacked pixels."""
    engine = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    vision = [it["multi_modal_inputs"] for it in items]
    out = engine.generate(
        [it["input_ids"] for it in items],
        n=n,
        max_new_tokens=max_new_tokens,
        keys=list(range(len(items))),
        vision=vision,
    )
    pixels = stack_pixels([v for v in vision for _ in range(n)])
    with torch.no_grad():
        lp, _ = response_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask,
            share_prompts=share_prompts, vision=pixels,
        )  # fmt: skip
    return out, lp, pixels


@pytest.mark.parametrize("share_prompts", [True, False])
def test_sampling_log_probs_equal_the_padded_training_pass(policy, share_prompts):
    model, tok, items = policy
    out, lp, pixels = sample_and_score(
        model, tok, items[:6], n=4, max_new_tokens=4, share_prompts=share_prompts
    )
    mask = out.response_mask.bool()
    assert mask.sum() >= 24
    assert (lp - out.log_probs)[mask].abs().max() <= tolerance(model)
    # The image is read: the same tokens given the other images of the batch are other numbers. The
    # 5-step model reads them faintly (6.9e-3 measured), still 10^4 times the two routes' difference
    # (4.8e-7 measured) and far from any rounding.
    with torch.no_grad():
        other, _ = response_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask,
            share_prompts=share_prompts, vision={k: v.roll(4, 0) for k, v in pixels.items()},
        )  # fmt: skip
    assert (other - lp)[mask].abs().max() > 1e-3


def test_same_text_other_image_is_another_prompt_on_the_shared_pass(policy):
    """Prompts with one text ("How many red?") and two images share their token ids; the shared-prompt
    pass and its duplicate removal must still forward them apart, and the plain pass must agree with
    them when a response holds image tokens."""
    model, tok, items = policy
    text = items[0]["input_ids"]
    twin = next(it for it in items[1:] if it["input_ids"] == text)
    rows = [items[0], items[0], twin, twin]
    p_ids = torch.tensor([text] * 4)
    p_mask = torch.ones_like(p_ids)
    # A response may sample the image token itself: it stays a token (no image features go there).
    image = tok.convert_tokens_to_ids("<image>")
    r_ids = torch.tensor([[*tok.encode(s), image, image] for s in ("3", "4", "3", "4")])
    r_mask = torch.ones_like(r_ids)
    pixels = stack_pixels([it["multi_modal_inputs"] for it in rows])
    with torch.no_grad():
        fast, _ = response_logprobs(model, p_ids, p_mask, r_ids, r_mask, vision=pixels)
        plain, _ = response_logprobs(model, p_ids, p_mask, r_ids, r_mask, vision=pixels, share_prompts=False)
    assert (fast - plain).abs().max() <= tolerance(model)
    assert (plain[:2] - plain[2:]).abs().max() > 1e-4  # two images, two answers' numbers


def test_freezing_the_vision_tower_leaves_the_rest_trainable(vlm_task):
    model = load_causal_lm(vlm_task.model_dir)
    frozen = freeze_vision_tower(model)
    tower = vision_tower(model)
    assert frozen == sum(p.numel() for p in tower.parameters()) > 0
    assert not any(p.requires_grad for p in tower.parameters())
    assert all(p.requires_grad for p in model.model.connector.parameters())
    assert all(p.requires_grad for p in model.model.text_model.parameters())


def test_unsupported_architectures_are_refused_with_the_reason():
    with pytest.raises(ValueError) as e:
        check_supported("llava", "actor_rollout_ref.model.path")
    assert str(e.value).startswith(
        "actor_rollout_ref.model.path: the vision-language model type 'llava' is not supported: tearless "
        "has not checked its image-token layout and positions"
    )
    for kind in ("smolvlm", "idefics3", "qwen2_vl", "qwen2_5_vl"):
        check_supported(kind)


def test_a_smolvlm_takes_the_same_route(tmp_path):
    """SmolVLM (Idefics3's layout under its own classes): loaded, frozen, sampled and scored alike."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    from tearless.tasks import vlm_count

    tok = vlm_count.task_tokenizer()
    processor = vlm_count.task_processor(tok)
    idefics = vlm_count.task_model(tok, num_layers=2, seed=0).config
    config = SmolVLMConfig(
        vision_config=idefics.vision_config.to_dict(),
        text_config=idefics.text_config.to_dict(),
        scale_factor=vlm_count.SCALE,
        image_token_id=idefics.image_token_id,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    SmolVLMForConditionalGeneration(config).save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    assert vision_model_type(tmp_path) == "smolvlm"
    model = load_causal_lm(tmp_path)
    assert type(model).__name__ == "SmolVLMForConditionalGeneration" and freeze_vision_tower(model) > 0
    rows, _ = vlm_count.generate_rows(4, seed=3, split="test")
    data = PromptDataset(rows, load_tokenizer(tmp_path), processor=load_processor(tmp_path))
    items = [data[i] for i in range(4)]
    engine = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    vision = [it["multi_modal_inputs"] for it in items]
    out = engine.generate(
        [it["input_ids"] for it in items], n=2, max_new_tokens=4, keys=[1, 2, 3, 4], vision=vision
    )
    pixels = stack_pixels([v for v in vision for _ in range(2)])
    with torch.no_grad():
        lp, _ = response_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask, vision=pixels
        )
    assert (lp - out.log_probs)[out.response_mask.bool()].abs().max() <= tolerance(model)
