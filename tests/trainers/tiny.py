"""A tiny char-level Llama saved with its tokenizer, for the SFT and DPO trainer tests."""

from __future__ import annotations

from pathlib import Path


def save_tiny_model(path: Path, *, seed: int = 0) -> str:
    """Write a randomly initialised 1-layer, 32-wide Llama and the embedded char tokenizer."""
    from tearless.tasks.bootstrap import tokenizer_llama
    from tearless.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = tokenizer_llama(tok, hidden_size=32, num_layers=1, seed=seed)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
