"""veRL's multimodal rows: an ``images`` column and ``<image>`` placeholders, read through a processor;
every bad image refused in one line naming the row and the image."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from tearless.data import DataError, PromptDataset, load_rows, write_parquet
from tearless.data import images as images_module
from tearless.data.images import image_messages
from tearless.data.inspection import inspect_file
from tearless.tasks import vlm_count


@pytest.fixture(scope="module")
def processor():
    return vlm_count.task_processor(vlm_count.task_tokenizer())


def png(size=(32, 32), colour=(255, 0, 0)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def row(images, content="<image>How many red?") -> dict:
    return {
        "data_source": "vlm_count",
        "prompt": [{"role": "user", "content": content}],
        "images": images,
        "reward_model": {"style": "rule", "ground_truth": "1"},
    }


def test_bytes_paths_and_strings_read_through_the_processor(tmp_path, processor):
    path = tmp_path / "blue.png"
    path.write_bytes(png(colour=(0, 0, 255)))
    write_parquet(
        [row([{"bytes": png()}]), row([{"path": str(path), "bytes": None}])], tmp_path / "mm.parquet"
    )
    rows = [*load_rows(tmp_path / "mm.parquet"), row([str(path)])]  # a path string: JSON lines, not parquet
    data = PromptDataset(rows, processor.tokenizer, processor=processor)
    tok = processor.tokenizer
    image_id = tok.convert_tokens_to_ids("<image>")
    for i in range(3):
        item = data[i]
        # <|user|> <fake> <global-img> 4 × <image> <fake> "How many red?" <|end|> <|assistant|>
        assert item["input_ids"].count(image_id) == vlm_count.IMAGE_SEQ_LEN == 4
        assert len(item["input_ids"]) == 1 + 2 + 4 + 1 + len("How many red?") + 2
        assert tuple(item["multi_modal_inputs"]["pixel_values"].shape) == (1, 3, 32, 32)
        assert "images" not in item
    red, blue = (data[i]["multi_modal_inputs"]["pixel_values"][0, :, 5, 5] for i in (0, 1))
    # Rescaled to [-1, 1] (mean and std 0.5): red is (1, -1, -1), blue (-1, -1, 1).
    assert red.tolist() == [1.0, -1.0, -1.0] and blue.tolist() == [-1.0, -1.0, 1.0]
    assert data[2]["multi_modal_inputs"]["pixel_values"].equal(data[1]["multi_modal_inputs"]["pixel_values"])


@pytest.mark.parametrize(
    "images, content, expected",
    [
        ([{"bytes": b"not a png"}], "<image>x", "row 1: images[0] (its bytes) is not a decodable image"),
        (
            [{"path": "/no/such/file.png"}],
            "<image>x",
            "row 1: images[0]: image file '/no/such/file.png' does not",
        ),
        (
            [{"bytes": png()}, {"bytes": png()}],
            "<image>x",
            "row 1: the prompt holds 1 <image> placeholders for 2",
        ),
        ([{"bytes": png()}], "no placeholder", "row 1: the prompt holds 0 <image> placeholders for 1"),
        (
            [{"bytes": png((64, 64))}],
            "<image>x",
            "row 1: images[0] (its bytes) is 64x64 pixels, more than the 1,024",
        ),
    ],
)
def test_a_bad_image_is_one_line_naming_the_row(images, content, expected, processor, monkeypatch):
    monkeypatch.setattr(images_module, "MAX_IMAGE_PIXELS", 32 * 32)
    rows = [row([{"bytes": png()}]), row(images, content)]
    with pytest.raises(DataError) as e:
        PromptDataset(rows, processor.tokenizer, processor=processor, source="f.parquet")
    assert str(e.value).startswith("f.parquet: " + expected) and "\n" not in str(e.value)


def test_images_without_a_vision_model_and_overlong_image_prompts_are_refused(processor):
    with pytest.raises(DataError, match=r"row 0 has images but actor_rollout_ref.model.path is not a vision"):
        PromptDataset([row([{"bytes": png()}])], processor.tokenizer, source="f")
    with pytest.raises(
        DataError, match=r"row 0 has a prompt of 23 tokens with images.*cut an image's tokens"
    ):
        PromptDataset(
            [row([{"bytes": png()}])], processor.tokenizer, processor=processor, source="f",
            max_prompt_length=20, truncation="left",
        )  # fmt: skip
    kept = PromptDataset(
        [row([{"bytes": png()}]), row([{"bytes": png()}], "<image>red?")], processor.tokenizer,
        processor=processor, max_prompt_length=20, filter_overlong_prompts=True,
    )  # fmt: skip
    assert len(kept) == 1 and kept.num_filtered == 1


@pytest.mark.parametrize("first_has_image", [True, False])
def test_a_text_only_row_among_image_rows_is_one_line_naming_both(processor, first_has_image):
    rows = [row([{"bytes": png()}]), row([], content="How many red?"), row([{"bytes": png()}])]
    if not first_has_image:
        rows = rows[1:]
    with pytest.raises(DataError) as e:
        PromptDataset(rows, processor.tokenizer, processor=processor, source="f.parquet")
    image_row, text_row = (0, 1) if first_has_image else (1, 0)
    assert str(e.value).startswith(f"f.parquet: row {text_row} has no image while row {image_row} has;")
    assert "\n" not in str(e.value)
    # for a text model the images are what is wrong, whichever row comes first
    with pytest.raises(DataError, match=r"row 1 has images but actor_rollout_ref.model.path is not a vision"):
        PromptDataset(
            [row([], content="How many red?"), row([{"bytes": png()}])], processor.tokenizer, source="f"
        )
    # a file of text rows only is read
    text_rows = [row([], content="How many?")] * 2
    assert len(PromptDataset(text_rows, processor.tokenizer, processor=processor)) == 2


def test_placeholders_become_verls_structured_content():
    messages = [{"role": "user", "content": "<image>Left <image> right"}, {"role": "system", "content": "hi"}]
    assert image_messages(messages) == [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "Left "},
                {"type": "image"},
                {"type": "text", "text": " right"},
            ],
        },
        {"role": "system", "content": [{"type": "text", "text": "hi"}]},
    ]


def test_inspect_reports_image_sizes_and_bad_images(tmp_path):
    path = tmp_path / "mm.parquet"
    rows = [
        row([{"bytes": png((32, 32))}]),
        row([{"bytes": png((40, 20))}, {"bytes": png((8, 8))}], "<image><image>"),
    ]
    other = row([{"bytes": png((32, 32), (0, 0, 255))}])  # row 0's text, another image: not a duplicate
    write_parquet([*rows, row([{"bytes": b"junk"}], "<image>junk"), other], path)
    report = inspect_file(path, num_rows=1)
    # Ordered by pixel count: 8x8 (64), 40x20 (800), 32x32 (1024) twice.
    assert "images: 4 in 3 rows; sizes smallest 8x8, median 32x32, largest 32x32" in report.text
    assert report.problems == [
        "images[0] (its bytes) is not a decodable image (no image format recognised): 1 rows (2)"
    ]
    assert '"images": [{"bytes": "<' in report.text  # an image's bytes are shown as their count
