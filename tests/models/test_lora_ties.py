"""LoRA on a weight tied to another (a tied LM head and embedding) is refused: the adapter would train
the head apart from the embedding, which a merged save or a rollout engine (one tensor for both) cannot
hold. An untied head takes LoRA, and its merged save computes the trained logits."""

from __future__ import annotations

import pytest
import torch

from tearless.models.loading import load_causal_lm
from tearless.models.lora import add_lora, load_lora
from tearless.models.weights import save_model
from tests.models.test_copies import tiny
from tests.tolerances import forward_terms, sum_tol
from tests.workers.test_lora import nonzero_adapters

RANK = 4
TIED = (
    "{where}: lm_head's weight is tied to model.embed_tokens.weight (one tensor). LoRA there would train "
    "lm_head apart from the weight it is tied to, which a merged save or a rollout engine (one tensor for "
    "both) cannot hold: they would serve another policy than the trained one. Drop lm_head from {targets}, "
    "or untie the weights first (a copy of the model saved with tie_word_embeddings=false, each weight its "
    "own)"
)


def untied(directory):
    """The tiny tied Llama saved untied, as docs/performance.md says to: its own copy of the head."""
    model = tiny()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(directory)
    return directory


def test_lora_on_a_tied_head_is_refused_with_the_key_the_tie_and_the_fix():
    where = "actor_rollout_ref.model.target_modules='q_proj,lm_head'"
    with pytest.raises(ValueError) as err:
        add_lora(tiny(), rank=RANK, alpha=8, target_modules="q_proj,lm_head")
    assert str(err.value) == TIED.format(where=where, targets="target_modules")
    # The embedding side of the same tie, found by storage like the head.
    with pytest.raises(ValueError) as err:
        add_lora(tiny(), rank=RANK, alpha=8, target_modules="embed_tokens", key="model")
    tie = "model.embed_tokens's weight is tied to lm_head.weight (one tensor)"
    assert str(err.value).startswith(f"model.target_modules='embed_tokens': {tie}")
    assert "Drop model.embed_tokens from target_modules" in str(err.value)
    assert add_lora(tiny(), rank=RANK, alpha=8, target_modules="all-linear")  # all-linear leaves the head out


def test_a_saved_adapter_on_a_tied_head_is_refused(tmp_path):
    import peft

    config = peft.LoraConfig(r=RANK, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    with pytest.warns(UserWarning, match="tie_word_embeddings"):  # peft only warns
        peft.get_peft_model(tiny(), config).save_pretrained(tmp_path / "adapter", save_embedding_layers=False)
    with pytest.raises(ValueError) as err:
        load_lora(tiny(), tmp_path / "adapter")
    where = f"the LoRA adapter in {tmp_path / 'adapter'}"
    assert str(err.value) == TIED.format(where=where, targets="the target_modules of a new adapter")


def test_ties_are_read_from_storage_on_a_meta_skeleton_too(tmp_path):
    # Every meta tensor has data address 0: comparing addresses would call the untied head tied too.
    tiny().save_pretrained(tmp_path / "tied")
    with pytest.raises(ValueError, match=r"lm_head's weight is tied to model\.embed_tokens\.weight"):
        add_lora(load_causal_lm(tmp_path / "tied", meta=True), rank=RANK, alpha=8, target_modules="lm_head")
    skeleton = load_causal_lm(untied(tmp_path / "untied"), meta=True)
    assert add_lora(skeleton, rank=RANK, alpha=8, target_modules="lm_head")


def test_an_untied_head_takes_lora_and_its_merged_save_computes_the_trained_logits(tmp_path):
    base = load_causal_lm(untied(tmp_path / "base"))
    ids = torch.randint(3, base.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = base(input_ids=ids).logits
    model = nonzero_adapters(add_lora(base, rank=RANK, alpha=8, target_modules="q_proj,lm_head"))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    save_model(model, tmp_path / "merged", write=True, merged=True)
    merged = load_causal_lm(tmp_path / "merged")
    assert not merged.config.tie_word_embeddings
    assert not torch.equal(merged.lm_head.weight, merged.model.embed_tokens.weight)
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    # The adapters move the logits by a fraction of their size (the bug this guards against, a head
    # without its ΔW, moved them by 0.48 of 0.73) ...
    assert want.abs().max() < 1 and (want - before).abs().max() > 0.05
    # ... and the merged weights give them back to float32 rounding: W + s·B·A rounded once against
    # W·x + s·B·(A·x), the forward's sums (forward_terms, plus the rank-4 branch of q_proj and the
    # head) of terms adding up to below 1 in size, as the logits are.
    tol = sum_tol(forward_terms(base.config) + 2 * RANK, 1.0, torch.float32)
    torch.testing.assert_close(got, want, atol=tol, rtol=0)


def test_a_reward_models_head_trains_whole_and_its_untied_embedding_takes_lora():
    from transformers import LlamaForSequenceClassification

    # A config that says tied, but the classifier has no LM head: its embedding is tied to nothing.
    config = tiny().config
    config.num_labels = 1
    model = LlamaForSequenceClassification(config)
    wrapped = add_lora(model, rank=RANK, alpha=8, target_modules="q_proj,embed_tokens", task_type="SEQ_CLS")
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert "base_model.model.score.modules_to_save.default.weight" in trainable
    assert any("embed_tokens.lora_embedding_A" in n for n in trainable)


def test_tearless_train_refuses_it_in_one_line(overrides, tmp_path, capsys):
    from tearless.cli import main

    lora = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.target_modules=q_proj,lm_head")
    assert main(["train", *overrides(tmp_path / "run", *lora)]) == 1
    where = "actor_rollout_ref.model.target_modules='q_proj,lm_head'"  # the task's tiny Llama is tied
    line = TIED.format(where=where, targets="target_modules")
    err = capsys.readouterr().err
    debug = "(set TEARLESS_DEBUG=1 for the traceback)"
    assert err.strip().splitlines()[-1] == f"tearless: error: ValueError: {line} {debug}"
    assert "Traceback" not in err


def test_a_missing_peft_or_a_package_peft_imports_is_named(monkeypatch, tmp_path):
    import sys

    from tearless.models.lora import _peft

    monkeypatch.setitem(sys.modules, "peft", None)  # not installed
    with pytest.raises(ImportError) as err:
        _peft("actor_rollout_ref.model.lora_rank")
    assert str(err.value) == (
        "actor_rollout_ref.model.lora_rank > 0 needs the peft package: pip install 'tearless[lora]' (or pip "
        "install peft), or set it to 0 for full fine-tuning"
    )
    # installed, but a package it imports is not (accelerate, on a machine given peft's wheel alone)
    (tmp_path / "peft").mkdir()
    (tmp_path / "peft" / "__init__.py").write_text("import accelerate_not_installed_here\n")
    monkeypatch.delitem(sys.modules, "peft")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as err:
        _peft("actor_rollout_ref.model.lora_rank")
    assert str(err.value) == (
        "actor_rollout_ref.model.lora_rank > 0 needs the peft package, which could not import "
        "accelerate_not_installed_here: pip install 'tearless[lora]' (or pip install peft "
        "accelerate_not_installed_here), or set it to 0 for full fine-tuning"
    )
