"""LoRA through peft: only adapters train, the reference is the base model with adapters off (no
second copy), the merged checkpoint equals the adapted model, and LoRA GRPO learns end to end.
Forwards and updates run through the trainer's in-process worker group (``local_workers``)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tearless.models.loading import load_causal_lm
from tearless.models.lora import add_lora, trainable_parameters
from tearless.models.weights import save_model
from tests.tolerances import kl_of_equal_policies, logprob_tol
from tests.workers.test_actor import build_batch


@pytest.fixture(scope="module")
def base_and_batch(task):
    return build_batch(task.model_dir)


def nonzero_adapters(model, seed=0):
    """``model`` with its LoRA B set to non-zero values (peft starts B at zero, which would make every
    comparison of the adapted policy with the base one trivially pass)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def lora_copy(base, rank=4, seed=0):
    """The base model with rank-``rank`` adapters on every linear layer, B non-zero."""
    model = add_lora(copy.deepcopy(base), rank=rank, alpha=2 * rank, target_modules="all-linear")
    return nonzero_adapters(model, seed)


def test_only_adapters_require_grad_and_every_linear_layer_has_one(base_and_batch):
    base, _ = base_and_batch
    model = lora_copy(base)
    trainable, total = trainable_parameters(model)
    # The tiny Llama: hidden 128, 2 layers, SwiGLU 384; 7 linear layers per block.
    # Rank 4 adds 4·(in + out) per layer: q,k,v,o 4·256 each, gate/up 4·(128+384), down 4·(384+128).
    per_block = 4 * 4 * 256 + 3 * 4 * (128 + 384)
    assert trainable == 2 * per_block
    assert total == sum(p.numel() for p in base.parameters()) + trainable
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)


LORA = "actor_rollout_ref.model.lora_rank=4"  # the reference is then the actor's model, adapters off


def log_probs(workers, role, td):
    return workers.compute_log_prob(role, td)[0]


def test_reference_log_probs_are_the_base_models_and_the_adapters_come_back_on(base_and_batch, local_workers):
    base, td = base_and_batch
    model = lora_copy(base)
    base_lp = log_probs(local_workers(models={"ref": base}), "ref", td)
    workers = local_workers(LORA, models={"actor": model}, roles=("actor", "ref"))
    on_before = log_probs(workers, "actor", td)
    ref_lp = log_probs(workers, "ref", td)
    on_after = log_probs(workers, "actor", td)
    mask = td["response_mask"].bool()
    # Disabled adapters skip the LoRA branch entirely: the same ops on the same weights (a deep copy)
    # in the same batch layout as the base model, so exactly the same log-probs.
    torch.testing.assert_close(ref_lp[mask], base_lp[mask], atol=0, rtol=0)
    # With the (non-zero) adapters on, the policy is a different one …
    assert (on_before[mask] - base_lp[mask]).abs().max() > 1e-2
    # … and disabling them for the reference pass leaves them on afterwards.
    assert on_after.equal(on_before)
    assert workers.rank.roles["ref"].model is model  # one set of weights


def test_an_update_changes_only_the_adapters(base_and_batch, local_workers):
    base, td = base_and_batch
    model = lora_copy(base)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    workers = local_workers(
        LORA,
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        models={"actor": model},
    )
    optimizer = workers.rank.roles["actor"].optimizer
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(
        v.numel() for v in adapters.values()
    )
    metrics = workers.update_policy(td)
    assert metrics["actor/grad_norm"] > 0
    for n, p in model.named_parameters():
        if n in frozen:
            assert p.equal(frozen[n]), n
    changed = [n for n, p in model.named_parameters() if n in adapters and not p.equal(adapters[n])]
    assert len(changed) == len(adapters)


def test_the_merged_model_loads_alone_and_equals_the_adapted_model(base_and_batch, local_workers, tmp_path):
    base, td = base_and_batch
    model = lora_copy(base)
    save_model(model, tmp_path / "merged", write=True, merged=True)
    merged = load_causal_lm(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    adapted = local_workers(LORA, models={"actor": model}, roles=("actor", "ref"))
    want = log_probs(adapted, "actor", td)
    got = log_probs(local_workers(models={"actor": merged}), "actor", td)
    mask = td["response_mask"].bool()
    # W + s·B·A rounded once into the merged weights, against W·x + s·B·(A·x): the same maths in
    # another order, so the log-probs agree to the forward's rounding (the rank-4 branch and the one
    # rounding of each merged weight add a handful of terms to sums of ~1,000).
    torch.testing.assert_close(got[mask], want[mask], atol=logprob_tol(base.config), rtol=0)
    # The live base weights were not touched by the merge.
    lp_base = log_probs(local_workers(models={"ref": base}), "ref", td)
    ref_lp = log_probs(adapted, "ref", td)
    torch.testing.assert_close(ref_lp[mask], lp_base[mask], atol=0, rtol=0)  # exact, as above


@pytest.mark.slow
def test_lora_grpo_learns_checkpoints_the_adapter_and_merged_model_and_resumes(task, overrides, tmp_path):
    from transformers import AutoConfig

    from tearless import train
    from tearless.run.tracking import read_metrics

    run_dir = tmp_path / "run"
    lora = [
        "actor_rollout_ref.model.lora_rank=16",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.lora_save_merged=true",
        "actor_rollout_ref.actor.optim.lr=2e-3",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "data.train_batch_size=32",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "trainer.save_freq=5",
        "trainer.num_threads=1",
    ]
    first = train(None, overrides(run_dir, *lora, "trainer.total_training_steps=5"), log=lambda _: None)
    actor_dir = run_dir / "global_step_5" / "actor"
    assert (actor_dir / "adapter_config.json").is_file()
    assert not (actor_dir / "model.safetensors").exists()  # the adapter only, not a full copy
    assert json.loads((actor_dir / "adapter_config.json").read_text())["r"] == 16
    assert (run_dir / "global_step_5" / "actor_merged" / "model.safetensors").is_file()
    resumed = train(None, overrides(run_dir, *lora, "trainer.total_training_steps=10"), log=lambda _: None)
    assert resumed["start_step"] == 5
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, 11))
    # The reference is the base model: the KL to it starts at 0 and grows as the adapters learn. 0 to
    # rounding: peft's B starts at 0, but the update's forward (adapters on, with gradient) and the
    # reference's (adapters off) are two forwards whose log-probs agree to logprob_tol.
    zero_kl = kl_of_equal_policies("low_var_kl", logprob_tol(AutoConfig.from_pretrained(task.model_dir)))
    assert abs(steps[0]["actor/kl_loss"]) <= zero_kl < steps[-1]["actor/kl_loss"]
    key = "val-core/arithmetic/acc/greedy"
    before, after = first["before"][key], resumed["after"][key]
    assert after >= before + 0.1, (before, after)
