"""The embedded char-level tokenizer: exact round trips, a saved tokenizer that transformers loads as is."""

from __future__ import annotations

import functools
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tearless.tasks.tokenizer import CHAT_TEMPLATE, EOS, PAD, ROLE_TOKENS, build_char_tokenizer

PRINTABLE = sorted(set(string.printable) - set("\t\r\x0b\x0c"))


@functools.cache
def _shared_tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def reloaded(tok, tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=PRINTABLE, max_size=40))
def test_decode_of_encode_is_the_identity(s):
    tok = _shared_tokenizer()
    ids = tok.encode(s, add_special_tokens=False)
    assert tok.decode(ids) == s
    assert tok.unk_token_id not in ids
    if not any(special in s for special in tok.all_special_tokens):
        # One token per character, spaces and newlines included ("<|end|>" in the text is one token).
        assert len(ids) == len(s)


def test_special_token_text_round_trips_as_one_token(tok):
    ids = tok.encode("a<|system|>b", add_special_tokens=False)
    assert len(ids) == 3 and tok.decode(ids) == "a<|system|>b"


def test_answers_decode_without_spaces_between_digits(tok):
    # Without a fusing decoder a WordLevel tokenizer decodes "85" as "8 5": a silent zero reward.
    assert tok.decode(tok.encode("7+8=15, 85", add_special_tokens=False)) == "7+8=15, 85"


def test_special_tokens_are_single_tokens_and_pad_is_not_eos(tok):
    assert tok.pad_token == PAD and tok.eos_token == EOS
    assert tok.pad_token_id != tok.eos_token_id
    for role in ROLE_TOKENS:
        assert len(tok.encode(role, add_special_tokens=False)) == 1
    ids = tok.encode("<|user|>1+2=<|end|>", add_special_tokens=False)
    assert len(ids) == 1 + 4 + 1
    assert tok.decode(ids, skip_special_tokens=True) == "1+2="


def test_auto_tokenizer_round_trip_keeps_vocab_specials_and_template(tok, reloaded):
    assert reloaded.get_vocab() == tok.get_vocab()
    assert (reloaded.pad_token_id, reloaded.eos_token_id, reloaded.bos_token_id) == (
        tok.pad_token_id,
        tok.eos_token_id,
        tok.bos_token_id,
    )
    assert reloaded.pad_token_id != reloaded.eos_token_id
    assert reloaded.chat_template == CHAT_TEMPLATE
    s = "47+38=7+8=15, 85 !~"
    assert reloaded.encode(s, add_special_tokens=False) == tok.encode(s, add_special_tokens=False)
    assert reloaded.decode(reloaded.encode(s, add_special_tokens=False)) == s


def test_chat_template_renders_the_roles_as_single_tokens(reloaded):
    messages = [{"role": "user", "content": "12+3="}]
    text = reloaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>12+3=<|end|><|assistant|>"
    ids = reloaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(ids) == 1 + 5 + 1 + 1
    assert reloaded.apply_chat_template(messages, tokenize=False) == "<|user|>12+3=<|end|>"
    two = [{"role": "system", "content": "add"}, *messages]
    assert (
        reloaded.apply_chat_template(two, add_generation_prompt=True, tokenize=False)
        == "<|system|>add<|end|><|user|>12+3=<|end|><|assistant|>"
    )
