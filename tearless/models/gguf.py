"""Turn a GGUF file (llama.cpp's format) into a plain ``save_pretrained`` model directory.

transformers reads a GGUF file with ``from_pretrained(dir, gguf_file=name)`` (it needs the ``gguf``
package) and dequantises every tensor to float32, but the model it returns is still flagged as
quantised: ``.float()`` raises and ``save_pretrained`` writes a ``quantization_config`` that makes the
directory a GGUF model again. :func:`import_gguf` therefore rebuilds a fresh model from the config
(without that entry) and loads the dequantised state dict into it, strictly: every key must match, so
a file whose architecture transformers maps only in part fails here rather than training from a
half-random model. The result is an ordinary float32 directory (``model.safetensors``, config,
generation config, tokenizer with its chat template) that every tearless command and transformers
loads directly.

A quantised file's weights are its dequantised values (Q4_1 stores ``w = d·q + m`` per 32-weight
block), not the original float weights: the imported model answers as the GGUF model does.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tearless.models.loading import quiet_transformers


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported; the message names the file and the fix."""


def import_gguf(gguf_file: str | os.PathLike, output_dir: str | os.PathLike) -> Path:
    """Write the model and tokenizer of ``gguf_file`` to ``output_dir`` as float32 safetensors.

    Returns ``output_dir``. Raises :class:`GGUFImportError` when the file is missing, the ``gguf``
    package is not installed, or transformers cannot map every tensor of the file.
    """
    src, out = Path(gguf_file).expanduser(), Path(output_dir).expanduser()
    if not src.is_file():
        raise GGUFImportError(f"{src}: no such GGUF file")
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it; the check gives the fix)
    except ImportError:
        raise GGUFImportError(
            f"{src}: reading GGUF needs the gguf package: pip install gguf (or pip install 'tearless[gguf]')"
        ) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with quiet_transformers():
        try:
            loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name)
            tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        except (ValueError, KeyError, RuntimeError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise GGUFImportError(f"{src}: transformers cannot read this GGUF file: {first}") from None
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        state = {k: v.to(torch.float32) for k, v in loaded.state_dict().items()}
        generation = loaded.generation_config
        del loaded
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied output heads are one parameter under two names: the state dict may list either.
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise GGUFImportError(
            f"{src}: transformers mapped the file only in part ({len(missing)} weights missing, e.g. "
            f"{missing[:2]}; {len(unexpected)} unexpected, e.g. {unexpected[:2]}); this architecture's "
            "GGUF import is not supported by the installed transformers"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # The chat template's end-of-turn token is the generation's stop token (ChatML's <|im_end|>).
    eos = tokenizer.eos_token_id
    generation = generation if isinstance(generation, GenerationConfig) else GenerationConfig()
    generation.eos_token_id = eos
    generation.pad_token_id = tokenizer.pad_token_id
    model.generation_config = generation
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
