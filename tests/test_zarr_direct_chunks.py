"""The save's direct chunk writer (``zarr_arrays.write_chunks``): for every codec and stored
dtype, the chunk files are byte for byte the ones Zarr writes for the same rows (a short last
chunk padded as Zarr pads it), and Zarr reads them back; other codec chains fall back."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from rlbuffers.storage.compression import CODECS, zarr_compressors
from rlbuffers.storage.location import make_location
from rlbuffers.storage.zarr_arrays import chunk_encoder, write_chunks

DTYPES = ["uint8", "bool", "int64", "float16", "float32", "complex64"]


def make(group, name, dtype, codec, shape, capacity=10, rows=4):
    return group.create_array(name, shape=(capacity, *shape), chunks=(rows, *shape),
                              dtype=dtype, fill_value=0, config={"write_empty_chunks": True},
                              compressors=zarr_compressors(codec, np.dtype(dtype).itemsize))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_bytes_as_zarr(tmp_path, codec, dtype):
    rng = np.random.default_rng(0)
    shape = (3, 5)
    data = (rng.integers(0, 3, (10, *shape)) if dtype != "float16" else
            rng.standard_normal((10, *shape))).astype(dtype)
    group = zarr.open_group(tmp_path / "g", mode="w", zarr_format=3)
    want = make(group, "zarr", dtype, codec, shape)
    got = make(group, "direct", dtype, codec, shape)
    want[:] = data  # chunks 0, 1 whole; chunk 2 holds 2 rows (the array's edge)
    encode = chunk_encoder(got)
    assert encode is not None
    keys = [got.metadata.encode_chunk_key((c, 0, 0)) for c in range(3)]
    write_chunks(make_location(tmp_path / "g"), "direct", keys, data, 4, encode)
    for key in keys:
        assert (tmp_path / "g" / "direct" / key).read_bytes() == \
            (tmp_path / "g" / "zarr" / key).read_bytes(), key
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "g" / "direct", mode="r")[:], data)


def test_a_chain_it_does_not_know_falls_back_to_zarr(tmp_path):
    group = zarr.open_group(tmp_path / "g", mode="w", zarr_format=3)
    plain = group.create_array("a", shape=(8,), chunks=(4,), dtype="float32",
                               compressors=None, fill_value=0)  # no crc32c
    assert chunk_encoder(plain) is None
    filled = group.create_array("b", shape=(8,), chunks=(4,), dtype="float32",
                                compressors=zarr_compressors("none", 4), fill_value=1.0)
    assert chunk_encoder(filled) is None  # padding would not be the fill value


def test_a_symlink_at_a_chunk_is_refused(tmp_path):
    group = zarr.open_group(tmp_path / "g", mode="w", zarr_format=3)
    arr = make(group, "x", "uint8", "none", (2,))
    key = arr.metadata.encode_chunk_key((0, 0))
    target = tmp_path / "outside"
    target.write_bytes(b"keep")
    (tmp_path / "g" / "x" / key).parent.mkdir(parents=True)
    (tmp_path / "g" / "x" / key).symlink_to(target)
    with pytest.raises(OSError):
        write_chunks(make_location(tmp_path / "g"), "x", [key], np.zeros((4, 2), np.uint8), 4,
                     chunk_encoder(arr))
    assert target.read_bytes() == b"keep"
