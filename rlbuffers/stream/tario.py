"""Reading and writing the tar files that hold shards, without webdataset (whose import pulls
in torch) and faster than ``tarfile``'s reader.

Reading (:func:`iter_members`): a streaming ustar/GNU/pax reader that checks every header's
checksum and insists on the end-of-archive block, so a stream that ends early, even exactly
at a member boundary, raises instead of reading as a shorter archive (``tarfile`` stops
silently in both cases). About 3 us per member header, against ~20 us for ``tarfile``.

Writing (:class:`TarWriter`): ``tarfile`` (standard library), members with ``mtime`` 0 and
mode 0o444, as ``webdataset.TarWriter`` writes them.

End-of-shard marker: :func:`end_marker` is the last member that
:func:`~rlbuffers.stream.write_shards` writes into every shard, ``__rlbuffers_end__`` holding
``{"format": "rlbuffers.shard_end/1", "samples": N}``. Webdataset's readers skip member names
of the form ``__*__``, so the shards stay plain webdataset shards; this package's reader
checks the count, so a shard that lost samples is detected without any manifest.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from typing import BinaryIO

from rlbuffers.intmath import round_up
from rlbuffers.stream.errors import ShardError

BLOCK = 512
RECORD = 10240  # tarfile pads a closed archive to a multiple of this
END_MARKER_NAME = "__rlbuffers_end__"
END_MARKER_FORMAT = "rlbuffers.shard_end/1"
_ZERO = bytes(BLOCK)
_CHKSUM_BLANK = 8 * ord(" ")
MAX_RECORD_BYTES = 256 * 2**20
"""Default largest tar member payload read into memory (bytes): a record above it raises
:class:`RecordTooLargeError` before any of it is read."""
MAX_HEADER_BYTES = 2**20
"""Largest GNU long-name or pax extended header payload (bytes)."""


class TarFormatError(ShardError):
    """The byte stream is not a complete, undamaged tar archive (the message says where)."""


class RecordTooLargeError(ShardError):
    """A tar member (record) is larger than the reader's ``max_record_bytes``."""


def member_bytes(payload_bytes: int) -> int:
    """Bytes one regular member with a short name occupies: header + padded payload."""
    return BLOCK + round_up(payload_bytes, BLOCK)


def _octal(field: bytes, what: str, offset: int, where: str = "tar stream") -> int:
    if field and field[0] & 0x80:  # GNU base-256 for large values
        return int.from_bytes(field[1:], "big")
    text = field.rstrip(b"\0 ").lstrip(b" ")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise TarFormatError(f"{where}: header at byte {offset}: {what} is not octal "
                             f"({field!r})") from None


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    data = stream.read(n)
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = stream.read(n - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _pax_path(data: bytes, where: str) -> str | None:
    """The ``path`` record of a pax extended header, if any. Each record is
    ``"<length> <key>=<value>\n"``, ``length`` counting the whole record: every record must
    have one that covers at least its own digits, space and newline and stays inside ``data``,
    so the parser always advances.

    Raises:
        TarFormatError: a malformed record (where and why named).
    """
    pos = 0
    path = None
    while pos < len(data):
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space] if space > pos else b""
        length = int(digits) if digits.isdigit() else -1
        end = pos + length
        if length < len(digits) + 3 or end > len(data) or data[end - 1:end] != b"\n":
            raise TarFormatError(f"{where}: pax header record at byte {pos}: expected "
                                 f"'<length> <key>=<value>\\n' with length in "
                                 f"[{len(digits) + 3}, {len(data) - pos}], got "
                                 f"{data[pos:pos + 40]!r}")
        key, eq, value = data[space + 1:end - 1].partition(b"=")
        if not eq:
            raise TarFormatError(f"{where}: pax header record at byte {pos}: expected "
                                 f"key=value, got {data[space + 1:end - 1][:40]!r}")
        if key == b"path":
            path = value.decode("utf-8", "surrogateescape")
        pos = end
    return path


