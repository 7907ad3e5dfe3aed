"""MkDocs hooks for the documentation site (mkdocs.yml), so generated pages cannot drift from
their sources:

- ``<!-- include README.md -->`` in a page is replaced by README.md, its ``docs/X`` links
  made relative to the docs folder (the front page *is* the README, never a copy of it);
- ``<!-- rlbuffers --help -->`` is replaced by the help text of ``rlbuffers`` and of every
  command, from the CLI's own argument parser.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]
_README = "<!-- include README.md -->"
_HELP = "<!-- rlbuffers --help -->"
#: a Markdown link target inside docs/, as README.md writes it: ``](docs/erl.md#anchor)``
_DOCS_LINK = re.compile(r"\]\(docs/")
_HELP_COLUMNS = "100"


def _readme() -> str:
    return _DOCS_LINK.sub("](", (_ROOT / "README.md").read_text(encoding="utf-8"))


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_sections(parser: argparse.ArgumentParser, level: int) -> list[str]:
    out = [f"{'#' * level} `{parser.prog}`\n\n```text\n{parser.format_help().rstrip()}\n```\n"]
    for sub in _subcommands(parser).values():
        out.extend(_help_sections(sub, level + 1))
    return out


def _cli_help() -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = _HELP_COLUMNS  # argparse wraps to the terminal: fix the width
    try:
        from rlbuffers.cli import build_parser

        return "\n".join(_help_sections(build_parser(), 2))
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Expand the two markers above in a page's Markdown."""
    if _README in markdown:
        markdown = markdown.replace(_README, _readme())
    if _HELP in markdown:
        markdown = markdown.replace(_HELP, _cli_help())
    return markdown
