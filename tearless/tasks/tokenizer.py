"""A character-level Hugging Face tokenizer made with the `tokenizers` library.

The embedded tasks use it so that nothing is downloaded: every printable ASCII character is one
token, the chat roles and end-of-turn are special tokens, and a Jinja chat template is saved with it,
so `AutoTokenizer.from_pretrained(dir)` gives a normal fast tokenizer whose `apply_chat_template`
works like any chat model's.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS, UNK = "<pad>", "<|end|>", "<|begin|>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")

# Roles are single tokens and every turn ends with EOS, so a generation that stops at EOS ends the
# assistant turn exactly: no multi-token stop strings are needed.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_char_tokenizer(extra_tokens: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """Return a char-level fast tokenizer: one token per printable ASCII character.

    ``extra_tokens`` become single (non-special) tokens after the characters, e.g. the multi-hop QA
    task's ``<search>`` tags, as chat models have single tokens for ``<tool_call>``; they survive
    ``decode(skip_special_tokens=True)``.

    Decoding fuses tokens (``decoders.Fuse``) so ``decode(encode(s)) == s`` for any printable string;
    without it a WordLevel tokenizer joins tokens with spaces, which silently breaks exact-match
    rewards. The pad token is distinct from EOS, as left-padded generation requires.
    """
    specials = [PAD, EOS, BOS, UNK, *ROLE_TOKENS]
    chars = [*sorted(set(string.printable) - set("\t\n\r\x0b\x0c")), "\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="left",
        model_max_length=4096,
    )
    tok.chat_template = CHAT_TEMPLATE
    if extra_tokens:
        tok.add_tokens(list(extra_tokens))
    return tok
