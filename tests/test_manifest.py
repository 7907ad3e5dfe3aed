"""The typed manifest: exact JSON round trip, the format-1 upgrade, and errors that name what
is wrong with a manifest."""

import json

import numpy as np
import pytest

from rlbuffers import FieldSpec, ReplayBuffer
from rlbuffers.errors import FormatVersionError, NotABufferError
from rlbuffers.ring import RingState
from rlbuffers.storage.layout import ChunkLayout
from rlbuffers.storage.location import Location
from rlbuffers.storage.manifest import KEEP_COMMITS_KEY, Manifest


def _manifest(**kw):
    base = dict(
        buffer_id="ab", layout=ChunkLayout(10, 4, {"x": 4, "r": 8, "_episode_id": 8}),
        fields={"x": FieldSpec((None, 2), "int16"), "r": FieldSpec((), "float32")},
        codecs={"x": "zstd", "r": "blosc-zstd"}, internal={"_episode_id": FieldSpec((), "int64")},
        ring=RingState(10, 13, 2), commit=3, committed_at=1.5,
        sampler={"type": "uniform"}, rng=np.random.PCG64(0).state,
        metadata={"step": 7}, keep_commits=3,
        chunks={"x": {0: (2, 100), 2: (3, 90)}, "r": {0: (3, 12)}, "_episode_id": {}})
    return Manifest(**{**base, **kw})


def test_json_round_trip_is_exact_and_keeps_derived_keys():
    m = _manifest()
    data = json.loads(json.dumps(m.to_json()))
    assert Manifest.from_json(data) == m
    # derived keys are written for readers without rlbuffers (docs/format.md)
    assert (data["cursor"], data["size"], data["episode_id"]) == (3, 10, 2)
    assert data["field_chunk_transitions"] == {"x": 4, "r": 8, "_episode_id": 8}
    assert data["chunks"]["x"] == [[0, 2, 100], [2, 3, 90]] and data[KEEP_COMMITS_KEY] == 3


def test_format_1_is_upgraded_in_one_place():
    data = _manifest(format_version=1).to_json()
    assert not {"field_chunk_transitions", "chunks", KEEP_COMMITS_KEY} & set(data)
    m = Manifest.from_json(data)
    assert m.layout.stored_chunk_rows == {"x": 4, "r": 4, "_episode_id": 4}
    # the tier lists a format 1-2 buffer's chunks (files in <field>/); a save writes format 3
    assert (m.chunks, m.format_version, m.keep_commits) == (None, 1, 2)


@pytest.mark.parametrize(("edit", "error", "match"), [
    (lambda d: d.pop("capacity"), NotABufferError, "malformed manifest .*'capacity'"),
    (lambda d: d.update(total_added="many"), NotABufferError, "malformed manifest"),
    (lambda d: d.update(format="other"), NotABufferError, "not an rlbuffers manifest"),
    (lambda d: d.update(format_version=9), FormatVersionError, "format version 9 is newer"),
])
def test_bad_manifests_are_named(edit, error, match):
    data = _manifest().to_json()
    edit(data)
    with pytest.raises(error, match=match):
        Manifest.from_json(data, "buf/manifest.json")


def test_save_does_not_reread_the_manifest(tmp_path, monkeypatch):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=8, fields={"x": FieldSpec((), "int64")},
                              chunk_transitions=4)
    buf.extend({"x": np.arange(5)})
    real, reads = Location.read_bytes, []

    def counting(self, rel):
        reads.append(rel)
        return real(self, rel)

    monkeypatch.setattr(Location, "read_bytes", counting)
    assert buf.save(metadata={"a": 1}).commit == 1
    assert buf.save().commit == 2
    assert "manifest.json" not in reads
    monkeypatch.undo()
    buf.close()
    with ReplayBuffer.open(tmp_path / "b", mode="r") as ro:
        assert (ro.metadata, ro.total_added) == ({"a": 1}, 5)
