"""``repair``: damaged committed chunks are rewritten from a working tier that still mirrors
the commit; what cannot be repaired is reported with the reason."""

import os
import shutil

import numpy as np

from rlbuffers import ReplayBuffer
from rlbuffers.maintenance.inspection import inspect_path
from rlbuffers.maintenance.repair import repair
from rlbuffers.storage.location import make_location
from rlbuffers.storage.zarr_tier import ZarrTier
from tests.conftest import assert_rows_are, make_batch


def _saved(path, fields, pending=0):
    buf = ReplayBuffer.create(path, capacity=12, fields=fields, chunk_transitions=4)
    buf.extend(make_batch(0, 10))
    buf.save(metadata={"step": 1})
    if pending:
        buf.extend(make_batch(10, pending))  # changes slots after the commit, not saved
    buf.close()
    tier = ZarrTier.open(make_location(path))
    os.remove(path / tier.chunk_path("tokens", 0))
    chunk = path / tier.chunk_path("points", 1)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))


def test_repair_rewrites_damaged_chunks_from_the_working_tier(tmp_path, fields):
    path = tmp_path / "b"
    _saved(path, fields)
    assert len(inspect_path(path, verify=True)["corrupt"]) == 2
    report = repair(path)
    assert report["commit"] == 2 and report["unrepairable"] == []
    assert sorted((r["field"], r["chunk"]) for r in report["repaired"]) == [
        ("points", 1), ("tokens", 0)]
    assert inspect_path(path, verify=True)["corrupt"] == []
    with ReplayBuffer.open(path, mode="r") as ro:
        assert ro.metadata == {"step": 1}
        assert_rows_are(ro[:], np.arange(10))
    assert repair(path) == {"commit": 2, "repaired": [], "unrepairable": [], "removed": []}


def test_what_cannot_be_repaired_is_reported(tmp_path, fields):
    path = tmp_path / "b"
    _saved(path, fields, pending=3)  # slots 10, 11, 0 changed: base chunks 2 and 0 dirty
    report = repair(path)
    assert [(r["field"], r["chunk"]) for r in report["repaired"]] == [("points", 1)]
    assert [(r["field"], r["chunk"], r["why"]) for r in report["unrepairable"]] == [
        ("tokens", 0, "the working tier changed these rows since the commit")]
    shutil.rmtree(path / ".working")
    report = repair(path)
    assert report["repaired"] == [] and report["commit"] == 2
    assert "no usable working tier" in report["unrepairable"][0]["why"]


def test_verify_cli(tmp_path, fields, capsys):
    from rlbuffers.cli import main

    path = tmp_path / "b"
    _saved(path, fields)
    assert main(["verify", str(path)]) == 1
    assert "damaged   field 'tokens' chunk 0: missing" in capsys.readouterr().out
    assert main(["verify", str(path), "--repair"]) == 0
    out = capsys.readouterr().out
    assert "repaired  field 'points' chunk 1" in out and "every chunk OK" in out
    assert main(["verify", str(path), "--json"]) == 0
