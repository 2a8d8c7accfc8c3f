r"""How much device memory a training rank needs, known before any weight is loaded.

For a decoder of N parameters (hidden size h, L layers, key/value width k = kv_heads · head_dim, MLP
width i, vocabulary V) trained with AdamW on float32 master weights, one rank holds:

- **parameters** 4N bytes (float32), ÷ world size when FSDP2 shards them, 0 when offloaded; a LoRA
  actor's 4(N + T) (its base and its T adapter parameters); with compute copies in bf16 (one
  process) 2 bytes more for each, or 2N + 6T for a LoRA actor whose base is held in bf16;
- **gradients** 4·T bytes for the T trained parameters (T = N, or the LoRA adapters' count);
- **optimizer** 8·T bytes (AdamW's two float32 moments), 0 when offloaded (with the parameters too:
  FSDP2's parameter offload keeps them, their gradients and so AdamW's state in CPU memory);
- **activations** per token of a micro-batch, in the compute dtype (c bytes: 2 for bf16, 4 for
  float32) and the residual stream's dtype (r bytes, float32), what autograd keeps for the backward
  of each block

  .. math:: a_\text{layer} = 2h·r + c·(6h + 4k + 4i)

  (the two norms' float32 inputs; the normed inputs of q/k/v and of gate/up, q and k after rotary
  and v, the attention output, gate, up, silu(gate) and the down projection's input), times L, plus
  the logits (c·V) and their float32 log-softmax working copy (4V, or none when chunked). With
  activation checkpointing a block keeps only its float32 input (h·r) and one block is recomputed
  at a time (one a_layer more);
- **KV cache** of the rollout: 2·L·k·c bytes per token of every sequence the rank generates at once.

Peak ≈ parameters + optimizer + max(gradients + activations, KV cache): the update and the rollout
do not overlap in the colocated placement, and on a GPU gradients are freed once an update is done
(:func:`~tearless.workers.schedule.run_plan`), so one role's are held at a time; on a CPU they stay
until the next update (:attr:`~tearless.devices.DeviceDefaults.free_gradients`), held through every
phase. Weights of a
frozen reference (4N, no gradient or optimizer) add to both phases. A critic trained on the same rank
(PPO) holds its weights and AdamW state (12N_c) throughout and adds a third phase, its own update
(gradients 4N_c and its activations: :func:`critic_part`).

How close each part is: the **state** (parameters, gradients, optimizer, reference) is exact but for
the biases (under 0.1%) and is a floor of what the rank holds. The **activations** and the **KV
cache** are upper bounds in the lengths: the caller sizes every sequence at its cap (the config's
prompt + response lengths) and counts each prompt once per response, where real responses are
shorter and the shared-prompt pass forwards a group's prompt once. Transient buffers (FSDP2's
gathered block, the allocator's fragmentation, CUDA graphs) are left out. So the peak is an upper
bound of the lengths' worst case, not of the allocator's: only the state is safe to refuse a run on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder that memory depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    head_dim: int | None = None

    @property
    def kv_width(self) -> int:
        """k = kv_heads · head_dim: the width of one layer's keys (and of its values)."""
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    @property
    def parameters(self) -> int:
        r"""N = V·h·(1 or 2) + L·(2h·h_q + 2h·k + 3h·i + 2h) + h: embeddings (and an untied head), per
        layer q and o (h × heads·head_dim), k and v (h × k), gate, up and down (h × i), two norms;
        the final norm. Biases (Qwen2's q/k/v) are left out: h + 2k per layer, under 0.1%."""
        q = self.heads * (self.head_dim or self.hidden // self.heads)
        h = self.hidden
        per_layer = 2 * h * q + 2 * h * self.kv_width + 3 * h * self.intermediate + 2 * h
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return embed + self.layers * per_layer + self.hidden

    def lora_parameters(self, rank: int) -> int:
        """Adapters of rank r on every linear layer of every block: r·(in + out) each."""
        q = self.heads * (self.head_dim or self.hidden // self.heads)
        h, k, i = self.hidden, self.kv_width, self.intermediate
        per_layer = (h + q) * 2 + (h + k) * 2 + (h + i) * 3
        return self.layers * rank * per_layer

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config (``hidden_size``, ``num_hidden_layers``, …)."""
        c = getattr(config, "text_config", None) or config
        heads = c.num_attention_heads
        return cls(
            hidden=c.hidden_size,
            layers=c.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            intermediate=getattr(c, "intermediate_size", None) or 4 * c.hidden_size,
            vocab=c.vocab_size,
            tied=bool(getattr(c, "tie_word_embeddings", False)),
            head_dim=getattr(c, "head_dim", None),
        )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank of each part (see the module docstring) and the peak."""

    parameters: int
    gradients: int
    optimizer: int
    activation_per_token: int
    micro_tokens: int
    kv_per_token: int
    rollout_tokens: int
    reference: int = 0
    teacher: int = 0
    critic: int = 0  # a colocated critic's parameters and AdamW state, held through the step
    critic_gradients: int = 0  # its gradients and its activations, during its own update
    critic_activations: int = 0
    frees_gradients: bool = True  # an update frees its gradients once done (else they stay to the next)

    @property
    def activations(self) -> int:
        return self.activation_per_token * self.micro_tokens

    @property
    def kv_cache(self) -> int:
        return self.kv_per_token * self.rollout_tokens

    @property
    def _held(self) -> int:
        """Held through every phase: parameters, optimizer, reference, teacher, a colocated critic's
        parameters and optimizer, and both roles' gradients where an update does not free them."""
        held = self.parameters + self.optimizer + self.reference + self.teacher + self.critic
        return held + (0 if self.frees_gradients else self.gradients + self.critic_gradients)

    @property
    def state(self) -> int:
        """What the rank holds whatever the lengths: :attr:`_held`, and where updates free their
        gradients the larger of the actor's and the critic's (one role's at a time)."""
        freed = max(self.gradients, self.critic_gradients) if self.frees_gradients else 0
        return self._held + freed

    @property
    def phases(self) -> dict[str, int]:
        """What the rank holds in each phase: :attr:`_held` plus the actor's update (``update``), the
        critic's (``critic_update``) or the rollout's KV cache (``rollout``), each update with its own
        gradients where they are freed between updates."""
        g, cg = (self.gradients, self.critic_gradients) if self.frees_gradients else (0, 0)
        return {
            "update": self._held + g + self.activations,
            "critic_update": self._held + cg + self.critic_activations,
            "rollout": self._held + self.kv_cache,
        }

    @property
    def peak(self) -> int:
        """The largest of the :attr:`phases`."""
        return max(self.phases.values())

    def line(self, where: str) -> str:
        """One line: each part in GiB and the peak."""

        def g(n: int) -> str:
            return f"{n / GIB:.2f}"

        ref = f", reference {g(self.reference)}" if self.reference else ""
        ref += f", teacher {g(self.teacher)}" if self.teacher else ""
        if self.critic:
            ref += (
                f", critic {g(self.critic + self.critic_gradients)} (+ activations "
                f"{g(self.critic_activations)} in its update)"
            )
        return (
            f"memory estimate ({where}, GiB): parameters {g(self.parameters)}, "
            f"gradients {g(self.gradients)}, optimizer {g(self.optimizer)}{ref}, "
            f"activations {g(self.activations)} "
            f"({self.activation_per_token / 1024:.1f} KiB/token x {self.micro_tokens} tokens), KV cache "
            f"{g(self.kv_cache)} ({self.kv_per_token / 1024:.1f} KiB/token x {self.rollout_tokens} tokens); "
            f"peak up to ~{g(self.peak)}"
        )


def critic_part(
    shape: ModelShape,
    *,
    world: int = 1,
    compute_bytes: int,
    micro_tokens: int,
    checkpointing: bool = False,
    param_offload: bool = False,
    optimizer_offload: bool = False,
    copy_bytes: int = 0,
) -> dict[str, int]:
    """A value model of ``shape``'s backbone trained on the same rank (PPO's critic, colocated), as
    :func:`estimate`'s ``critic``, ``critic_gradients`` and ``critic_activations``: its N_c parameters
    (the embedding once, the one-output value head left out like the biases) in float32 (+
    ``copy_bytes`` each for compute copies), its gradients 4N_c and AdamW 8N_c, ÷ ``world``; its
    activations per token those of the decoder with a one-wide head, at its ``micro_tokens``."""
    value = dataclasses.replace(shape, vocab=1, tied=True)
    n = dataclasses.replace(shape, tied=True).parameters
    per_token = activation_bytes_per_token(
        value, compute_bytes=compute_bytes, chunked=True, checkpointing=checkpointing
    )
    return {
        "critic": (0 if param_offload else (4 + copy_bytes) * n // world)
        + (0 if param_offload or optimizer_offload else 8 * n // world),
        "critic_gradients": 0 if param_offload else 4 * n // world,
        "critic_activations": per_token * micro_tokens,
    }


def activation_bytes_per_token(
    shape: ModelShape,
    *,
    compute_bytes: int,
    chunked: bool,
    residual_bytes: int = 4,
    checkpointing: bool = False,
) -> int:
    """What autograd keeps per token of a micro-batch (the module docstring's a_layer · L + head)."""
    h, k, i = shape.hidden, shape.kv_width, shape.intermediate
    layer = 2 * h * residual_bytes + compute_bytes * (6 * h + 4 * k + 4 * i)
    blocks = shape.layers * h * residual_bytes + layer if checkpointing else shape.layers * layer
    head = compute_bytes * shape.vocab + (0 if chunked else 4 * shape.vocab)
    return blocks + head


def estimate(
    shape: ModelShape,
    *,
    world: int = 1,
    lora_rank: int = 0,
    compute_bytes: int,
    micro_tokens: int,
    rollout_tokens: int,
    rollout_bytes: int | None = None,
    checkpointing: bool = False,
    chunked: bool = False,
    param_offload: bool = False,
    optimizer_offload: bool = False,
    reference: bool = False,
    teacher: ModelShape | None = None,
    teacher_offload: bool = False,
    copy_bytes: int = 0,
    reference_bytes: int = 4,
    teacher_bytes: int = 4,
    base_bytes: int = 4,
    critic: dict[str, int] | None = None,
    frees_gradients: bool = True,
) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of one rank: parameters, gradients and optimizer state divided by
    ``world`` (FSDP2's full sharding); ``micro_tokens`` tokens in one micro-batch's forward and
    backward; ``rollout_tokens`` tokens of the sequences the rank generates at once, cached in
    ``rollout_bytes`` per element (default ``compute_bytes``); a frozen ``reference`` copy when the
    reference is a separate model (not LoRA's adapters-off actor); a frozen ``teacher`` of its own
    shape (on-policy distillation; none on the GPU when ``teacher_offload``). ``copy_bytes``: the
    bytes per parameter of the actor's compute copies beside its float32 masters (2 with
    ``compute_copies`` in bf16, else 0); ``reference_bytes``, ``teacher_bytes``: those of the
    reference's and the teacher's parameters (2 when held in bf16); ``base_bytes``: those of a LoRA
    actor's frozen base (2 when held in bf16 with its copies: then only the adapters have copies);
    ``critic``: a colocated critic's parts (:func:`critic_part`); ``frees_gradients``: whether an update
    frees its gradients once done (:class:`MemoryEstimate`)."""
    n = shape.parameters
    trained = shape.lora_parameters(lora_rank) if lora_rank > 0 else n
    base = n if lora_rank > 0 else 0  # a LoRA actor's frozen base; its adapters come on top of it
    held = base and base_bytes != 4
    weights = 4 * trained + base_bytes * base + copy_bytes * (trained + (0 if held else base))
    return MemoryEstimate(
        parameters=0 if param_offload else weights // world,
        gradients=0 if param_offload else 4 * trained // world,
        optimizer=0 if param_offload or optimizer_offload else 8 * trained // world,
        activation_per_token=activation_bytes_per_token(
            shape, compute_bytes=compute_bytes, checkpointing=checkpointing, chunked=chunked
        ),
        micro_tokens=micro_tokens,
        kv_per_token=2 * shape.layers * shape.kv_width * (rollout_bytes or compute_bytes),
        rollout_tokens=rollout_tokens,
        reference=0 if param_offload or not reference or lora_rank else reference_bytes * n // world,
        teacher=0 if teacher is None or teacher_offload else teacher_bytes * teacher.parameters // world,
        **(critic or {}),
        frees_gradients=frees_gradients,
    )
