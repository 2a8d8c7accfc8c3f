"""Load Hugging Face causal LMs and tokenizers from local directories or Hub IDs (tearless.models.hub)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch

from tearless.models.hub import is_hub_id, resolve_hub_model
from tearless.models.vision import check_supported, load_vision_lm, vision_model_type
from tearless.userfiles import check_model_files

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class NonFiniteWeights(ValueError):
    """A model whose stored weights hold NaN or infinite values; the message names the key and tensor."""


def check_model_dir(path: str | os.PathLike, key: str) -> Path:
    """The local model directory for ``key``'s value: the directory itself, or the cached snapshot
    of a Hub ID ``org/name[@revision]`` (downloaded unless ``HF_HUB_OFFLINE``, see
    :mod:`tearless.models.hub`); one clear error naming the key when it is neither, or when a file
    there is not a regular file of sane size (:func:`tearless.userfiles.check_model_files`)."""
    p = Path(path).expanduser()
    if is_hub_id(path):
        p = resolve_hub_model(str(path), key)
    check_model_files(p, key=key)
    if not (p / "config.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise FileNotFoundError(
            f"{key}={path!s}: no Hugging Face model directory there (expected config.json or "
            "tokenizer_config.json). Point it at a directory written by save_pretrained, or at a Hub "
            "model ID (org/name, optionally org/name@revision)"
        )
    return p


@contextmanager
def quiet_transformers():
    """Silence transformers' load reports and progress bars (a new value head is expected)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


def compute_device(model: torch.nn.Module) -> torch.device:
    """The device a model's forward runs on: its ``tearless_compute_device`` attribute when set (FSDP2
    with CPU parameter offload keeps the parameters in CPU memory but computes on the accelerator),
    else the device of its parameters."""
    device = getattr(model, "tearless_compute_device", None)
    return torch.device(device) if device is not None else next(model.parameters()).device


def resolve_dtype(name: str) -> torch.dtype:
    """Map a config string (``float32``/``bf16``/…) to a torch dtype, with a clear error."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}") from None


def load_tokenizer(path: str | os.PathLike, key: str = "actor_rollout_ref.model.path"):
    """Load a tokenizer with left padding (generation needs it) and a pad token.

    A tokenizer without a pad token gets its EOS as pad: tearless never infers masks from the pad id
    (masks travel with the batch), so sharing the id is safe here.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(check_model_dir(path, key)))
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ValueError(
            f"{key}={path!s}: the tokenizer has no EOS token; set eos_token in tokenizer_config.json"
        )
    return tok


def load_causal_lm(
    path: str | os.PathLike,
    *,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    key: str = "actor_rollout_ref.model.path",
    meta: bool = False,
) -> torch.nn.Module:
    """Load ``AutoModelForCausalLM`` from a local directory in the given dtype; with ``meta``, build
    its architecture on the meta device instead (no weights read, no memory: the sharded loading of
    :func:`tearless.distributed.fsdp.shard_from_rank0` fills it).

    A vision-language model (a ``vision_config`` in its ``config.json``) is loaded as
    ``AutoModelForImageTextToText`` (:mod:`tearless.models.vision`), its type checked first."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = check_model_dir(path, key)
    vision = vision_model_type(path)
    if vision is not None:
        check_supported(vision, key)
    with quiet_transformers():
        if vision is not None:
            model = load_vision_lm(path, dtype=resolve_dtype(dtype), meta=meta)
            if not meta:
                check_finite_weights(model, f"{key}={path}")
        elif meta:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(
                    AutoConfig.from_pretrained(str(path)), dtype=resolve_dtype(dtype)
                )
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype))
            check_finite_weights(model, f"{key}={path}")
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
        model.config.use_cache = False
    return model


def check_finite_weights(model: torch.nn.Module, where: str) -> None:
    """Raise :class:`NonFiniteWeights` when a parameter or buffer of ``model`` holds NaN or ±inf.

    Such a model samples garbage and its first update blows up, which the run would otherwise blame
    on the learning rate. One pass over the weights (≈ 0.1 s for 135M parameters on a CPU).
    """
    total, first = 0, None
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not tensor.is_floating_point() or tensor.device.type == "meta":
            continue
        bad = int((~torch.isfinite(tensor.detach())).sum())
        if bad and first is None:
            first = name
        total += bad
    if total:
        raise NonFiniteWeights(
            f"{where}: the weights hold {total} non-finite values (first in {first}); the files are "
            "damaged or were saved from a run that diverged: load an earlier checkpoint or the base model"
        )


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute activations in backward (transformers 5 renamed the switch; older releases lack it)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
