"""Chat templates are checked before a prompt is rendered (issue 33, items 3 and 5).

``data.chat_template=123``, ``=true`` or ``=templates/chat.jinja`` (a path: the natural mistake) trained
on one constant prompt, silently: every prompt rendered to that literal text. A template from a model
directory (untrusted input) with nested loops hung tokenisation forever. Now the template's type and
form are checked, its first render (two probe conversations) runs in a child process under a time
budget, and a template whose render ignores the messages, renders nothing or does not compile is one
:class:`DataError` naming the key and the fix.
"""

from __future__ import annotations

import time

import pytest

from tearless.data import prompts
from tearless.data.prompts import PromptDataset
from tearless.data.rows import DataError
from tearless.tasks.tokenizer import build_char_tokenizer
from tests.data.helpers import make_row

ROWS = [make_row("1+2=", "3"), make_row("2+2=", "4")]


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (123, r"data\.chat_template must be a Jinja template \(a string\), got int: 123"),
        (True, r"data\.chat_template must be a Jinja template \(a string\), got bool: True"),
        ("123", r"data\.chat_template='123' is not a Jinja template"),
        ("True", r"data\.chat_template='True' is not a Jinja template"),
        ("{{ 'You are helpful.' }}", r"data\.chat_template renders the same text whatever the messages"),
        ("{% for m in messages %}{% endfor %}", r"data\.chat_template renders nothing"),
        (
            "{% for m in messages %}{{ m.content }",
            r"data\.chat_template does not render: TemplateSyntaxError",
        ),
        ("{{ messages.__class__.__mro__ }}", r"data\.chat_template does not render: SecurityError"),
    ],
)
def test_a_value_that_is_not_a_working_template_is_refused(tokenizer, template, message):
    with pytest.raises(DataError, match=message) as info:
        PromptDataset(ROWS, tokenizer, chat_template=template)
    assert "\n" not in str(info.value)


def test_a_path_given_as_the_template_is_detected(tokenizer, tmp_path, monkeypatch):
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "chat.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    monkeypatch.chdir(tmp_path)
    for value in ("templates/chat.jinja", str(tmp_path / "templates" / "chat.jinja"), "missing/chat.jinja"):
        with pytest.raises(
            DataError, match=r"is a file path, not a template: pass the file's content"
        ) as info:
            PromptDataset(ROWS, tokenizer, chat_template=value)
        assert f'data.chat_template="$(cat {value})"' in str(info.value)


def test_a_template_that_hangs_is_stopped_within_its_budget(monkeypatch):
    tokenizer = build_char_tokenizer()
    # A model directory's own template (untrusted input): 10^10 iterations.
    tokenizer.chat_template = (
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    monkeypatch.setattr(prompts, "TEMPLATE_BUDGET_S", 3.0)
    started = time.monotonic()
    with pytest.raises(DataError, match=r"the tokenizer's chat template did not render .* within 3 s"):
        PromptDataset(ROWS, tokenizer)
    assert time.monotonic() - started < 60


def test_a_working_template_renders_every_row(tokenizer):
    template = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    ds = PromptDataset(ROWS, tokenizer, chat_template=template)
    assert tokenizer.decode(ds[0]["input_ids"]) == "[user] 1+2=>"
    assert tokenizer.decode(ds[1]["input_ids"]) == "[user] 2+2=>"


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    """Issue 33, item 10: a tokenizer with more tokens than the model's embedding trained silently."""
    from tearless.data.prompts import check_vocabulary

    tokenizer = build_char_tokenizer(extra_tokens=[f"<t{i}>" for i in range(20)])
    (tmp_path / "config.json").write_text(f'{{"vocab_size": {len(tokenizer) - 1}}}')
    with pytest.raises(DataError, match=rf"has {len(tokenizer)} tokens but the model's embedding has"):
        check_vocabulary(tokenizer, str(tmp_path), "actor_rollout_ref.model.tokenizer_path")
    (tmp_path / "config.json").write_text(f'{{"vocab_size": {len(tokenizer) + 60}}}')  # padded: fine
    check_vocabulary(tokenizer, str(tmp_path), "actor_rollout_ref.model.tokenizer_path")
