"""Prompt datasets: rows rendered with the tokenizer's chat template, with a length policy.

The policy mirrors veRL's ``data.max_prompt_length``, ``data.truncation`` and
``data.filter_overlong_prompts``: an overlong prompt is an error by default, because silently cutting
a question usually cuts the part the reward depends on.

A chat template is checked once, before the first prompt is rendered (:func:`check_chat_template`):
``data.chat_template`` must be a string holding Jinja syntax (``123``, ``true`` or a file path
rendered every prompt to that literal text), and the template in use (the user's, or the one a
model directory brought: untrusted input) must render two probe conversations within
:data:`TEMPLATE_BUDGET_S` seconds in a child process, differently (a render that ignores the
messages trains on one constant prompt) and not to nothing.
"""

from __future__ import annotations

import copy
import json
import os
import re
import select
import signal
import time
from collections.abc import Sequence
from typing import Any

from tearless.data.images import render_image_prompt, row_images
from tearless.data.rows import DataError, normalize_row
from tearless.models.vision import prompt_inputs, prompt_pixels
from tearless.rollout.multiturn import cut_tokens

TRUNCATION_MODES = ("error", "left", "right", "middle")
# Seconds the first render of a chat template may take (two short conversations take milliseconds).
TEMPLATE_BUDGET_S = 10.0
_PROBES = (
    [{"role": "user", "content": "What is 17 + 25?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
)
_TEMPLATE_FILE = re.compile(r"\.(jinja2?|j2|tmpl|txt|template)$", re.IGNORECASE)


def check_chat_template(
    tokenizer: Any, chat_template: Any = None, template_kwargs: dict | None = None
) -> None:
    """Raise :class:`DataError` (one line naming the key and the fix) unless the chat template in use
    (``chat_template``, the user's ``data.chat_template``, or else the tokenizer's own) is a Jinja
    template that renders two different probe conversations to two different, non-empty texts within
    :data:`TEMPLATE_BUDGET_S` seconds (see the module docs)."""
    if chat_template is not None:
        key = "data.chat_template"
        if not isinstance(chat_template, str):
            raise DataError(
                f"{key} must be a Jinja template (a string), got {type(chat_template).__name__}: "
                f"{chat_template!r:.60}; give the template's text, or null for the tokenizer's own"
            )
        if "{{" not in chat_template and "{%" not in chat_template:
            text = chat_template.strip()
            if "\n" not in text and (os.path.exists(text) or _TEMPLATE_FILE.search(text) or os.sep in text):
                raise DataError(
                    f"{key}={text!r} is a file path, not a template: pass the file's content, e.g. "
                    f'{key}="$(cat {text})" on the command line (in YAML, the template text itself)'
                )
            raise DataError(
                f"{key}={text[:60]!r} is not a Jinja template (no {{{{ }}}} or {{% %}}): every prompt "
                "would render to that text. Give the template itself, or null for the tokenizer's own"
            )
    else:
        key = "the tokenizer's chat template"
    outcome = _probe_in_child(tokenizer, chat_template, template_kwargs or {})
    if "timeout" in outcome:
        raise DataError(
            f"{key} did not render two short probe conversations within {TEMPLATE_BUDGET_S:g} s (a loop "
            "that never ends?); a model directory's template is untrusted input. Fix the template, or "
            "give a working one with data.chat_template"
        )
    if "error" in outcome:
        raise DataError(
            f"{key} does not render: {outcome['error']}; fix it, or give one with data.chat_template"
        )
    if not outcome["nonempty"]:
        raise DataError(f"{key} renders nothing for a conversation; give a template that writes the messages")
    if outcome["same"]:
        raise DataError(
            f"{key} renders the same text whatever the messages ({outcome['head']!r}), so every prompt "
            "would be that text; give a template that writes the messages (e.g. loops over messages)"
        )


def check_vocabulary(tokenizer: Any, model_path: str, key: str) -> None:
    """Raise :class:`DataError` when the tokenizer has more tokens than the model's embedding has rows
    (``vocab_size`` of the model directory's ``config.json``): an id past them would index outside
    it, or the ids the tokenizer adds would never be trained. A model bigger than its tokenizer
    (padded vocabularies) is fine; a model not on this machine is not checked."""
    config = os.path.join(str(model_path), "config.json")
    try:
        with open(config) as f:
            vocab = json.load(f).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(vocab, int) and not isinstance(vocab, bool) and len(tokenizer) > vocab:
        raise DataError(
            f"{key}: the tokenizer has {len(tokenizer)} tokens but the model's embedding has {vocab} "
            f"(vocab_size in {config}); ids from {vocab} on would index past it. Use the model's own "
            "tokenizer (drop actor_rollout_ref.model.tokenizer_path), or a model whose vocabulary fits it"
        )


def check_same_tokenizer(student: Any, teacher: Any, key: str) -> None:
    """Raise :class:`DataError` unless ``teacher`` maps every token to the id ``student`` does and
    has the same special tokens (BOS, EOS, UNK and the set of all special tokens): a teacher's
    log-prob is read at the student's token id, so another vocabulary would score other tokens.
    The pad token is not compared (masks travel with the batch, the pad id is never scored)."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    differ = sorted(t for t in mine.keys() | theirs.keys() if mine.get(t) != theirs.get(t))
    if differ:
        t = differ[0]
        raise DataError(
            f"{key}: the teacher's tokenizer is not the student's ({len(differ)} of {len(mine)} tokens "
            f"differ, e.g. {t!r}: id {mine.get(t)} for the student, {theirs.get(t)} for the teacher), so "
            "its log-probs would score other tokens. Use a teacher with the student's tokenizer"
        )
    for name in ("bos_token", "eos_token", "unk_token"):
        if getattr(student, name) != getattr(teacher, name):
            raise DataError(
                f"{key}: the teacher's {name} is {getattr(teacher, name)!r}, the student's "
                f"{getattr(student, name)!r}. Use a teacher with the student's tokenizer"
            )
    extra = set(student.all_special_tokens) ^ set(teacher.all_special_tokens)
    extra -= {student.pad_token, teacher.pad_token}
    if extra:
        raise DataError(
            f"{key}: the teacher's special tokens differ from the student's ({', '.join(sorted(extra))} in "
            "one only). Use a teacher with the student's tokenizer"
        )


def _probe_in_child(tokenizer: Any, chat_template: str | None, kwargs: dict) -> dict:
    """Render :data:`_PROBES` in a forked child, killed after :data:`TEMPLATE_BUDGET_S` seconds:
    Jinja runs Python that cannot be interrupted from another thread. Returns ``{"timeout": True}``,
    ``{"error": why}`` or ``{"same": …, "nonempty": …, "head": …}``."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render, write one JSON line, exit without running the parent's cleanup
        try:
            os.close(read_end)
            try:
                texts = [
                    tokenizer.apply_chat_template(
                        p, chat_template=chat_template, add_generation_prompt=True, tokenize=False, **kwargs
                    )
                    for p in _PROBES
                ]
                if not all(isinstance(t, str) for t in texts):
                    raise TypeError(f"it rendered {type(texts[0]).__name__}, not text")
                result = {
                    "same": texts[0] == texts[1],
                    "nonempty": bool(texts[0].strip()),
                    "head": texts[0][:60],
                }
            except Exception as e:  # anything the template raises is the user's error to read
                first = next(iter(str(e).strip().splitlines()), "")
                result = {"error": f"{type(e).__name__}: {first[:200]}"}
            os.write(write_end, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    chunks = []
    deadline = time.monotonic() + TEMPLATE_BUDGET_S
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                return {"timeout": True}
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        return {"error": "the render's process died"}


def render_prompt(
    tokenizer: Any,
    messages: str | Sequence[dict],
    *,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of a prompt, as TRL and veRL feed it to the model.

    A plain-text prompt (a string) is encoded as it is, with the tokenizer's usual special tokens (a
    BOS token, for tokenizers that add one): no template is invented around it. Chat messages go
    through ``apply_chat_template(messages, add_generation_prompt=True)`` with ``chat_template`` (the
    user's ``data.chat_template``) or else the tokenizer's own, and ``template_kwargs``
    (``data.apply_chat_template_kwargs``). Messages for a tokenizer without a chat template raise
    :class:`DataError`: a base model has no conversation format to guess.
    """
    if isinstance(messages, str):
        return list(tokenizer.encode(messages))
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            "the prompts are chat messages but the tokenizer has no chat template. Give one with "
            "data.chat_template='<jinja template>' (veRL: actor_rollout_ref.model.custom_chat_template), "
            "use a chat model, or write the prompt column as plain text (a string per row), which is fed "
            "to the model as it is"
        )
    # transformers 5 returns a BatchEncoding unless return_dict=False; 4.x returns the list already.
    ids = tokenizer.apply_chat_template(
        list(messages),
        chat_template=chat_template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **(template_kwargs or {}),
    )
    return list(ids)


def truncate(ids: list[int], max_length: int, mode: str) -> list[int]:
    """Cut ``ids`` to ``max_length`` (:func:`~tearless.rollout.multiturn.cut_tokens`): ``left`` keeps the
    tail, ``right`` the head, ``middle`` both ends.

    ``middle`` keeps the first ``max_length // 2`` tokens and the last ``max_length - max_length // 2``,
    so the instruction at the start and the question at the end both survive.
    """
    if len(ids) > max_length and mode not in ("left", "right", "middle"):
        raise DataError(f"data.truncation={mode!r} cannot cut a prompt; use one of left, right, middle")
    return cut_tokens(ids, max_length, mode)


class PromptDataset:
    """Rows tokenised once at construction; ``dataset[i]`` is a fresh dict for prompt ``i``.

    Each item has ``input_ids`` (list[int], no padding), ``raw_prompt`` (the chat messages),
    ``data_source``, ``ground_truth`` (``reward_model.ground_truth``), ``extra_info`` (dict, ``{}``
    when the row has none), ``ability`` (``None`` when absent) and ``index``: the row's number in
    ``rows``, which stays the same when overlong rows are filtered out.

    Args:
        rows: rows in veRL's schema (see :mod:`tearless.data.rows`); checked again here, so rows built
            in memory get the same errors as rows read from a file.
        tokenizer: a Hugging Face tokenizer; see :func:`render_prompt`, which also takes
            ``chat_template`` and ``template_kwargs``. ``num_unknown`` counts the prompts whose ids hold
            the tokenizer's unknown token.
        max_prompt_length: the longest prompt in tokens (``data.max_prompt_length``).
        truncation: what to do with a longer prompt (``data.truncation``): ``error`` (raise),
            ``left``, ``right`` or ``middle`` (see :func:`truncate`).
        filter_overlong_prompts: drop overlong rows instead (``data.filter_overlong_prompts``); how
            many were dropped is in ``num_filtered``.
        source: names the rows in error messages, e.g. the file they came from.
        processor: a vision-language model's processor (:func:`tearless.models.vision.load_processor`),
            for rows with images (the ``image_key`` column, :mod:`tearless.data.images`): their ids
            come from it, each ``<image>`` expanded into the image's tokens, and their item adds
            ``multi_modal_inputs``, the prompt's pixel inputs, computed when the item is taken (so a
            dataset of large images holds the decoded images, not their tensors), and
            ``multi_modal_prompt``, what vLLM takes for it (``{"prompt": text with one placeholder per
            image, "multi_modal_data": {"image": [decoded images]}}``). A row with images and no
            processor raises :class:`DataError`.
    """

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer: Any,
        *,
        max_prompt_length: int = 512,
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        source: str = "<rows>",
        chat_template: str | None = None,
        template_kwargs: dict | None = None,
        processor: Any = None,
        image_key: str = "images",
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise DataError(f"data.truncation={truncation!r} is not one of {', '.join(TRUNCATION_MODES)}")
        if (
            isinstance(max_prompt_length, bool)
            or not isinstance(max_prompt_length, int)
            or max_prompt_length < 1
        ):
            raise DataError(f"data.max_prompt_length must be a positive integer, got {max_prompt_length!r}")
        if not rows:
            raise DataError(f"{source} has no rows")
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.num_filtered = 0
        # Prompts holding the tokenizer's unknown token (the text has characters its vocabulary lacks).
        self.num_unknown = 0
        self.processor = processor
        unk = getattr(tokenizer, "unk_token_id", None)
        self._items: list[dict] = []
        checked = False
        first_of_kind: dict[bool, int] = {}  # text-only (True) / with images (False) -> its first row
        for index, row in enumerate(rows):
            # A string prompt is plain text, fed as is; normalize_row makes it a user message for the
            # rest of the pipeline (rewards, records) and keeps the text in prompt_text.
            row = normalize_row(row, where=f"{source}: row {index}")
            if (
                not checked
                and not row.get("prompt_text")
                and (chat_template is not None or getattr(tokenizer, "chat_template", None) is not None)
            ):
                check_chat_template(tokenizer, chat_template, template_kwargs)
                checked = True
            where = f"{source}: row {index}"
            images = row_images(row, where, image_key)
            if processor is not None:  # without one, a row with images is refused by _image_prompt_ids
                first_of_kind.setdefault(images is None, index)
                if len(first_of_kind) > 1:
                    image_row, text_row = first_of_kind[False], first_of_kind[True]
                    raise DataError(
                        f"{source}: row {text_row} has no image while row {image_row} has; a file of a "
                        "vision-language run holds images in every row (mixing text-only rows is not "
                        "supported yet): give each row its image, or train the text rows in a run of "
                        "their own"
                    )
            if images is not None:
                text, ids = self._image_prompt_ids(
                    row, images, where, tokenizer, chat_template, template_kwargs
                )
            else:
                ids = render_prompt(
                    tokenizer,
                    row.get("prompt_text") or row["prompt"],
                    chat_template=chat_template,
                    template_kwargs=template_kwargs,
                )
            self.num_unknown += unk is not None and unk in ids
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if truncation == "error":
                    raise DataError(
                        f"{source}: row {index} has a prompt of {len(ids)} tokens, longer than "
                        f"data.max_prompt_length={max_prompt_length}. Raise data.max_prompt_length, set "
                        "data.truncation=left|right|middle to cut it, or data.filter_overlong_prompts=true "
                        "to drop such rows"
                    )
                if images is not None:
                    raise DataError(
                        f"{where} has a prompt of {len(ids)} tokens with images, longer than "
                        f"data.max_prompt_length={max_prompt_length}, and cutting it would cut an image's "
                        "tokens. Raise data.max_prompt_length or set data.filter_overlong_prompts=true"
                    )
                ids = truncate(ids, max_prompt_length, truncation)
            item = {
                "input_ids": ids,
                "raw_prompt": row["prompt"],
                "data_source": row["data_source"],
                "ground_truth": row["reward_model"]["ground_truth"],
                "extra_info": row.get("extra_info") or {},
                "ability": row.get("ability"),
                "index": index,
            }
            self._items.append(item if images is None else {**item, "images": images, "image_text": text})
        if not self._items:
            raise DataError(
                f"{source}: all {len(rows)} rows are longer than data.max_prompt_length={max_prompt_length} "
                "tokens and were filtered out; raise data.max_prompt_length or set "
                "data.filter_overlong_prompts=false with a data.truncation mode"
            )

    def _image_prompt_ids(
        self,
        row: dict,
        images: list[Any],
        where: str,
        tokenizer: Any,
        chat_template: str | None,
        template_kwargs: dict | None,
    ) -> tuple[str, list[int]]:
        """A prompt with images: its text rendered with one placeholder per image, and its ids (the
        placeholders expanded by the processor)."""
        if self.processor is None:
            raise DataError(
                f"{where} has images but actor_rollout_ref.model.path is not a vision-language model (it "
                "has no image processor); use an image-text-to-text model, or drop the images column"
            )
        text = render_image_prompt(
            self.processor,
            tokenizer,
            row["prompt"],
            chat_template=chat_template,
            template_kwargs=template_kwargs,
        )
        return text, prompt_inputs(self.processor, text, images)[0]

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict:
        item = self._items[i]
        if "images" in item:  # the pixels of a row with images, made now (see the class docs)
            pixels = prompt_pixels(self.processor, item["images"])
            engine = {"prompt": item["image_text"], "multi_modal_data": {"image": list(item["images"])}}
            item = {k: v for k, v in item.items() if k not in ("images", "image_text")}
            return {**self._copy(item), "multi_modal_inputs": pixels, "multi_modal_prompt": engine}
        return self._copy(item)

    @staticmethod
    def _copy(item: dict) -> dict:
        # A copy, so a caller that edits a batch in place (appending response ids, say) cannot change
        # what the next epoch sees; strings are immutable and need no copying.
        return {
            **item,
            "input_ids": list(item["input_ids"]),
            "raw_prompt": [dict(m) for m in item["raw_prompt"]],
            "ground_truth": copy.deepcopy(item["ground_truth"]),
            "extra_info": copy.deepcopy(item["extra_info"]),
        }
