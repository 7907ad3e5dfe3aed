"""rlbuffers.storage.direct_io.DirectWriter: the file holds exactly the bytes written, in any
pieces,
with O_DIRECT or through the page cache, and its crc32c is that of those bytes."""

import os

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbuffers.storage import direct_io
from rlbuffers.storage.direct_io import ALIGN, DirectWriter


@settings(max_examples=40, deadline=None)
@given(pieces=st.lists(st.binary(max_size=3 * ALIGN + 7), max_size=12),
       blocks=st.integers(1, 3), direct=st.booleans())
def test_the_file_is_the_concatenation_of_the_writes(tmp_path_factory, pieces, blocks,
                                                     direct):
    path = tmp_path_factory.mktemp("d") / "f.bin"
    saved = getattr(os, "O_DIRECT", None)
    if not direct and saved is not None:
        del os.O_DIRECT  # the fallback: through the page cache
    try:
        with DirectWriter(path, block_bytes=blocks * ALIGN) as f:
            for p in pieces:
                assert f.write(p) == len(p)
        want = b"".join(pieces)
        assert f.direct == (direct and saved is not None)
    finally:
        if saved is not None:
            os.O_DIRECT = saved
    assert path.read_bytes() == want
    assert f.size == len(want) and f.crc32c == crc32c.crc32c(want)


def test_torch_save_through_it_loads_back_exactly(tmp_path):
    obj = {"exp_avg": torch.randn(3, 70_001), "step": torch.tensor(7), "lr": 0.1}
    with DirectWriter(tmp_path / "opt.pt", block_bytes=ALIGN) as f:
        torch.save(obj, f)
    got = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert torch.equal(got["exp_avg"], obj["exp_avg"]) and got["step"] == 7 and got["lr"] == 0.1
    assert f.crc32c == crc32c.crc32c((tmp_path / "opt.pt").read_bytes())


def test_an_overwritten_longer_file_is_cut_to_the_new_length(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * (5 * ALIGN))
    with DirectWriter(tmp_path / "f") as f:
        f.write(b"short")
    assert (tmp_path / "f").read_bytes() == b"short"


@pytest.mark.parametrize("refuses", ["open", "write"])
def test_a_filesystem_refusing_direct_io_falls_back(tmp_path, monkeypatch, refuses):
    """Some filesystems refuse O_DIRECT at open, others only at the first write (EINVAL):
    either way the file is written through the page cache."""
    import fcntl
    real_open, real_write = os.open, os.write
    flag = getattr(os, "O_DIRECT", 0)

    def opening(path, flags, mode=0o777):
        if refuses == "open" and flags & flag:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, mode)

    def writing(fd, data):
        if refuses == "write" and fcntl.fcntl(fd, fcntl.F_GETFL) & flag:
            raise OSError(22, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct_io.os, "open", opening)
    monkeypatch.setattr(direct_io.os, "write", writing)
    with DirectWriter(tmp_path / "f") as f:
        f.write(b"abc" * 5000)
    assert not f.direct and (tmp_path / "f").read_bytes() == b"abc" * 5000


def test_bad_block_size_is_named(tmp_path):
    with pytest.raises(ValueError, match="block_bytes: expected a positive multiple of 4096, "
                                         "got 1000"):
        DirectWriter(tmp_path / "f", block_bytes=1000)
    assert not (tmp_path / "f").exists()
