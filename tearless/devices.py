"""Defaults that depend on the device a run trains on, in one table (:data:`DEVICE_DEFAULTS`).

A CPU and a GPU want different shapes of work from the same update. On a CPU each token costs time in
every linear layer and a forward's fixed cost is small, so the padded forwards with shared prompts
and length buckets (the embedded run's path, tuned there) do least work. On a GPU a forward's fixed
cost (kernel launches, one attention plan per new shape) is worth thousands of tokens, so one packed
forward per micro-batch under a token budget wins, and a pass over a 151,936-token vocabulary for a
metric is worth skipping. The config keys these facts set (``use_remove_padding``, ``use_dynamic_bsz``,
``calculate_entropy``) take them where the user left the key unset
(:func:`tearless.config.load.load_config`); the bucket cost and whether logits past one chunk are
chunked (``entropy_from_logits_with_chunking=null``) are read by the log-prob pass itself, from the
device its logits are on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceDefaults:
    """What one device type wants by default.

    ``remove_padding``: one packed (varlen) forward per micro-batch (``model.use_remove_padding``).
    ``dynamic_bsz``: micro-batches cut by a token budget (``actor.use_dynamic_bsz`` with
    ``ppo_max_token_len_per_gpu``). ``calculate_entropy``: the update computes the entropy for
    ``actor/entropy`` (``actor.calculate_entropy``). ``bucket_overhead_tokens``: what one more
    forward costs, in response tokens, when the padded pass cuts a batch into length buckets
    (:func:`tearless.models.logprobs.length_buckets`). ``chunk_logits``: with
    ``actor.entropy_from_logits_with_chunking`` unset, logits larger than one chunk are taken a chunk
    of tokens at a time (:func:`tearless.models.chunked.chunked_logits_logprobs`).
    ``lora_adapter_sync``: with ``rollout.lora_sync`` unset, a vLLM engine of a LoRA run takes only the
    adapter at each sync and serves it through vLLM's LoRA kernels (else the merged weights).
    ``free_gradients``: an update frees its gradients once it is done
    (:func:`tearless.workers.schedule.run_plan`), so the rollout and the other role's update do not
    hold them; else they stay until the next update's first mini-batch.
    """

    remove_padding: bool
    dynamic_bsz: bool
    calculate_entropy: bool
    bucket_overhead_tokens: int
    chunk_logits: bool
    lora_adapter_sync: bool
    free_gradients: bool


DEVICE_DEFAULTS: dict[str, DeviceDefaults] = {
    # Tuned on 2-core CPUs (the embedded run): a forward of the tiny model costs ~64 tokens' work.
    # No automatic chunking: the chunked function's entropy and gradients differ from the whole-tensor
    # ones by float32 rounding (9.5e-7 in the entropy of a 49,152-vocabulary model at 480 tokens), and a
    # CPU run of a pretrained model past one chunk (SmolLM2: 342 tokens) must keep its numbers.
    "cpu": DeviceDefaults(
        remove_padding=False,
        dynamic_bsz=False,
        calculate_entropy=True,
        bucket_overhead_tokens=64,
        chunk_logits=False,
        # Measured on SmolLM2-135M, r = 8 (BENCHMARKS.md, "LoRA through vLLM"): the adapter's sync takes
        # 0.06 s against 0.85 s merged, but vLLM's CPU LoRA kernels made the step 1.46x slower.
        lora_adapter_sync=False,
        # Freed, the next update's gradients take fresh pages from the OS: 2-3% of the embedded run's
        # update (BENCHMARKS.md, "Gradients between updates"), for memory a CPU rarely lacks.
        free_gradients=False,
    ),
    # Measured on an H200 (issue 41): one more forward of a 220M model costs as much as ~10k tokens.
    # A 16k-token micro-batch at 151,936 logits is 9.3 GiB per float32 copy: chunked.
    "cuda": DeviceDefaults(
        remove_padding=True,
        dynamic_bsz=True,
        calculate_entropy=False,
        bucket_overhead_tokens=10_000,
        chunk_logits=True,
        # A 7B model's merged sync moves ~12.6 GiB in bf16 every step; its r = 8 adapter ~38 MiB.
        lora_adapter_sync=True,
        # The caching allocator hands the memory back at no cost; held, a 1.5B actor's 5.8 GiB of
        # gradients would sit through the rollout beside its KV cache.
        free_gradients=True,
    ),
}


def device_defaults(device_type: str) -> DeviceDefaults:
    """The defaults of ``device_type`` (``"cpu"``, ``"cuda"``); any other type takes the CPU's."""
    return DEVICE_DEFAULTS.get(device_type, DEVICE_DEFAULTS["cpu"])


def bucket_overhead_tokens(device_type: str) -> int:
    """What one more padded forward costs on ``device_type``, in response tokens."""
    return device_defaults(device_type).bucket_overhead_tokens