def iter_members(stream: BinaryIO, *, max_record_bytes: int = MAX_RECORD_BYTES,
                 where: str = "tar stream") -> Iterator[tuple[str, bytes]]:
    """``(name, payload)`` of each regular file member of the tar ``stream``, in order.

    Every header advances the reader by at least one block, and a member's announced size is
    checked against ``max_record_bytes`` (long-name and pax headers: :data:`MAX_HEADER_BYTES`)
    before its payload is read, so no input makes the reader loop or allocate more than that.
    Members of other kinds (directories, links, ...) are skipped, their payload read in
    pieces. ``where`` names the stream in messages (e.g. ``shard 'a.tar'``).

    Raises:
        TarFormatError: a header's checksum or number fields are invalid, a pax header is
            malformed, or the stream ends before the end-of-archive block (inside a member or
            at a member boundary).
        RecordTooLargeError: a member's payload is larger than ``max_record_bytes``.
    """
    offset = 0
    long_name: str | None = None
    while True:
        header = _read_exact(stream, BLOCK)
        if len(header) < BLOCK:
            raise TarFormatError(f"{where}: stream ends at byte {offset + len(header)} "
                                 "without the end-of-archive block (truncated)")
        if header == _ZERO:
            return
        size = _checked_size(header, offset, where)
        kind = header[156:157]
        regular = kind in (b"0", b"\0", b"7")
        limit = max_record_bytes if regular else MAX_HEADER_BYTES if kind in (b"L", b"x") \
            else None
        if limit is not None and size > limit:
            name = long_name or _member_name(header)
            raise RecordTooLargeError(
                f"{where}: record {name!r} at byte {offset}: {size:,} bytes, more than "
                f"max_record_bytes={limit:,} (raise the limit to read it)")
        padded = round_up(size, BLOCK)
        if limit is None:  # a member this reader does not return: skip it piecewise
            got = _skip(stream, padded)
            data = b""
        else:
            data = _read_exact(stream, padded)
            got = len(data)
        if got < padded:
            raise TarFormatError(f"{where}: member at byte {offset}: {size} bytes announced, "
                                 f"stream ends after {got} (truncated)")
        offset += BLOCK + padded
        if regular:
            name = long_name or _member_name(header)
            long_name = None
            yield name, data[:size] if size < padded else data
        elif kind == b"L":
            long_name = data[:size].rstrip(b"\0").decode("utf-8", "surrogateescape")
        elif kind == b"x":
            long_name = _pax_path(data[:size], f"{where}: header at byte {offset}") or long_name


def _checked_size(header: bytes, offset: int, where: str) -> int:
    """The payload size a header announces, once its checksum is verified."""
    chk = _octal(header[148:156], "checksum", offset, where)
    if sum(header) - sum(header[148:156]) + _CHKSUM_BLANK != chk:
        raise TarFormatError(f"{where}: header at byte {offset}: checksum mismatch (damaged)")
    return _octal(header[124:136], "size", offset, where)


def _skip(stream: BinaryIO, n: int) -> int:
    """Read and drop ``n`` bytes in 1 MiB pieces; the number of bytes there were."""
    got = 0
    while got < n:
        piece = stream.read(min(2**20, n - got))
        if not piece:
            break
        got += len(piece)
    return got


def _member_name(header: bytes) -> str:
    name = header[:100].split(b"\0", 1)[0]
    if header[257:262] == b"ustar":
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def end_marker(samples: int) -> tuple[str, bytes]:
    """The end-of-shard member: ``(END_MARKER_NAME, JSON payload)`` for ``samples`` records."""
    payload = json.dumps({"format": END_MARKER_FORMAT, "samples": samples}).encode()
    return END_MARKER_NAME, payload


def read_end_marker(payload: bytes) -> int:
    """The sample count an end-of-shard marker holds.

    Raises:
        TarFormatError: the payload is not an end marker of a known format.
    """
    try:
        record = json.loads(payload)
        if record.get("format") != END_MARKER_FORMAT:
            raise ValueError(f"format {record.get('format')!r}")
        return int(record["samples"])
    except (ValueError, KeyError, TypeError, AttributeError) as exn:
        raise TarFormatError(f"{END_MARKER_NAME}: expected {END_MARKER_FORMAT!r} JSON with a "
                             f"sample count, got {payload[:80]!r} ({exn})") from None


class TarWriter:
    """Writes members into a new tar file at ``path`` (``tarfile``, GNU format)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tar = tarfile.open(path, "w", format=tarfile.GNU_FORMAT)

    def add(self, name: str, payload: bytes) -> None:
        """Append one regular file member."""
        info = tarfile.TarInfo(name)
        info.size = len(payload)
        info.mode = 0o444
        info.mtime = 0
        info.uname = info.gname = "bigdata"
        self._tar.addfile(info, io.BytesIO(payload))

    def close(self) -> None:
        """Write the end-of-archive blocks and close the file."""
        self._tar.close()
