"""The embedded visual task: count the squares of one colour in a picture the package draws.

An image is a 4 × 4 grid of 8-pixel cells (32 × 32 pixels) on white, with 1 to :data:`MAX_COUNT`
red squares and as many as 1 to :data:`MAX_COUNT` blue ones in distinct cells; the prompt is one
user message ``"<image>How many red?"`` (or blue) and the correct response is the count, one digit,
then the end-of-turn token. The reward is 1.0 for the right count and 0.0 otherwise, so accuracy and
mean reward are the same number. The rows are veRL's multimodal format: an ``images`` column with
the PNG's bytes and an ``<image>`` placeholder in the prompt.

The warm-up imitates a flawed teacher (:func:`flawed_teacher`) that undercounts by one, with
probability ``forget``, any count of :data:`HARD_FROM` or more: the warmed-up model answers those
greedily wrong while still sampling the right count some of the time, the room GRPO exploits.

The policy is a tiny Idefics3 (SmolVLM's architecture), randomly initialised from a transformers
config: a one-layer SigLIP-style vision encoder whose 8-pixel patches are the grid's cells, the
connector's pixel shuffle (2 × 2 patches per image token, 4 image tokens), and a Llama language
model over the character-level tokenizer of :mod:`tearless.tasks.tokenizer` with Idefics3's image
tokens added.
"""

from __future__ import annotations

import io
import random
import re
from typing import Any

import torch

from tearless.tasks.tokenizer import build_char_tokenizer

DATA_SOURCE = "vlm_count"
GRID, CELL = 4, 8
SIZE = GRID * CELL
MAX_COUNT = 6
HARD_FROM = 4  # the teacher undercounts counts from here on
COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220)}
# Idefics3's processor tokens: the image placeholder, the marks around an image, the turn's end.
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
PATCH, SCALE = 8, 2  # the vision encoder's patch (one cell) and the connector's pixel shuffle
IMAGE_SEQ_LEN = (SIZE // PATCH) ** 2 // SCALE**2
HIDDEN_SIZE = 64  # the language model's width: half the text tasks' 128 (task.hidden_size is not read)

# The character tokenizer's template, also over veRL's structured content ([{"type": "image"},
# {"type": "text", "text": ...}]), which the processor's chat template is given.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
_ANSWER = re.compile(r"^\s*(\d+)\s*$")


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 when the response is exactly the count ``ground_truth`` (spaces aside), else 0.0."""
    match = _ANSWER.match(solution_str)
    return 1.0 if match is not None and int(match.group(1)) == int(str(ground_truth).strip()) else 0.0


def draw(cells: dict[int, str]) -> bytes:
    """The PNG bytes of the grid with ``cells`` (cell index 0–15, row-major → colour name) filled."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for cell, colour in cells.items():
        x, y = (cell % GRID) * CELL, (cell // GRID) * CELL
        pen.rectangle([x + 1, y + 1, x + CELL - 2, y + CELL - 2], fill=COLOURS[colour])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def make_problem(rng: random.Random) -> tuple[dict[int, str], str]:
    """A random layout (1 to MAX_COUNT squares of each colour in distinct cells) and the asked colour."""
    counts = {c: rng.randint(1, MAX_COUNT) for c in COLOURS}
    places = rng.sample(range(GRID * GRID), sum(counts.values()))
    cells = {}
    for colour, count in counts.items():
        for _ in range(count):
            cells[places.pop()] = colour
    return cells, rng.choice(sorted(COLOURS))


def to_row(cells: dict[int, str], colour: str, split: str, index: int) -> dict:
    """A veRL multimodal row: the image's bytes in ``images``, an ``<image>`` placeholder in the prompt."""
    count = sum(1 for c in cells.values() if c == colour)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"<image>How many {colour}?"}],
        "images": [{"bytes": draw(cells)}],
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": str(count)},
        "extra_info": {"split": split, "index": index, "count": count, "colour": colour},
    }


def generate_rows(num: int, *, seed: int, split: str, exclude: set | None = None) -> tuple[list[dict], set]:
    """``num`` distinct problems, none of them in ``exclude``; returns the rows and the problems seen."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    rows: list[dict] = []
    while len(rows) < num:
        cells, colour = make_problem(rng)
        key = (tuple(sorted(cells.items())), colour)
        if key in seen:
            continue
        seen.add(key)
        rows.append(to_row(cells, colour, split, len(rows)))
    return rows, seen


def task_rows(spec: Any) -> tuple[list[dict], list[dict]]:
    """The training and held-out rows of ``spec`` (a :class:`~tearless.tasks.bootstrap.TaskSpec`);
    no problem (layout and colour) is in both."""
    val_rows, held_out = generate_rows(spec.num_val, seed=spec.seed * 1000 + 1, split="test")
    train_rows, _ = generate_rows(spec.num_train, seed=spec.seed * 1000 + 2, split="train", exclude=held_out)
    return train_rows, val_rows


def flawed_teacher(row: dict, rng: random.Random, forget: float) -> str:
    """The warm-up's demonstration: the count, one too few with probability ``forget`` when it is
    :data:`HARD_FROM` or more."""
    count = row["extra_info"]["count"]
    return str(count - 1 if count >= HARD_FROM and rng.random() < forget else count)


def task_tokenizer() -> Any:
    """The character-level tokenizer with Idefics3's image tokens added as special tokens."""
    from tokenizers import AddedToken

    tok = build_char_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def task_processor(tokenizer: Any) -> Any:
    """Idefics3's processor over ``tokenizer``: no image splitting, images resized to 32 pixels, 4
    image tokens each (PIL image processor: no torchvision needed)."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    size = {"longest_edge": SIZE}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=size, max_image_size=size)
    return Idefics3Processor(images, tokenizer, image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)


def task_model(
    tokenizer: Any, *, num_layers: int, seed: int, hidden_size: int = HIDDEN_SIZE
) -> torch.nn.Module:
    """The randomly initialised tiny Idefics3 for ``tokenizer`` (see the module docs)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig

    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    vision = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, image_size=SIZE,
        patch_size=PATCH,
    )  # fmt: skip
    config = Idefics3Config(
        vision_config=vision,
        text_config=text.to_dict(),
        scale_factor=SCALE,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Idefics3ForConditionalGeneration(config)
