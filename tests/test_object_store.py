"""The persistent tier on S3 (moto's server on loopback, started here), the working tier on
local disk: create, incremental saves, open from a fresh machine, inspect, interrupted reclaim."""

import json
import socket

from tests.heavy import require

require("s3fs", "moto")

import numpy as np
import pytest
import s3fs
from moto.server import ThreadedMotoServer

from rlbuffers import ReplayBuffer
from rlbuffers.cli import main
from rlbuffers.storage.location import FsspecLocation, make_location
from tests.conftest import assert_rows_are, make_batch


@pytest.fixture(scope="module")
def s3():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    fs = s3fs.S3FileSystem(key="test", secret="test", endpoint_url=endpoint,
                           skip_instance_cache=True)
    fs.mkdir("rlbuf")  # creates the bucket
    yield {"endpoint_url": endpoint, "key": "test", "secret": "test"}
    server.stop()


def test_save_open_on_s3(tmp_path, fields, s3):
    url = "s3://rlbuf/run1/buffer"
    buf = ReplayBuffer.create(url, capacity=12, fields=fields, chunk_transitions=4,
                              storage_options=s3, working_dir=tmp_path / "w1", seed=2)
    buf.extend(make_batch(0, 9))
    first = buf.save()
    buf.extend(make_batch(9, 2))  # slots 9, 10: one chunk of each column
    second = buf.save(metadata={"step": 11})
    assert second.chunks_written == len(fields) + 1 < first.chunks_written
    want = buf.sample(8)["indices"]
    buf.close()
    # a fresh machine: empty working dir, everything comes from S3
    with ReplayBuffer.open(url, storage_options=s3, working_dir=tmp_path / "w2") as again:
        assert (again.total_added, again.metadata) == (11, {"step": 11})
        assert_rows_are(again[:], np.arange(11))
        np.testing.assert_array_equal(again.sample(8)["indices"], want)
    with ReplayBuffer.open(url, mode="r", storage_options=s3) as ro:
        assert_rows_are(ro[:], np.arange(11))


def test_inspect_s3(tmp_path, fields, s3, capsys, monkeypatch):
    url = "s3://rlbuf/run2/buffer"
    with ReplayBuffer.create(url, capacity=8, fields=fields, chunk_transitions=4,
                             storage_options=s3, working_dir=tmp_path / "w") as buf:
        buf.extend(make_batch(0, 6))
        buf.save()
    assert main(["inspect", url, "--json", "--verify", "--storage-options", json.dumps(s3)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["size"], r["capacity"], r["commit"], r["corrupt"]) == (6, 8, 1, [])
    assert r["fields"]["frame"]["stored_bytes"] > 0
    # credentials and endpoint from the environment, as with any S3 tool
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3["endpoint_url"])
    assert main(["inspect", url]) == 0
    assert "6 / 8 transitions" in capsys.readouterr().out


def test_interrupted_reclaim_on_s3(tmp_path, fields, s3, monkeypatch):
    """The commit happened, but deleting the chunk versions only older commits use stopped
    halfway (network gone): the save still reports its commit, readers see it, and the next
    writer finishes the reclaim."""
    url = "s3://rlbuf/run3/buffer"
    buf = ReplayBuffer.create(url, capacity=8, fields=fields, chunk_transitions=4,
                              storage_options=s3, working_dir=tmp_path / "w")
    buf.extend(make_batch(0, 8))
    buf.save()
    buf.extend(make_batch(8, 3))  # overwrites slots 0..2 (chunk 0)
    buf.save()
    buf.extend(make_batch(11, 3))  # chunk 0 again: commit 2's chunk-0 versions go at g4
    buf.save()
    buf.extend(make_batch(14, 2))
    real = {"remove_file": FsspecLocation.remove_file, "remove_tree": FsspecLocation.remove_tree}

    def dying(self, rel):
        raise ConnectionError("network gone")

    for name in real:
        monkeypatch.setattr(FsspecLocation, name, dying)
    assert buf.save().commit == 4  # committed; the reclaim failed and is logged
    for name, fn in real.items():
        monkeypatch.setattr(FsspecLocation, name, fn)
    loc = make_location(url, s3)
    assert "g2.json" in loc.listdir("history")  # not reclaimed yet
    with ReplayBuffer.open(url, mode="r", storage_options=s3) as ro:
        assert ro.commit == 4
        assert_rows_are(ro[:], np.arange(8, 16))
    with ReplayBuffer.open(url, storage_options=s3, working_dir=tmp_path / "w2") as rw:
        assert_rows_are(rw[:], np.arange(8, 16))
    assert sorted(loc.listdir("history")) == ["g3.json", "g4.json"]
    buf.close()
