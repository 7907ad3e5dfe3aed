"""Every ```python block of README.md and docs/*.md runs as written.

Each page's blocks run in order, in one namespace (as a reader pasting them into one session
would), in one fresh Python process per page, from a fresh temporary working directory, with a
timeout. A failure names the page, the block's number and the line of the page that raised.
docs/api/ (the API reference, rendered from docstrings) has no examples of its own to run.

A block that is not meant to run is not Python: transcripts and pseudocode are ```text,
```console or a bare fence. Nothing here is skipped: a block that needs something CI lacks
(a GPU) picks its device instead.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: README.md and the guides; docs/api/ is a subfolder, so the glob leaves it out
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: seconds for one page's blocks (they run in well under a minute each on 2 shared cores)
TIMEOUT_S = 300
#: the fence languages the pages may use; a Python example must say ``python`` to be run
LANGUAGES = {"", "python", "bash", "console", "text", "json", "toml", "yaml"}
FENCE = re.compile(r"^```(\S*)\s*$")

RUNNER = r"""
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for b in blocks:
    print(f"=== {b['page']} block {b['n']} (line {b['line']})", flush=True)
    # pad with blank lines so that tracebacks give the line in the page itself (and its text)
    code = compile("\n" * (b["line"] - 1) + b["code"], b["path"], "exec")
    try:
        exec(code, ns)
    except BaseException as e:
        if isinstance(e, SystemExit) and e.code in (None, 0):
            continue
        traceback.print_exc()
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
                 if f.filename == b["path"]]
        msg = traceback.format_exception_only(type(e), e)[-1].strip()
        with open(sys.argv[2], "w") as f:
            json.dump({"n": b["n"], "line": lines[-1] if lines else b["line"], "error": msg}, f)
        sys.exit(1)
"""


def fences(text: str) -> list[tuple[str, int, str]]:
    """(language, line number of the block's first line, code) of each fenced block."""
    out, lang, start, body = [], None, 0, []
    for i, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if lang is None and m:
            lang, start, body = m.group(1), i + 1, []
        elif lang is not None and line.strip() == "```":
            out.append((lang, start, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"a fence opened at line {start - 1} is never closed"
    return out


def python_blocks(page: Path) -> list[dict[str, object]]:
    name = str(page.relative_to(ROOT))
    return [{"page": name, "path": str(page), "n": n, "line": line, "code": code}
            for n, (_, line, code) in enumerate(
                (f for f in fences(page.read_text()) if f[0] == "python"), 1)]


PAGES_WITH_CODE = [p for p in PAGES if python_blocks(p)]


def test_fences_say_what_they_hold():
    """A Python example tagged ``py`` or ``python3`` would escape this test; so would an
    unclosed fence."""
    for page in PAGES:
        langs = {lang for lang, _, _ in fences(page.read_text())}
        assert langs <= LANGUAGES, f"{page.relative_to(ROOT)}: fence languages {langs - LANGUAGES}"
    names = [str(p.relative_to(ROOT)) for p in PAGES_WITH_CODE]
    assert "README.md" in names and all(not n.startswith("docs/api/") for n in names)


def test_runner_names_page_block_and_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# t\n\n```python\nx = 1\n```\n\ntext\n\n```python\ny = x\nz = y / 0\n```\n")
    blocks = [{"page": "page.md", "path": str(page), "n": n, "line": line, "code": code}
              for n, (_, line, code) in enumerate(fences(page.read_text()), 1)]
    with pytest.raises(pytest.fail.Exception, match=r"page.md, block 2 \(from line 10\), "
                       r"line 11: ZeroDivisionError"):
        run_page("page.md", blocks, tmp_path / "work")


def run_page(name: str, blocks: list[dict[str, object]], work: Path) -> None:
    work.mkdir()
    spec, result = work / ".blocks.json", work / ".result.json"
    spec.write_text(json.dumps(blocks))
    # RLBUFFERS_CACHE: nothing outside the temporary directory; one torch thread: on 2 shared
    # cores torch's second thread only waits (the SB3 examples run ~3x faster with one)
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "RLBUFFERS_CACHE": str(work / ".cache")}
    env.pop("PYTHONPATH", None)  # the installed package, as a reader has it
    try:
        proc = subprocess.run([sys.executable, "-c", RUNNER, str(spec), str(result)], cwd=work,
                              env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or "")
        started = [ln for ln in out.splitlines() if ln.startswith("=== ")]
        pytest.fail(f"{name}: timed out after {TIMEOUT_S} s in "
                    f"{started[-1][4:] if started else 'the first block'}")
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        if result.exists():
            r = json.loads(result.read_text())
            b = blocks[r["n"] - 1]
            pytest.fail(f"{name}, block {r['n']} (from line {b['line']}), line {r['line']}: "
                        f"{r['error']}\n{tail}", pytrace=False)
        pytest.fail(f"{name}: the process exited {proc.returncode}\n{tail}", pytrace=False)


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page, tmp_path):
    run_page(str(page.relative_to(ROOT)), python_blocks(page), tmp_path / "work")
