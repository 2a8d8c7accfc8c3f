"""Bad dataset files and rows: a DataError naming the file, the row and the column, or a documented
skip with a count; never an exception from deep inside pyarrow, json or the tokenizer."""

from __future__ import annotations

import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tearless.data import DataError, PromptDataset, load_rows, normalize_row, write_jsonl
from tearless.models.loading import load_tokenizer
from tearless.tasks import arithmetic


@pytest.fixture(scope="module")
def tokenizer(task):
    return load_tokenizer(task.model_dir)


def _rows(n=3):
    return arithmetic.generate_rows(n, seed=0, split="x")


_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10), st.binary(max_size=5)
)
_json = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
_row = st.fixed_dictionaries(
    {},
    optional={
        "data_source": st.one_of(st.just("arithmetic"), _json),
        "prompt": st.one_of(
            st.text(max_size=20),
            st.lists(st.fixed_dictionaries({}, optional={"role": _json, "content": _json}), max_size=3),
            _json,
        ),
        "reward_model": st.one_of(st.fixed_dictionaries({}, optional={"ground_truth": _json}), _json),
        "extra_info": _json,
        "ability": _json,
    },
)


@settings(max_examples=int(os.environ.get("TEARLESS_FUZZ_EXAMPLES", "200")), deadline=None)
@given(row=st.one_of(_row, _json))
def test_any_row_is_normalised_or_refused_with_its_location(row):
    try:
        out = normalize_row(row, where="f.jsonl: row 7")
    except DataError as e:
        assert str(e).startswith("f.jsonl: row 7: "), str(e)
        return
    assert isinstance(out["data_source"], str) and out["data_source"]
    assert out["prompt"] and all(
        isinstance(m["role"], str) and isinstance(m["content"], str) for m in out["prompt"]
    )
    assert any(m["content"].strip() for m in out["prompt"])
    assert out["reward_model"]["ground_truth"] is not None


def test_non_utf8_jsonl_names_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = _rows(2)
    write_jsonl(good, path)
    path.write_bytes(path.read_bytes() + '{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(
        DataError, match=r"latin1\.jsonl: line 3 is not UTF-8 \(byte 0xe9 at offset \d+\).*iconv"
    ):
        load_rows(path)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda r: r.update(data_source=None), "missing column 'data_source'"),
        (lambda r: r.update(reward_model="3"), "missing column 'reward_model.ground_truth'"),
        (lambda r: r.update(reward_model={"style": "rule", "ground_truth": None}), "ground_truth"),
        (lambda r: r.update(prompt=["1+2="]), "prompt[0] must be a message"),
        (lambda r: r.update(prompt=[{"role": "user", "content": 12}]), "prompt[0] needs a string 'content'"),
        (lambda r: r.update(prompt=[{"role": "user", "content": "  "}]), "empty prompt"),
        (lambda r: r.update(prompt=""), "empty prompt"),
        (lambda r: r.update(prompt=[]), "non-empty list of chat messages"),
        (lambda r: r.update(extra_info=[1, 2]), "extra_info must be a dict"),
        (lambda r: r.update(data_source=""), "data_source must be a non-empty string"),
    ],
)
def test_a_bad_row_in_parquet_names_file_row_and_column(tmp_path, change, words):
    rows = _rows(3)
    change(rows[1])
    path = tmp_path / "bad.parquet"
    columns = {k: [r.get(k) for r in rows] for k in rows[0]}
    # One column per key, any Python type pyarrow can hold; mixed types go in as JSON-ish strings.
    try:
        pq.write_table(pa.table(columns), path)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        path = tmp_path / "bad.jsonl"
        write_jsonl(rows, path)
    with pytest.raises(DataError) as info:
        load_rows(path)
    assert str(path) in str(info.value) and "row 1" in str(info.value) and words in str(info.value)


def test_a_huge_row_is_refused_quickly_or_skipped_with_a_count(tokenizer):
    rows = _rows(3)
    rows[1]["prompt"] = [{"role": "user", "content": "1+" * 50_000 + "1="}]  # a 100 kB prompt
    started = time.perf_counter()
    with pytest.raises(
        DataError, match=r"row 1 has a prompt of \d+ tokens, longer than data.max_prompt_length=64"
    ):
        PromptDataset(rows, tokenizer, max_prompt_length=64)
    kept = PromptDataset(rows, tokenizer, max_prompt_length=64, filter_overlong_prompts=True)
    assert kept.num_filtered == 1 and [kept[i]["index"] for i in range(len(kept))] == [0, 2]
    cut = PromptDataset(rows, tokenizer, max_prompt_length=64, truncation="middle")
    assert len(cut[1]["input_ids"]) == 64
    assert time.perf_counter() - started < 30


def test_prompts_longer_than_every_limit_leave_nothing_and_say_so(tokenizer):
    with pytest.raises(DataError, match=r"all 3 rows are longer than data.max_prompt_length=2 tokens"):
        PromptDataset(_rows(3), tokenizer, max_prompt_length=2, filter_overlong_prompts=True)


def test_duplicate_rows_and_ids_are_kept_as_separate_prompts(tokenizer):
    # tearless gives each sampled prompt its own group id (step, round, position) at rollout time, so
    # duplicate rows, or rows whose extra_info repeats an index or a uid, are separate groups.
    row = _rows(1)[0]
    row["extra_info"] = {"index": 5, "uid": "same"}
    dataset = PromptDataset([row, dict(row), dict(row)], tokenizer, max_prompt_length=64)
    assert len(dataset) == 3 and [dataset[i]["index"] for i in range(3)] == [0, 1, 2]
    assert dataset[0]["input_ids"] == dataset[2]["input_ids"]
