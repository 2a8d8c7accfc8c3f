"""Preference pairs: both sides share the prompt, masks cover the responses, errors name the row."""

from __future__ import annotations

import json

import pytest

from tearless.data import DataError, write_parquet
from tearless.data.pairs import PairDataset, collate_pairs
from tearless.data.sft import read_many

ROW = {"prompt": "47+38=", "chosen": "7+8=15, 85", "rejected": "7+8=15, 75"}


def test_each_side_is_prompt_plus_response_with_the_response_trained(tokenizer):
    item = PairDataset([ROW], tokenizer)[0]
    for side, text in (("chosen", ROW["chosen"]), ("rejected", ROW["rejected"])):
        ids, mask = item[f"{side}_ids"], item[f"{side}_mask"]
        # <|user|> 4 7 + 3 8 = <|end|> <|assistant|>: 9 prompt tokens, then 10 characters and <|end|>.
        assert mask == [0] * 9 + [1] * 11
        assert tokenizer.decode(ids[9:]) == text + "<|end|>"
    assert item["chosen_ids"][:9] == item["rejected_ids"][:9]


def test_message_lists_equal_strings_and_assistant_turns_in_the_prompt_are_context(tokenizer):
    as_messages = {
        "prompt": [{"role": "user", "content": "47+38="}],
        "chosen": [{"role": "assistant", "content": ROW["chosen"]}],
        "rejected": [{"role": "assistant", "content": ROW["rejected"]}],
    }
    assert PairDataset([as_messages], tokenizer)[0] == PairDataset([ROW], tokenizer)[0]
    multi = {**ROW, "prompt": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    item = PairDataset([multi], tokenizer)[0]
    assert sum(item["chosen_mask"]) == len(ROW["chosen"]) + 1  # the prompt's "2<|end|>" is not trained


def test_collate_puts_chosen_rows_first_in_pair_order(tokenizer):
    rows = [ROW, {"prompt": "1+1=", "chosen": "2", "rejected": "11"}]
    data = PairDataset(rows, tokenizer)
    batch = collate_pairs([data[0], data[1]], pad_token_id=tokenizer.pad_token_id)
    assert batch["input_ids"].shape[0] == 4
    assert batch["loss_mask"].sum(-1).tolist() == [11, 2, 11, 3]


def test_a_missing_chosen_column_names_the_file_row_and_column(tmp_path, tokenizer):
    path = tmp_path / "pairs.jsonl"
    bad = {"prompt": "1+1=", "rejected": "3"}
    path.write_text(json.dumps(ROW) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError) as err:
        PairDataset(read_many(path), tokenizer)
    message = str(err.value)
    assert "pairs.jsonl: row 1 (line 3): missing column 'chosen'" in message
    assert "['prompt', 'rejected']" in message and "data.chosen_key" in message


def test_other_bad_input(tmp_path, tokenizer):
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.parquet has no rows"):
        read_many(empty)
    write_parquet([{**ROW, "chosen": [{"role": "user", "content": "hi"}]}], tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p.parquet: row 0: column 'chosen' has no assistant message"):
        PairDataset(read_many(tmp_path / "p.parquet"), tokenizer)
    with pytest.raises(DataError, match=r"row 0: column 'rejected' must be"):
        PairDataset([{**ROW, "rejected": 3}], tokenizer)
    with pytest.raises(DataError, match=r"row 0 \(rejected\): 20 tokens, longer than data.max_length=19"):
        PairDataset([{**ROW, "chosen": "85"}], tokenizer, max_length=19)


def test_unpaired_rows_and_pairs_give_labelled_examples_with_a_kl_partner(tokenizer):
    from tearless.data.pairs import UnpairedDataset, side_lengths

    rows = [
        {"prompt": "1+1=", "completion": "2", "label": True},
        {"prompt": "2+2=", "completion": "5", "label": False},
        ROW,  # a pair: two examples, chosen desirable, rejected undesirable
    ]
    data = UnpairedDataset(rows, tokenizer, kl_seed=3)
    assert len(data) == 4
    assert [data[i]["label"] for i in range(4)] == [True, False, True, False]
    # <|user|> 1 + 1 = <|end|> <|assistant|>: 7 prompt tokens, then "2" and <|end|>.
    assert data[0]["completion_mask"] == [0] * 7 + [1, 1]
    assert side_lengths([data[i] for i in range(4)], "completion").tolist() == [2, 2, 11, 11]
    # Every KL sequence is its own prompt followed by another example's response, and the partners
    # form one cycle: each response is borrowed exactly once.
    borrowed = []
    for i in range(4):
        item = data[i]
        prompt = item["completion_ids"][: item["completion_mask"].index(1)]
        assert item["kl_ids"][: len(prompt)] == prompt
        response = item["kl_ids"][len(prompt) :]
        owners = [j for j in range(4) if j != i and data[j]["completion_ids"][-len(response) :] == response]
        assert owners, i
        borrowed.append(tokenizer.decode(response))
    assert sorted(borrowed) == sorted(
        ["2<|end|>", "5<|end|>", ROW["chosen"] + "<|end|>", ROW["rejected"] + "<|end|>"]
    )


def test_unpaired_errors_name_the_row(tokenizer):
    from tearless.data.pairs import UnpairedDataset

    with pytest.raises(DataError, match=r"row 0: column 'label' is 'yes'; a KTO label is true"):
        UnpairedDataset([{"prompt": "1+1=", "completion": "2", "label": "yes"}, ROW], tokenizer)
    with pytest.raises(
        DataError,
        match=r"row 0: missing column 'completion'; the row has columns \['label', 'prompt'\]\. An unpaired",
    ):
        UnpairedDataset([{"prompt": "1+1=", "label": True}, ROW], tokenizer)
    with pytest.raises(DataError, match="KTO needs at least 2 examples"):
        UnpairedDataset([{"prompt": "1+1=", "completion": "2", "label": True}], tokenizer)
