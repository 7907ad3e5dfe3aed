"""The names the commit counter had before it was called ``commit`` (``generation``,
``keep_generations``, ``--generation``) still work for one release and warn, naming the new
name; buffers whose manifest and working-tier state carry the old keys still open."""

import json

import numpy as np
import pytest

from rlbuffers import ReplayBuffer
from rlbuffers.cli import main
from rlbuffers.maintenance.export import export_commit
from rlbuffers.maintenance.inspection import inspect_path
from rlbuffers.storage import store
from rlbuffers.storage.manifest import COMMIT_KEY, KEEP_COMMITS_KEY
from tests.conftest import assert_rows_are, make_batch


@pytest.fixture
def path(tmp_path, fields):
    """A buffer with commits 1 (rows 0..3) and 2 (rows 0..7), both kept."""
    p = tmp_path / "b"
    with ReplayBuffer.create(p, capacity=12, fields=fields, chunk_transitions=4,
                             keep_commits=2) as w:
        for g in range(2):
            w.extend(make_batch(4 * g, 4))
            w.save()
    return p


def test_keep_generations_keyword_warns_and_sets_keep_commits(tmp_path, fields):
    with pytest.warns(DeprecationWarning, match=r"keep_generations=.*use keep_commits="):
        buf = ReplayBuffer.create(tmp_path / "b", capacity=4, fields=fields,
                                  keep_generations=5)
    buf.close()
    data = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert data[KEEP_COMMITS_KEY] == 5


def test_keep_generations_and_keep_commits_together_is_an_error(tmp_path, fields):
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="keep_commits"):
        ReplayBuffer.create(tmp_path / "b", capacity=4, fields=fields, keep_commits=2,
                            keep_generations=3)


def test_open_generation_keyword_warns_and_opens_that_commit(path):
    with pytest.warns(DeprecationWarning, match=r"generation=.*use commit="):
        ro = ReplayBuffer.open(path, mode="r", generation=1)
    with ro:
        assert ro.commit == 1 and len(ro) == 4


def test_buffer_generation_attribute_warns_and_is_the_commit(path):
    with ReplayBuffer.open(path, mode="r") as ro:
        with pytest.warns(DeprecationWarning, match=r"generation.*ReplayBuffer.commit"):
            assert ro.generation == ro.commit == 2


def test_save_report_generation_attribute_warns_and_is_the_commit(path):
    with ReplayBuffer.open(path) as w:
        report = w.save()
    with pytest.warns(DeprecationWarning, match=r"SaveReport.generation.*SaveReport.commit"):
        assert report.generation == report.commit == 3


def test_inspect_path_generation_keyword_warns(path):
    with pytest.warns(DeprecationWarning, match="use commit="):
        assert inspect_path(path, generation=1)["commit"] == 1


def test_export_commit_generation_keyword_warns(path, tmp_path):
    with pytest.warns(DeprecationWarning, match="use commit="):
        assert export_commit(path, tmp_path / "out", generation=1)["commit"] == 1


def test_cli_generation_option_warns_and_reports_that_commit(path, capsys):
    assert main(["inspect", str(path), "--json", "--generation", "1"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["commit"] == 1
    assert "--generation is deprecated" in out.err and "use --commit" in out.err


def test_manifest_keeps_the_format_3_key_of_the_commit_number(path):
    """The commit number is written under its format-3 key, so older readers open new
    buffers, and a manifest written by the code before the rename opens as before."""
    data = json.loads((path / "manifest.json").read_text())
    assert (COMMIT_KEY, KEEP_COMMITS_KEY) == ("generation", "keep_generations")
    assert data["generation"] == 2 and data["keep_generations"] == 2 and "commit" not in data
    with ReplayBuffer.open(path, mode="r") as ro:
        assert ro.commit == 2
        assert_rows_are(ro[:], np.arange(8))


def test_working_state_written_with_the_old_key_is_reused(path, monkeypatch):
    """A working tier whose ``state.json`` says ``generation`` (written before the rename)
    still mirrors its commit: reopening reuses it instead of rebuilding every chunk."""
    state_file = path / ".working" / "state.json"
    state = json.loads(state_file.read_text())
    state["generation"] = state.pop("commit")
    state_file.write_text(json.dumps(state))

    rebuilt = []
    real = store.WritableStorage._rebuild

    def spy(self, working, base_chunks):
        rebuilt.append(set(base_chunks))
        real(self, working, base_chunks)

    monkeypatch.setattr(store.WritableStorage, "_rebuild", spy)
    with ReplayBuffer.open(path) as w:
        assert w.commit == 2
        assert_rows_are(w[:], np.arange(8))
    assert all(not chunks for chunks in rebuilt)
