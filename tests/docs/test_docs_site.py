"""The docs site's generated pages and its structure: every config key documented, every page in the nav."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tearless.reference import (
    CLI_MARKER,
    CONFIG_MARKER,
    FORMULAS_MARKER,
    _cell,
    cli_reference,
    config_reference,
    render,
    rst_to_markdown,
    schema_keys,
    schemas,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _table_rows(markdown: str) -> dict[str, tuple[str, str]]:
    """``| `key` | `default` | meaning |`` rows → {key: (default, meaning)}."""
    rows = {}
    for line in markdown.splitlines():
        found = re.match(r"\| `([^`]+)` \| `([^`]*)` \| (.*) \|$", line)
        if found:
            rows.setdefault(found.group(1), (found.group(2), found.group(3)))
    return rows


def test_the_config_page_documents_every_key_of_every_schema_with_its_default():
    page = render((DOCS / "config.md").read_text())
    assert CONFIG_MARKER not in page
    for title, _, schema in schemas():
        section = page[page.index(f"## {title}\n") :]
        rows = _table_rows(section)
        keys = list(schema_keys(schema))
        assert len(keys) > 10, title
        for key, field, _ in keys:
            assert key in rows, f"{title}: {key} missing from the config page"
            assert rows[key][1] == _cell(field.metadata["help"]), key
    rl = _table_rows(page[page.index("## RL trainer\n") :])
    # Defaults as YAML writes them, hand-checked against tearless/config/schema.py.
    assert rl["data.train_batch_size"][0] == "16"
    assert rl["data.train_files"][0] == "null"
    assert rl["trainer.logger"][0] == "[console, jsonl]"
    assert rl["actor_rollout_ref.model.use_remove_padding"][0] == "false"
    assert rl["actor_rollout_ref.actor.optim.betas"][0] == "[0.9, 0.999]"
    assert rl["reward_model.step_reward.separator"][0] == '"\\n"'  # quoted: a raw newline ends the row


def test_table_cells_escape_what_markdown_would_misread_outside_code_spans():
    assert _cell("error | left") == "error \\| left"
    assert _cell("<task>-<estimator> and `a|b<c>`") == "&lt;task&gt;-&lt;estimator&gt; and `a|b<c>`"
    assert _cell("2*x") == "2\\*x"


def test_the_cli_page_shows_every_command_and_its_options():
    text = cli_reference()
    for command in ("train", "sft", "dpo", "config", "data make", "data inspect", "samples", "report",
                    "compare", "flow-train"):  # fmt: skip
        assert f"## `tearless {command}`" in text, command
    train = text[text.index("## `tearless train`") : text.index("## `tearless config`")]
    for option in ("--preset", "--config", "--fresh", "overrides"):
        assert option in train
    assert CLI_MARKER in (DOCS / "cli.md").read_text()


def _nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav_and_the_hook_fills_the_generated_pages():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == on_disk
    assert config["hooks"] == ["mkdocs_hooks.py"] and config["strict"] is True
    import importlib.util

    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert hooks.on_page_markdown(f"a\n{CONFIG_MARKER}\n", None, None, None) == f"a\n{config_reference()}\n"


def test_the_readme_is_short_and_its_two_commands_are_the_ones_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 10_000
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = (
        'pip install -c constraints.txt torch==2.13.0 -e ".[test]" && python -m ruff check tearless tests '
        "&& python -m pytest -q"
    )
    assert test_command in readme
    assert test_command.replace("pip install", "python -m pip install -q") in ci
    assert "pip install -c constraints.txt torch==2.13.0 -e . && tearless train" in readme
    assert "mkdocs build --strict" in readme and "mkdocs build --strict" in ci


def test_rst_maths_and_roles_become_markdown_maths_and_code():
    doc = """GRPO.

        .. math:: A_i = \\frac{R_i - \\mu}{\\sigma} \\quad
                  (\\text{Dr. GRPO: no } \\sigma)

        keeps :math:`R_i/(1+\\epsilon)`; see :class:`~tearless.config.Config` and ``index``.
        """
    assert rst_to_markdown(doc) == (
        "GRPO.\n\n\n$$\nA_i = \\frac{R_i - \\mu}{\\sigma} \\quad\n(\\text{Dr. GRPO: no } \\sigma)\n$$\n\n\n"
        "keeps $R_i/(1+\\epsilon)$; see `Config` and `index`."
    )


def test_the_formulas_page_has_every_estimator_and_policy_loss():
    from tearless.algos import ADV_ESTIMATORS, POLICY_LOSSES

    page = render((DOCS / "algorithms.md").read_text())
    assert FORMULAS_MARKER not in page and ".. math::" not in page and ":math:" not in page
    headings = set(re.findall(r"^### (.+)$", page, flags=re.M))
    named = {name.strip("`") for h in headings for name in h.split(", ")}
    assert set(ADV_ESTIMATORS) | set(POLICY_LOSSES) <= named
    grpo = page[page.index("### `grpo`") :]
    assert "$$\nA_i = \\frac{R_i - \\mu_{g(i)}}{\\sigma_{g(i)} + \\epsilon}" in grpo
