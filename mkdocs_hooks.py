"""mkdocs hook (``hooks:`` in mkdocs.yml): fills the generated reference pages at build time.

``docs/config.md`` and ``docs/cli.md`` hold a marker line that :func:`tearless.reference.render`
replaces with every config key (from the schema dataclasses) and every command's help (from the
argument parser), so those pages always match the code.
"""

from tearless.reference import render


def on_page_markdown(markdown, page, config, files):
    return render(markdown)
