"""SFT rows: the loss mask covers assistant tokens only; padding, packing; errors that name the row."""

from __future__ import annotations

import json

import pytest

from tearless.data import DataError, render_prompt, write_parquet
from tearless.data.sft import (
    SFTDataset,
    encode_example,
    pack_batch,
    pad_batch,
    read_many,
    render_plain,
    tokenize_conversation,
)

CHAT = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]


def test_the_mask_covers_the_answer_and_its_end_of_turn_token_only(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CHAT)
    # <|user|> 1 + 2 = <|end|> <|assistant|> 3 <|end|>: nine tokens, the last two trained.
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<|user|>", "1", "+", "2", "=", "<|end|>", "<|assistant|>", "3", "<|end|>"
    ]  # fmt: skip
    assert mask == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    # The untrained part is exactly the generation prompt the rollout renders.
    assert ids[:7] == render_prompt(tokenizer, CHAT[:1])


def test_every_assistant_turn_is_trained_and_train_from_skips_earlier_ones(tokenizer):
    chat = [*CHAT, {"role": "user", "content": "+4="}, {"role": "assistant", "content": "7"}]
    ids, mask = tokenize_conversation(tokenizer, chat)
    trained = [t for t, m in zip(tokenizer.convert_ids_to_tokens(ids), mask, strict=True) if m]
    assert trained == ["3", "<|end|>", "7", "<|end|>"]
    _, mask_late = tokenize_conversation(tokenizer, chat, train_from=2)
    assert sum(mask_late) == 2 and mask_late[-2:] == [1, 1]


def test_prompt_response_columns_equal_the_messages_layout(tokenizer):
    a = SFTDataset([{"messages": CHAT}], tokenizer)[0]
    b = SFTDataset([{"prompt": "1+2=", "response": "3"}], tokenizer)[0]
    c = SFTDataset([{"q": CHAT[:1], "a": "3"}], tokenizer, prompt_key="q", response_key="a")[0]
    assert a["input_ids"] == b["input_ids"] == c["input_ids"]
    assert a["loss_mask"] == b["loss_mask"] == c["loss_mask"]


def test_a_base_tokenizer_trains_the_final_answer_and_eos(tokenizer):
    base = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|end|>")
    base.chat_template = None
    ids, mask = tokenize_conversation(base, CHAT)
    assert base.decode(ids) == "user: 1+2=\nassistant: 3<|end|>"
    assert ids[: mask.index(1)] == render_plain(base, CHAT[:1])
    assert sum(mask) == 2 and mask[-2:] == [1, 1]


def test_a_template_that_rewrites_past_turns_is_refused(tokenizer):
    rewriting = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|end|>")
    # Keeps only the last message: turn i is not a prefix of turn i + 1.
    rewriting.chat_template = "{{ messages[-1]['content'] }}"
    with pytest.raises(DataError, match="row 0: the chat template does not render message 1"):
        tokenize_conversation(rewriting, CHAT, where="row 0")


def test_truncation(tokenizer):
    long = [{"role": "user", "content": "1" * 20}, {"role": "assistant", "content": "22"}]
    with pytest.raises(DataError, match=r"f.jsonl: row 4: 26 tokens, longer than data.max_length=10"):
        encode_example(tokenizer, long, max_length=10, where="f.jsonl: row 4")
    left = encode_example(tokenizer, long, max_length=10, truncation="left")
    assert len(left["input_ids"]) == 10 and left["loss_mask"][-3:] == [1, 1, 1]
    assert left["loss_mask"][0] == 0  # a first token is never trained
    with pytest.raises(DataError, match=r"no assistant token is left after data\.truncation=right"):
        encode_example(tokenizer, long, max_length=10, truncation="right")


def test_bad_rows_name_the_file_row_and_column(tmp_path, tokenizer):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"prompt": "1+1="}) + "\n")
    with pytest.raises(DataError, match=r"sft.jsonl: row 1 \(line 2\): missing column 'response'"):
        SFTDataset(read_many(path), tokenizer)
    path.write_text(json.dumps({"messages": CHAT[:1]}) + "\n")
    with pytest.raises(DataError, match=r"row 0 .*no assistant message"):
        SFTDataset(read_many(path), tokenizer)
    path.write_text("")
    with pytest.raises(DataError, match=r"sft\.jsonl has no rows"):
        read_many(path)
    with pytest.raises(DataError, match="does not exist"):
        read_many(tmp_path / "missing.parquet")


def test_parquet_rows_with_null_message_keys_load(tmp_path, tokenizer):
    rows = [{"messages": CHAT}, {"messages": [{**CHAT[0], "name": "x"}, CHAT[1]]}]
    write_parquet(rows, tmp_path / "sft.parquet")  # the first row's messages read back with name=None
    data = SFTDataset(read_many(tmp_path / "sft.parquet"), tokenizer)
    assert data[0]["input_ids"] == tokenize_conversation(tokenizer, CHAT)[0]


def test_padding_and_packing_layouts():
    items = [
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
        {"input_ids": [4, 5], "loss_mask": [0, 1]},
        {"input_ids": [6, 7], "loss_mask": [0, 1]},
    ]
    padded = pad_batch(items, pad_token_id=0)
    assert padded["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0], [6, 7, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 0]]
    assert padded["position_ids"].tolist() == [[0, 1, 2], [0, 1, 1], [0, 1, 1]]
    packed = pack_batch(items, pad_token_id=0, max_length=4)
    assert packed["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    assert packed["segment_ids"].tolist() == [[1, 1, 1, 0], [1, 1, 2, 2]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 1]]
    assert packed["loss_mask"].tolist() == [[0, 1, 1, 0], [0, 1, 0, 1]]
