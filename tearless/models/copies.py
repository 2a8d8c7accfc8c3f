"""Compute copies (``fsdp_config.compute_copies``): bf16 weights cast once per optimizer step, not at
every forward.

Under ``torch.autocast`` every matmul casts its float32 weight to bf16, at every forward (and the
backward's matmuls use those casts again or make their own): on a GPU that is one cast kernel per
linear layer per pass, thousands per update, and the residual stream, the norms and rotary stay
float32 around them. With compute copies a trained model keeps two tensors per parameter:

- the **master** (the module's own ``nn.Parameter``, float32): what the optimizer steps, the
  gradient clipping measures, checkpoints save, weight syncs and the bad-step guard read;
- the **copy** (an ``nn.Parameter`` in the compute dtype): what the forwards and backwards compute
  with, swapped into the modules inside :func:`copies_for` (the update, the log-prob passes, the
  hybrid engine's generation).

The gradient of a copy (bf16, computed by the backward of a bf16 forward) is added to its master's
float32 ``.grad`` as soon as it is accumulated (a post-accumulate-grad hook), so micro-batches sum
in float32, as under autocast; the copy holds no gradient between passes. After each optimizer step
the copies are refreshed from the masters (one fused cast: ``torch._foreach_copy_``). The whole
forward then runs in the compute dtype (the residual stream, the norms' outputs, the attention
inputs), as FSDP2's mixed precision and veRL's run it; tearless still upcasts the logits to float32
before the log-softmax, and the losses are float32.

A frozen model (the reference, the teacher) needs no master: its parameters are held in the compute
dtype itself (:func:`hold_in`), halving its memory. So do the frozen parameters of a trained model
when nothing outside the passes forwards them in float32 (``hold_frozen``: a LoRA actor's base,
when its engine samples in the copies' dtype too): a LoRA base then costs 2 bytes a parameter, not
a float32 master's 4 and a copy's 2, and only the adapters have masters and copies. Outside the
passes the model is then mixed (a bf16 base beside float32 adapter masters: peft casts each adapter's
output back to the base's dtype), which nothing samples from; a float32 engine needs the float32
base, so it keeps its masters there (:meth:`~tearless.config.plan.RunPlan.holds_base_in_copies`).

Buffers keep their dtype in both cases: rotary's ``inv_freq`` rounded to bf16 would move every
position's angle, and the reference would no longer compute what the actor's copies compute.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from tearless.models.swap import Swap


class ComputeCopies(Swap):
    """The compute-dtype copies of ``model``'s parameters (tied parameters share one copy); with
    ``hold_frozen``, its frozen parameters are held in ``dtype`` instead (their own copies)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, *, hold_frozen: bool = False) -> None:
        self.dtype = dtype
        self.holds_frozen = hold_frozen
        made: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
        self.slots: list[tuple[torch.nn.Module, str, torch.nn.Parameter, torch.nn.Parameter]] = []
        for module in model.modules():
            for name, master in module._parameters.items():
                if master is None:
                    continue
                if hold_frozen and not master.requires_grad:
                    master.data = master.data.to(dtype)  # a tied one is cast once: then it is in dtype
                    continue
                if id(master) not in made:
                    copy = torch.nn.Parameter(master.detach().to(dtype), requires_grad=master.requires_grad)
                    if master.requires_grad:
                        copy.register_post_accumulate_grad_hook(functools.partial(_fold, master))
                    made[id(master)] = (master, copy)
                self.slots.append((module, name, master, made[id(master)][1]))
        trained = [pair for pair in made.values() if pair[0].requires_grad]
        self.masters = [m for m, _ in trained]
        self.copies = [c for _, c in trained]

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast the trained masters into their copies (after an optimizer step)."""
        if self.copies:
            torch._foreach_copy_(self.copies, self.masters)

    def swap_in(self) -> None:
        """The copies in the modules' parameter slots (the masters back in :meth:`swap_out`)."""
        for module, name, _, copy in self.slots:
            module._parameters[name] = copy

    def swap_out(self) -> None:
        for module, name, master, _ in self.slots:
            module._parameters[name] = master


def _fold(master: torch.nn.Parameter, copy: torch.nn.Parameter) -> None:
    """Add ``copy``'s fresh gradient to ``master``'s float32 one and free it."""
    grad = copy.grad
    if master.grad is None:
        master.grad = grad.to(master.dtype)
    else:
        master.grad.add_(grad)
    copy.grad = None


def attach(model: torch.nn.Module, dtype: torch.dtype, *, hold_frozen: bool = False) -> ComputeCopies:
    """Give the trained ``model`` compute copies in ``dtype`` (read by :func:`copies_for`); with
    ``hold_frozen``, hold its frozen parameters in ``dtype`` (module docs)."""
    copies = ComputeCopies(model, dtype, hold_frozen=hold_frozen)
    model.tearless_copies = copies
    return copies


def refresh_after(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """Refresh ``model``'s compute copies after every step of ``optimizer`` (over its masters); a
    no-op for a model without copies."""
    copies = getattr(model, "tearless_copies", None)
    if copies is not None:
        optimizer.register_step_post_hook(lambda *_: copies.refresh())


def copies_for(model: torch.nn.Module, dtype: torch.dtype | None = None) -> contextlib.AbstractContextManager:
    """``model``'s compute copies in place for the region; a no-op for a model without them, or whose
    copies are not in ``dtype`` when one is given (an engine computing in float32 reads the masters)."""
    copies = getattr(model, "tearless_copies", None)
    if copies is None or dtype not in (None, copies.dtype):
        return contextlib.nullcontext()
    return copies.active()


def holds_frozen(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds its frozen parameters in its copies' dtype (:func:`attach`'s
    ``hold_frozen``): outside the passes it is mixed, a bf16 base beside float32 masters."""
    copies = getattr(model, "tearless_copies", None)
    return copies is not None and copies.holds_frozen


@torch.no_grad()
def hold_in(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen ``model`` whose parameters are held in ``dtype`` (its buffers as they are); returns
    ``model``."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model
