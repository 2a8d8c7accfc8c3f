"""Defaults per device (tearless.devices): the CPU's are the schema's (the default run unchanged), CUDA's
take one packed forward per token-budgeted micro-batch and skip the metric-only entropy pass, and a key
the user set is never touched."""

from __future__ import annotations

from tearless.config import Config, load_config
from tearless.devices import bucket_overhead_tokens, device_defaults
from tearless.models.logprobs import length_buckets

ARR = "actor_rollout_ref"


def test_cpu_defaults_are_the_schemas_and_print_nothing():
    notes: list[str] = []
    assert load_config(None, [], device="cpu", notify=notes.append) == load_config(
        None, [], notify=notes.append
    )
    cfg, schema = load_config(None, [], device="cpu"), Config()
    assert cfg.actor_rollout_ref == schema.actor_rollout_ref and cfg.critic == schema.critic
    assert notes == []
    d = device_defaults("cpu")
    assert (d.remove_padding, d.dynamic_bsz, d.calculate_entropy) == (False, False, True)
    assert device_defaults("mps") == d  # any other device type takes the CPU's
    # Logits past one chunk are chunked by default on CUDA only (a CPU run keeps its numbers).
    assert not d.chunk_logits and device_defaults("cuda").chunk_logits


def test_cuda_defaults_apply_to_unset_keys_with_one_note():
    notes: list[str] = []
    cfg = load_config(None, [], device="cuda", notify=notes.append)
    actor = cfg.actor_rollout_ref.actor
    assert cfg.actor_rollout_ref.model.use_remove_padding and actor.use_dynamic_bsz
    assert not actor.calculate_entropy
    assert actor.ppo_max_token_len_per_gpu == 16384  # veRL's budget: it holds a default sequence
    assert len(notes) == 1 and notes[0].startswith("training on cuda: its defaults apply:")
    assert f"{ARR}.model.use_remove_padding=True (was False)" in notes[0]


def test_cuda_defaults_leave_what_the_user_set():
    cfg = load_config(
        None,
        [f"{ARR}.model.use_remove_padding=false", f"{ARR}.actor.calculate_entropy=true"],
        device="cuda",
        notify=lambda _: None,
    )
    assert (
        not cfg.actor_rollout_ref.model.use_remove_padding and cfg.actor_rollout_ref.actor.calculate_entropy
    )
    # Micro-batches sized by count: no token budget on top of them.
    cfg = load_config(
        None, [f"{ARR}.actor.ppo_micro_batch_size_per_gpu=4"], device="cuda", notify=lambda _: None
    )
    assert not cfg.actor_rollout_ref.actor.use_dynamic_bsz
    # A sequence longer than veRL's budget: the budget the user did not set grows to hold one
    # (16,000 + 1,024 = 17,024 tokens), so the default passes validation.
    long = ["data.max_prompt_length=16000", "data.max_response_length=1024"]
    cfg = load_config(None, long, device="cuda", notify=lambda _: None)
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 17024
    # A budget the user set is theirs: too small is refused by validation, naming it.
    import pytest

    from tearless.config import ConfigError

    with pytest.raises(ConfigError, match="ppo_max_token_len_per_gpu"):
        load_config(
            None, [*long, f"{ARR}.actor.ppo_max_token_len_per_gpu=16384"], device="cuda", notify=print
        )


def test_the_bucket_overhead_per_device_decides_the_buckets():
    # 63 answers of 40 tokens and one of 64. One bucket: 64 rows x 64 + overhead; two: 63 x 40 + 64 +
    # 2 x overhead. CPU (64): 4,160 against 2,712, two buckets. CUDA (10,000): 14,096 against 22,584, one.
    lengths = [40] * 63 + [64]
    assert len(length_buckets(lengths, bucket_overhead_tokens("cpu"))) == 2
    assert length_buckets(lengths, bucket_overhead_tokens("cuda")) == [list(range(64))]
