"""FSDP2 for tearless's models: sharded loading, gradient clipping, gathering for generation.

``shard_model`` applies ``torch.distributed.fsdp.fully_shard`` to each transformer block and then to
the root, as the FSDP2 docs recommend: a block's parameters are all-gathered just before its forward
and freed after it, so peak memory holds one full block rather than the whole model. Gradients are
reduce-scattered and averaged over the ranks; a rank's loss normalised by *global* token or
sequence counts must therefore be multiplied by the world size (see :mod:`tearless.workers.schedule`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face model: the longest ``nn.ModuleList`` it holds.

    Llama, Qwen2, Mistral, GPT-NeoX (``layers``), GPT-2 (``h``) and their token-classification twins
    all keep their blocks in one ModuleList; a model without any raises, naming its class.
    """
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of transformer blocks for FSDP2 to shard; "
            "use a decoder model with its layers in a ModuleList (Llama, Qwen2, Mistral, GPT-2, …)"
        )
    return list(max(lists, key=len))


def shard_model(
    model: torch.nn.Module,
    mesh,
    *,
    param_offload: bool = False,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    blocks: Callable[[torch.nn.Module], list[torch.nn.Module]] = decoder_layers,
) -> torch.nn.Module:
    """Apply ``fully_shard`` to every transformer block (``blocks(model)``, by default
    :func:`decoder_layers`), then to the root; return the same module.

    ``param_offload`` keeps the sharded parameters (and therefore the optimizer's state and step) in
    CPU memory (``CPUOffloadPolicy``). ``param_dtype`` (e.g. ``torch.bfloat16`` on GPU) runs forward
    and backward in that dtype while the sharded master parameters and the gradient reduction stay
    in float32 (``MixedPrecisionPolicy``).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "offload_policy": CPUOffloadPolicy() if param_offload else OffloadPolicy(),
    }
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip gradients to a global L2 norm ``max_norm``; return the norm before clipping.

    With sharded (DTensor) gradients each rank holds a slice; ``get_total_norm`` returns a partial
    DTensor whose ``full_tensor()`` reduces the squared sums over the ranks, so every rank clips by
    the same global norm, exactly as ``clip_grad_norm_`` does on an unsharded model.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def process_group_backend(device_type: str) -> str:
    """The backend of the training ranks' default process group on ``device_type``.

    On GPU the group carries NCCL for CUDA tensors *and* gloo for CPU tensors
    (``"cpu:gloo,cuda:nccl"``, as veRL does): the ranks also agree on CPU flags (a finite-gradient
    vote, :func:`tearless.workers.schedule.all_ranks_agree`) and broadcast CPU-resident buffers of
    offloaded models, and an NCCL-only group refuses any CPU tensor ("No backend type associated
    with device type cpu"). On CPU: gloo.
    """
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def optimizer_state_moves(device_type: str, *, param_offload: bool, optimizer_offload: bool) -> bool:
    """Whether the optimizer state visits ``device_type`` only for each update (and lives in CPU
    memory between updates): ``optimizer_offload`` on a GPU whose parameters stay on it. With
    ``param_offload`` the sharded parameters live in CPU memory, AdamW steps there, and its state
    must stay there too (moving it to the GPU would mix devices in the step); on CPU nothing moves.
    """
    return device_type == "cuda" and optimizer_offload and not param_offload


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every tensor of the optimizer's state (Adam moments, step) to ``device``.

    With ``fsdp_config.optimizer_offload`` the state lives in CPU memory between updates and visits
    the accelerator only for the optimizer step (:func:`optimizer_state_moves`). The copies are
    issued without waiting, then awaited once: a device-to-host copy is asynchronous, and state read
    (or saved) before it lands would hold half-copied moments.
    """
    target = torch.device(device)
    sources = set()
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != target:
                sources.add(value.device)
                state[key] = value.to(target, non_blocking=True)
    for source in sources | {target}:
        if source.type == "cuda":
            torch.cuda.synchronize(source)


def shard_from_rank0(
    build: Callable[[bool], torch.nn.Module],
    mesh,
    *,
    rank: int,
    device: torch.device | str,
    **shard_kwargs: Any,
) -> torch.nn.Module:
    """A sharded model whose weights only rank 0 read: ``build(True)`` loads them on rank 0 (in CPU
    memory), ``build(False)`` builds the same architecture on the meta device elsewhere (no memory);
    every rank applies :func:`shard_model`, allocates its shards on ``device`` and receives them
    from rank 0 (``set_model_state_dict`` with ``broadcast_from_rank0``), then the buffers (rotary
    frequencies are not in a state dict) are broadcast too. A collective.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = build(rank == 0)
    full = model.state_dict() if rank == 0 else {}
    buffers = dict(model.named_buffers()) if rank == 0 else {}
    shard_model(model, mesh, **shard_kwargs)
    model.to_empty(device=device)
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if rank == 0:
                buffer.copy_(buffers[name])
            dist.broadcast(buffer, src=0)
    return model


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that ``fully_shard`` wrapped (none for an unsharded model)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered(model: torch.nn.Module, reshard_after_forward: bool = True) -> Iterator[None]:
    """Hold the full parameters on this rank for a while (generation with the weights being trained).

    Every FSDP module is unsharded (one all-gather each) and stays so across forwards, so that ranks
    may then run different numbers of forwards (each generates its own prompts, to its own lengths)
    with no collective among them; on exit the shards are restored. A no-op for an unsharded model.
    """
    modules = fsdp_modules(model)
    if not modules:
        yield
        return
    for m in modules:
        m.unshard()
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        model.set_reshard_after_forward(reshard_after_forward)
        for m in modules:
            m.reshard()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly DTensor-sharded) tensor; an all-gather for a DTensor, so every rank of
    its mesh must call it for the same tensors in the same order."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t
