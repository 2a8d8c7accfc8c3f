"""Griffe extension of the docs site (mkdocs.yml, mkdocstrings' ``extensions``): docstrings are written
in reST maths (``.. math::``, ``:math:``) and roles (``:class:``); the API reference renders them as
Markdown maths and code through :func:`tearless.reference.rst_to_markdown`."""

import griffe

from tearless.reference import rst_to_markdown


class ReSTToMarkdown(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
