"""Codec names for the persistent tier, mapped onto Zarr v3 codecs.

Every chunk is compressed, then protected by a crc32c checksum (Zarr's ``crc32c`` codec), so
a flipped bit is caught on read.
"""

from __future__ import annotations

from typing import Any

from zarr.codecs import BloscCname, BloscCodec, BloscShuffle, Crc32cCodec, ZstdCodec

#: Codec names accepted by ``ReplayBuffer.create(codec=...)``.
CODECS = ("blosc-zstd", "blosc-lz4", "zstd", "none")
DEFAULT_CODEC = "blosc-zstd"


def check_codec(name: str, field: str) -> str:
    """Return ``name`` if it is a known codec.

    Raises:
        ValueError: an unknown codec name (the field and the accepted names are given).
    """
    if name not in CODECS:
        raise ValueError(f"field {field!r}: codec must be one of {CODECS}, got {name!r}")
    return name


def zarr_compressors(name: str, itemsize: int, clevel: int = 3) -> list[Any]:
    """Zarr v3 bytes-to-bytes codecs for ``name``: the compressor (if any), then crc32c.

    ``blosc-*`` use byte shuffle with the field's item size (bit-neutral for uint8 frames,
    a large win for float and int fields).
    """
    crc = Crc32cCodec()
    if name == "none":
        return [crc]
    if name == "zstd":
        return [ZstdCodec(level=clevel), crc]
    cname = BloscCname(name.split("-", 1)[1])
    shuffle = BloscShuffle.shuffle if itemsize > 1 else BloscShuffle.noshuffle
    return [BloscCodec(cname=cname, clevel=clevel, shuffle=shuffle, typesize=max(itemsize, 1)), crc]
