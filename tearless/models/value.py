"""Scalar-head models on a causal-LM backbone: PPO's value model (a head on every position) and the
reward model that ``tearless rm`` trains (a head read at the last token).

The value model is ``AutoModelForTokenClassification`` with one label, loaded from a causal-LM
directory (the backbone's weights are reused, the head is new), so it saves as a normal
``save_pretrained`` directory. The head starts at zero: the first values are 0 and GAE's first
advantages are the plain Monte-Carlo returns, rather than noise from a random head. The reward model
is ``AutoModelForSequenceClassification`` with one label, the class ``reward_model.model.path`` loads.
"""

from __future__ import annotations

import os

import torch

from tearless.models.loading import (
    check_model_dir,
    compute_device,
    enable_activation_checkpointing,
    quiet_transformers,
    resolve_dtype,
)
from tearless.models.logprobs import attended_lengths, sequence_inputs
from tearless.models.packing import pack_rows, packable, packed_forward
from tearless.models.precision import autocast_for


def load_value_model(
    path: str | os.PathLike,
    *,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    key: str = "critic.model.path",
    meta: bool = False,
) -> torch.nn.Module:
    """A one-label token-classification model from ``path``; the head is zeroed if it is new. With
    ``meta``, the architecture only, on the meta device (see :func:`~tearless.models.loading.load_causal_lm`).

    The classifier dropout that transformers adds before the head (0.1 for Llama when the config
    names none) is turned off, as veRL does for its critics: it made the values, and so GAE's
    advantages and the value loss, depend on the dropout random stream rather than on the data.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    path = check_model_dir(path, key)
    config = AutoConfig.from_pretrained(str(path))
    is_value_model = config.architectures and any("TokenClassification" in a for a in config.architectures)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    with quiet_transformers():
        if meta:
            with torch.device("meta"):
                model = AutoModelForTokenClassification.from_config(config, dtype=resolve_dtype(dtype))
        else:
            model = AutoModelForTokenClassification.from_pretrained(
                str(path), config=config, dtype=resolve_dtype(dtype)
            )
    if not is_value_model and not meta:
        head = model.score if hasattr(model, "score") else model.classifier  # Llama/Qwen vs BERT-style names
        torch.nn.init.zeros_(head.weight)
        if head.bias is not None:
            torch.nn.init.zeros_(head.bias)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    return model


def load_reward_model(
    path: str | os.PathLike,
    *,
    pad_token_id: int,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    key: str = "model.path",
) -> torch.nn.Module:
    """A one-label sequence-classification model from ``path``: a reward model, or a causal LM whose
    backbone it reuses under a new head (transformers' default initialisation, drawn from torch's
    seeded generator). ``pad_token_id`` goes into its config: the model reads each row's reward at
    its last token that is not padding, and refuses batches without the id."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = check_model_dir(path, key)
    config = AutoConfig.from_pretrained(str(path))
    classifier = config.architectures and any("SequenceClassification" in a for a in config.architectures)
    if classifier and config.num_labels != 1:
        raise ValueError(
            f"{key}={path!s} is a classifier with {config.num_labels} outputs; a reward model has one. "
            "Start from its causal LM or from a one-label reward model"
        )
    config.num_labels = 1
    config.pad_token_id = pad_token_id
    with quiet_transformers():
        model = AutoModelForSequenceClassification.from_pretrained(
            str(path), config=config, dtype=resolve_dtype(dtype)
        )
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
        model.config.use_cache = False
    return model


def response_values(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    remove_padding: bool = False,
) -> torch.Tensor:
    """V(s_t) for each response token, (B, R): the value of the state before the token is generated,
    read at the position that predicts it (the same shift as the log-probs).

    ``remove_padding`` (``critic.model.use_remove_padding``) runs one packed forward over the valid
    tokens (:mod:`tearless.models.packing`); its values are 0 past each row's attended length (the
    padded pass leaves whatever the model computed at the padding there: callers mask both).
    """
    device = compute_device(model)
    lengths = attended_lengths(response_mask)
    if remove_padding and packable(prompt_mask, response_mask, lengths):
        packed = pack_rows(prompt_ids.to(device), prompt_mask.to(device), response_ids.to(device), lengths)
        with autocast_for(model):
            out = packed_forward(model, packed).logits[0, :, 0]
        return packed.unpack(out[packed.keep].float(), tuple(response_ids.shape))
    ids, mask, positions = (
        t.to(device) for t in sequence_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    )
    width = response_ids.shape[1]
    with autocast_for(model):  # bf16 compute where the model is marked for it; the values in float32
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.squeeze(-1)
    return out[:, -width - 1 : -1].float()
