"""The documentation site (mkdocs.yml: the guides in docs/ and the API reference built from
the docstrings, docs/api/) builds with warnings as errors, so a broken link or anchor, a
public name that no longer resolves or a docstring section griffe cannot parse fails here
(and in ``.ci/run``, which builds it too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.heavy import require

require("mkdocs", "mkdocstrings_handlers.python")

REPO = Path(__file__).resolve().parents[1]


def test_strict_build_documents_the_public_names(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    buffer_page = (site / "api" / "buffer" / "index.html").read_text(encoding="utf-8")
    # a method under its public path, with its docstring's sections
    assert 'id="rlbuffers.ReplayBuffer.sample"' in buffer_page
    assert "BufferEmptyError" in buffer_page
    # a lazily imported name (PEP 562) under its package's path
    stream_page = (site / "api" / "stream" / "index.html").read_text(encoding="utf-8")
    assert 'id="rlbuffers.stream.StreamLoader"' in stream_page
    # the front page is README.md, its docs/ links made relative to the site
    front = (site / "index.html").read_text(encoding="utf-8")
    assert "The replay buffer" in front and 'href="erl/"' in front
    # the CLI page holds the parser's own help of every command
    cli = (site / "api" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "usage: rlbuffers inspect" in cli and "usage: rlbuffers verify" in cli
