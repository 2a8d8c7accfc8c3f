import pytest

from tearless.data import DataError, PromptDataset, render_prompt
from tearless.tasks.tokenizer import build_char_tokenizer

from .helpers import make_row

# "<|user|>abcdefghij<|end|><|assistant|>" is 13 tokens with the char tokenizer: one per role or
# end marker, one per letter.
LONG = "abcdefghij"


def test_chat_template_is_applied(tokenizer):
    ids = render_prompt(tokenizer, [{"role": "user", "content": "1+2="}])
    assert tokenizer.decode(ids) == "<|user|>1+2=<|end|><|assistant|>"
    assert len(ids) == 7
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|user|>")
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")


def test_plain_text_prompts_are_fed_as_they_are():
    tokenizer = build_char_tokenizer()
    # The char tokenizer adds no special tokens: 4 characters, 4 ids, no "user: … assistant:" around.
    ids = render_prompt(tokenizer, "1+2=")
    assert tokenizer.decode(ids) == "1+2=" and len(ids) == 4
    ds = PromptDataset([make_row(prompt="1+2=")], tokenizer)
    assert ds[0]["input_ids"] == ids
    assert ds[0]["raw_prompt"] == [{"role": "user", "content": "1+2="}]  # rewards still see messages


def test_chat_prompts_without_a_chat_template_are_refused_unless_one_is_given():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = None
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}]
    with pytest.raises(DataError, match=r"no chat template.*data\.chat_template"):
        render_prompt(tokenizer, messages)
    template = "{% for m in messages %}{{ m.content }};{% endfor %}"
    ids = render_prompt(tokenizer, messages, chat_template=template)
    assert tokenizer.decode(ids) == "Add.;1+2=;"


def test_prompts_with_unknown_tokens_are_counted():
    tokenizer = build_char_tokenizer()
    # "é" is not in the char tokenizer's vocabulary, so the second prompt holds its unknown token.
    ds = PromptDataset([make_row("1+2=", "3"), make_row("é+2=", "3")], tokenizer)
    assert ds.num_unknown == 1


def test_items(tokenizer):
    rows = [make_row("1+2=", "3"), make_row("5+5=", "10", extra_info=None, ability=None)]
    ds = PromptDataset(rows, tokenizer)
    assert len(ds) == 2
    first, second = ds[0], ds[1]
    assert first == {
        "input_ids": render_prompt(tokenizer, [{"role": "user", "content": "1+2="}]),
        "raw_prompt": [{"role": "user", "content": "1+2="}],
        "data_source": "arithmetic",
        "ground_truth": "3",
        "extra_info": {"split": "train"},
        "ability": "math",
        "index": 0,
    }
    assert [second[k] for k in ("ground_truth", "extra_info", "ability", "index")] == ["10", {}, None, 1]


def test_items_are_copies(tokenizer):
    ds = PromptDataset([make_row()], tokenizer)
    item = ds[0]
    item["input_ids"].append(0)
    item["raw_prompt"][0]["content"] = "changed"
    item["extra_info"]["split"] = "changed"
    assert len(ds[0]["input_ids"]) == 7
    assert ds[0]["raw_prompt"][0]["content"] == "1+2="
    assert ds[0]["extra_info"] == {"split": "train"}


@pytest.mark.parametrize(
    ("mode", "kept"),
    [
        ("left", "ghij<|end|><|assistant|>"),  # the last 6 tokens
        ("right", "<|user|>abcde"),  # the first 6
        ("middle", "<|user|>abj<|end|><|assistant|>"),  # first 3 + last 3
    ],
)
def test_truncation(tokenizer, mode, kept):
    full = render_prompt(tokenizer, [{"role": "user", "content": LONG}])
    assert len(full) == 13
    ds = PromptDataset([make_row("1+2"), make_row(LONG)], tokenizer, max_prompt_length=6, truncation=mode)
    ids = ds[1]["input_ids"]
    assert tokenizer.decode(ids) == kept
    expected = {"left": full[-6:], "right": full[:6], "middle": full[:3] + full[-3:]}[mode]
    assert ids == expected
    # A prompt within the limit (exactly 6 tokens) is untouched.
    assert tokenizer.decode(ds[0]["input_ids"]) == "<|user|>1+2<|end|><|assistant|>"


def test_truncation_middle_odd_limit(tokenizer):
    full = render_prompt(tokenizer, [{"role": "user", "content": LONG}])
    ds = PromptDataset([make_row(LONG)], tokenizer, max_prompt_length=5, truncation="middle")
    assert ds[0]["input_ids"] == full[:2] + full[-3:]


def test_overlong_is_an_error_by_default(tokenizer):
    rows = [make_row("1+2="), make_row(LONG)]
    with pytest.raises(DataError) as info:
        PromptDataset(rows, tokenizer, max_prompt_length=10, source="train.parquet")
    message = str(info.value)
    assert "train.parquet: row 1 has a prompt of 13 tokens" in message
    assert "data.max_prompt_length=10" in message
    assert "data.truncation=left|right|middle" in message
    assert "data.filter_overlong_prompts=true" in message


def test_filter_drops_and_counts(tokenizer):
    rows = [make_row("1+2="), make_row(LONG), make_row("2+2=", "4"), make_row(LONG + "k")]
    ds = PromptDataset(rows, tokenizer, max_prompt_length=10, filter_overlong_prompts=True)
    assert ds.num_filtered == 2
    assert len(ds) == 2
    # Items keep their row numbers in the original rows.
    assert [ds[i]["index"] for i in range(2)] == [0, 2]
    assert [ds[i]["ground_truth"] for i in range(2)] == ["3", "4"]


def test_filter_everything_is_an_error(tokenizer):
    with pytest.raises(DataError, match=r"all 2 rows are longer than data.max_prompt_length=5"):
        PromptDataset(
            [make_row(), make_row(LONG)], tokenizer, max_prompt_length=5, filter_overlong_prompts=True
        )


def test_bad_settings(tokenizer):
    with pytest.raises(DataError, match=r"data.truncation='cut' is not one of error, left, right, middle"):
        PromptDataset([make_row()], tokenizer, truncation="cut")
    with pytest.raises(DataError, match=r"data.max_prompt_length must be a positive integer, got 0"):
        PromptDataset([make_row()], tokenizer, max_prompt_length=0)
    with pytest.raises(DataError, match=r"train\.jsonl has no rows"):
        PromptDataset([], tokenizer, source="train.jsonl")


def test_rows_in_memory_are_checked(tokenizer):
    with pytest.raises(DataError, match=r"mem: row 0: missing column 'reward_model.ground_truth'"):
        PromptDataset([make_row(reward_model={"style": "rule"})], tokenizer, source="mem")
