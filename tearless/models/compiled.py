"""``torch.compile`` of the decoder layers for the update and the log-prob pass (``use_torch_compile``).

A role whose ``use_torch_compile`` is on has each decoder layer's forward compiled once
(``torch.compile(dynamic=True)``: sequence lengths and batch sizes are symbols, so new shapes do not
recompile) and marked on the model (:func:`compile_layers`). The compiled forwards replace the eager
ones only inside :func:`compiled_for`, which :func:`tearless.models.logprobs.response_logprobs` enters:
the update's forward and backward and the actor's, reference's and teacher's log-prob passes. The
built-in engine's decode loop calls the same model outside it and stays eager (its steps are one
token wide, and the GPU loop captures them in CUDA graphs of its own).

What compiling buys is fusion of the float32 work between the matmuls (RMSNorm, rotary, SiLU × up,
the residual adds, autocast's casts) into a few kernels per layer; the matmuls and attention are the
same kernels. It changes no maths, only the order of float operations inside fused kernels, so the
log-probs agree with eager ones within float rounding (tests/models/test_compiled.py).

A call that carries a KV cache (the shared-prompt pass's prompt and response forwards, ``cache=`` /
``past_key_values=``) runs the eager forward: the cache's Python state (which layer has been
written) is guarded per layer, so a compiled forward would compile once per layer and per call kind.
Packed and plain padded passes carry none: on a GPU (one packed forward per micro-batch by default,
:mod:`tearless.devices`) every layer runs compiled.

The first call of each kind (padded or packed, training or evaluation mode, forward and backward)
compiles: tens of seconds, once per process (inductor's caches on disk shorten later runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from tearless.distributed.fsdp import decoder_layers
from tearless.models.swap import Swap

# Keyword arguments by which a decoder layer receives a KV cache (names differ by architecture and
# transformers version).
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")

# Distinct compiled graphs one layer's code may hold: {padded, packed} × {train, eval} × {forward
# with and without grad} × LoRA adapters on/off, with room to spare. Dynamo's default (8) would fall
# back to eager silently for the rest.
RECOMPILE_LIMIT = 64


class CompiledLayers(Swap):
    """The compiled forwards of ``layers``; :meth:`active` swaps them in."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layers = layers
        self.forwards = [
            _cache_free(layer.forward, torch.compile(layer.forward, dynamic=True)) for layer in layers
        ]

    def swap_in(self) -> None:
        """Each layer's compiled forward in place of its eager one."""
        for layer, forward in zip(self.layers, self.forwards, strict=True):
            layer.forward = forward

    def swap_out(self) -> None:
        for layer in self.layers:
            del layer.forward


def _cache_free(eager: Callable, compiled: Callable) -> Callable:
    """``compiled`` for calls without a KV cache, ``eager`` for calls with one."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if any(kwargs.get(name) is not None for name in CACHE_KWARGS):
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)

    return forward


def compile_layers(model: torch.nn.Module, language: torch.nn.Module | None = None) -> torch.nn.Module:
    """Compile the decoder layers of ``model`` (of ``language``, its language model, for a
    vision-language model: the tower stays eager) for :func:`compiled_for`; returns ``model``.

    Call it after the model is placed and sharded (FSDP2's gathers then run as hooks around each
    compiled forward)."""
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), RECOMPILE_LIMIT))
    model.tearless_compiled = CompiledLayers(decoder_layers(language if language is not None else model))
    return model


def compiled_for(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """The compiled layers of ``model`` for the region (:func:`compile_layers`); a no-op for a model
    that was not compiled."""
    compiled = getattr(model, "tearless_compiled", None)
    return contextlib.nullcontext() if compiled is None else compiled.active()
