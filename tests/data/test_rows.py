import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tearless.data import DataError, load_many, load_rows, write_jsonl, write_parquet

from .helpers import make_row


def sample_rows(n=3):
    return [
        make_row(
            f"{i}+{i}=",
            str(2 * i),
            extra_info={"split": "train", "index": i},
            prompt=[{"role": "system", "content": "Add."}, {"role": "user", "content": f"{i}+{i}="}],
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("name", ["rows.parquet", "rows.jsonl"])
def test_round_trip(tmp_path, name):
    rows = sample_rows()
    path = tmp_path / name
    (write_parquet if name.endswith("parquet") else write_jsonl)(rows, path)
    assert load_rows(path) == rows
    # The write went through a temporary file that is gone now.
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_parquet_struct_union_reads_missing_keys_as_none(tmp_path):
    rows = [make_row(extra_info={"a": 1}), make_row(extra_info={"b": "x"})]
    write_parquet(rows, tmp_path / "r.parquet")
    loaded = load_rows(tmp_path / "r.parquet")
    assert [r["extra_info"] for r in loaded] == [{"a": 1, "b": None}, {"a": None, "b": "x"}]


def test_write_overwrites_atomically(tmp_path):
    path = tmp_path / "sub" / "r.jsonl"
    write_jsonl(sample_rows(3), path)
    write_jsonl(sample_rows(1), path)
    assert len(load_rows(path)) == 1
    assert [p.name for p in path.parent.iterdir()] == ["r.jsonl"]


def test_write_parquet_mixed_types_is_a_clear_error(tmp_path):
    rows = [make_row(ground_truth="3"), make_row(ground_truth=[1, 2])]
    with pytest.raises(DataError, match="mixes value types"):
        write_parquet(rows, tmp_path / "r.parquet")
    assert not list(tmp_path.iterdir())


def test_write_nothing_is_refused(tmp_path):
    with pytest.raises(DataError, match="no rows"):
        write_jsonl([], tmp_path / "r.jsonl")


def test_missing_file_is_named(tmp_path):
    path = tmp_path / "nope.parquet"
    with pytest.raises(DataError, match=r"nope\.parquet' does not exist.*data\.train_files"):
        load_rows(path)


def test_unknown_extension(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("a,b\n")
    with pytest.raises(DataError, match=r"unknown file type '\.csv'.*\.parquet, \.jsonl, \.json"):
        load_rows(path)


def test_missing_column_names_file_row_line_and_columns(tmp_path):
    rows = sample_rows(3)
    del rows[1]["reward_model"]["ground_truth"]
    path = tmp_path / "rows.jsonl"
    write_jsonl(rows, path)
    with pytest.raises(DataError) as info:
        load_rows(path)
    message = str(info.value)
    assert str(path) in message
    assert "row 1 (line 2)" in message
    assert "missing column 'reward_model.ground_truth'; reward_model has keys ['style']" in message


def test_missing_column_in_parquet(tmp_path):
    rows = sample_rows(3)
    del rows[2]["data_source"]
    path = tmp_path / "rows.parquet"
    write_parquet(rows, path)
    # Parquet gives every row every column, so the gap reads back as None: still "missing".
    with pytest.raises(DataError, match=r"rows\.parquet: row 2: missing column 'data_source'"):
        load_rows(path)


@pytest.mark.parametrize("name", ["empty.jsonl", "blank.json", "empty.parquet"])
def test_empty_file(tmp_path, name):
    path = tmp_path / name
    path.write_text("\n  \n" if name.startswith("blank") else "")
    with pytest.raises(DataError, match=f"{name} has no rows"):
        load_rows(path)


def test_parquet_with_zero_rows(tmp_path):
    path = tmp_path / "zero.parquet"
    pq.write_table(pa.table({"data_source": pa.array([], pa.string())}), path)
    with pytest.raises(DataError, match=r"zero\.parquet has no rows"):
        load_rows(path)


def test_bad_json_line_is_named(tmp_path):
    path = tmp_path / "rows.jsonl"
    good = json.dumps(make_row())
    path.write_text(f"{good}\n\n{{'single': 'quotes'}}\n{good}\n")
    with pytest.raises(DataError, match=r"rows\.jsonl: line 3 is not valid JSON"):
        load_rows(path)


def test_line_numbers_skip_blank_lines(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(make_row()) + "\n\n" + json.dumps({"data_source": "x", "ability": "a"}) + "\n")
    with pytest.raises(
        DataError,
        match=r"row 1 \(line 3\): missing column 'prompt'; the row has columns "
        r"\['ability', 'data_source'\]",
    ):
        load_rows(path)


def test_string_prompt_becomes_one_user_message(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(
        json.dumps({"data_source": "arithmetic", "prompt": "1+2=", "reward_model": {"ground_truth": 3}})
    )
    (row,) = load_rows(path)
    assert row["prompt"] == [{"role": "user", "content": "1+2="}]
    assert row["reward_model"] == {"ground_truth": 3}


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        (["1+2="], r"prompt\[0\] must be a message"),
        ([{"role": "user"}], r"prompt\[0\] needs a string 'content'; the message has keys \['role'\]"),
        ([], "prompt must be a non-empty list of chat messages"),
        (3, "prompt must be a non-empty list"),
    ],
)
def test_bad_prompt(tmp_path, prompt, expected):
    path = tmp_path / "rows.jsonl"
    write_jsonl([make_row(), make_row(prompt=prompt)], path)
    with pytest.raises(DataError, match=r"row 1 \(line 2\): " + expected):
        load_rows(path)


def test_bad_types(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_jsonl([make_row(extra_info="oops")], path)
    with pytest.raises(DataError, match="extra_info must be a dict, got str"):
        load_rows(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(DataError, match=r"row 0 \(line 1\): expected an object with columns, got list"):
        load_rows(path)


def test_json_array_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(sample_rows(2), indent=2))
    assert load_rows(path) == sample_rows(2)


def test_load_many_concatenates_in_order(tmp_path):
    write_jsonl(sample_rows(2), tmp_path / "a.jsonl")
    write_parquet(sample_rows(3)[2:], tmp_path / "b.parquet")
    rows = load_many([str(tmp_path / "a.jsonl"), tmp_path / "b.parquet"])
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["0", "2", "4"]
    assert load_many(str(tmp_path / "a.jsonl")) == sample_rows(2)
    with pytest.raises(DataError, match="no data files"):
        load_many([])


@pytest.mark.parametrize("name", ["rows.parquet", "rows.jsonl"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_ground_truth_is_refused_naming_the_row(tmp_path, name, value):
    # A NaN or infinite answer can never be matched: every response to row 1 would score 0 silently.
    rows = [make_row("1+1=", 2.0), make_row("2+2=", value), make_row("3+3=", 6.0)]
    path = tmp_path / name
    (write_parquet if name.endswith("parquet") else write_jsonl)(rows, path)
    with pytest.raises(DataError) as info:
        load_rows(path)
    message = str(info.value)
    assert message.startswith(f"{path}: row 1") and f"ground_truth is {value}" in message


def test_a_non_finite_number_inside_a_ground_truth_is_refused_too(tmp_path):
    rows = [make_row("x", {"answers": [1.0, float("nan")]})]
    path = tmp_path / "rows.jsonl"
    write_jsonl(rows, path)
    with pytest.raises(DataError, match=r"row 0 \(line 1\): reward_model.ground_truth holds nan"):
        load_rows(path)
