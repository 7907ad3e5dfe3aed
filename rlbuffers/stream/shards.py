"""Webdataset tar shards: write them from JSONL / text files / Python iterables. Finding and
reading them lives in :mod:`rlbuffers.stream.reading` (re-exported here).

A sample is a dict ``{"__key__": str, "__url__": str, "<ext>": bytes}``; the writer stores
JSON records under ``json`` and plain text under ``txt`` (webdataset's convention).

With ``records_per_sample=k > 1`` the writer stores ``k`` consecutive records in one tar member
``jsonl`` (one JSON value per line; a text becomes a JSON string), and :func:`iter_shard`
expands it back into ``k`` samples ``{"json": line}`` with the keys the records would have had
one per sample. Python's ``tarfile`` spends ~20 us parsing each member header, more than
tokenizing a short document, so grouping short records cuts the reading cost several-fold;
plain webdataset readers see one sample per group.

Every shard ends with an end-of-shard marker member (``__rlbuffers_end__``, its sample
count; webdataset readers skip ``__*__`` names) and is read by :mod:`rlbuffers.stream.tario`,
which also insists on tar's end-of-archive block: a truncated shard raises
:class:`~rlbuffers.stream.ShardError` with or without ``shards.json``, local or remote.
Nothing here imports webdataset (and with it torch), except for ``pipe:`` URLs.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from rlbuffers.stream.errors import ShardError
from rlbuffers.stream.reading import (
    MANIFEST_NAME,
    iter_shard,
    manifest_entries,
    open_shard,
    read_manifest,
    read_manifest_at,
    resolve_shards,
    shard_table,
)
from rlbuffers.stream.tario import (
    BLOCK,
    RECORD,
    TarWriter,
    end_marker,
    member_bytes,
    round_up,
)

__all__ = [  # the writer, and the reading API re-exported from rlbuffers.stream.reading
    "MANIFEST_NAME", "check_input_files", "closed_shard_bytes", "iter_input_samples",
    "iter_shard", "manifest_entries", "open_shard", "read_manifest", "read_manifest_at",
    "resolve_shards", "shard_table", "tar_sample_bytes", "write_shards",
]

logger = logging.getLogger(__name__)

_END_BYTES = member_bytes(len(end_marker(2**62)[1]))  # the end-of-shard member, at most
_CLOSE_BYTES = 2 * BLOCK  # end-of-archive blocks


def tar_sample_bytes(sample: dict[str, Any]) -> int:
    """Bytes one sample occupies inside a tar: a 512-byte header plus the payload rounded up
    to 512 bytes, per field (one tar member per field, as webdataset writes them)."""
    return sum(member_bytes(len(v)) for k, v in sample.items() if not k.startswith("_"))


def closed_shard_bytes(content_bytes: int) -> int:
    """Size of a closed shard whose samples take ``content_bytes``: plus the end-of-shard
    marker and the end-of-archive blocks, rounded up to tar's 10,240-byte record."""
    return round_up(content_bytes + _END_BYTES + _CLOSE_BYTES, RECORD)


def _samples_from_path(path: Path) -> Iterator[dict[str, bytes]]:
    if path.suffix in (".jsonl", ".ndjson"):
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except ValueError as exn:
                    raise ShardError(
                        f"{path}:{lineno}: expected one JSON value, got {exn}") from exn
                yield {"json": line.rstrip(b"\r\n")}
    else:
        yield {"txt": path.read_bytes()}


_FILE_SUFFIXES = (".jsonl", ".ndjson", ".txt", ".md", ".text")


def check_input_files(files: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """``files`` as paths, each checked to be an existing file with a supported suffix.

    Raises:
        ShardError: a path that does not exist, is not a file, or has another suffix (named).
    """
    paths = []
    for item in files:
        if not isinstance(item, (str, os.PathLike)):
            raise ShardError(f"files: expected paths (str or os.PathLike), got "
                             f"{type(item).__name__} {item!r:.60}; pass texts and dicts "
                             "as records=")
        path = Path(item)
        if not path.is_file():
            raise ShardError(f"input file {str(path)!r}: expected an existing file, got "
                             f"{'a directory' if path.is_dir() else 'no such path'}")
        if path.suffix not in _FILE_SUFFIXES:
            raise ShardError(f"input {str(path)!r}: expected a .jsonl/.ndjson or .txt/.md "
                             f"file, got suffix {path.suffix!r}")
        paths.append(path)
    return paths


def _sample_from_item(item: Any) -> dict[str, bytes]:
    if isinstance(item, str):
        return {"txt": item.encode("utf-8")}
    if isinstance(item, (bytes, bytearray)):
        return {"txt": bytes(item)}
    if isinstance(item, dict):
        return {"json": json.dumps(item, ensure_ascii=False).encode("utf-8")}
    raise ShardError(f"records item: expected str, bytes or dict, got {type(item).__name__}")


def iter_input_samples(*, files: Iterable[str | os.PathLike[str]] = (),
                       records: Iterable[Any] = ()) -> Iterator[dict[str, bytes]]:
    """Samples (without ``__key__``): first those of ``files`` (paths: ``.jsonl``/``.ndjson``
    -> one sample per non-blank line under ``json``; ``.txt``/``.md`` -> one sample per file
    under ``txt``), then one per item of ``records`` (``str``/``bytes`` -> ``txt``, ``dict`` ->
    ``json``). Paths and texts never mix: a string in ``records`` is always a text, one in
    ``files`` always a path, and every path is checked before the first sample is made.

    Raises:
        ShardError: a missing file or unsupported suffix, a malformed JSON line (file and
            line named), or a record of another type.
    """
    for path in check_input_files(files):
        yield from _samples_from_path(path)
    for item in records:
        yield _sample_from_item(item)


def _record_line(sample: dict[str, bytes]) -> bytes:
    """One ``jsonl`` line for an input sample: its JSON as is, or its text as a JSON string."""
    if "json" in sample:
        return sample["json"]
    return json.dumps(sample["txt"].decode("utf-8"), ensure_ascii=False).encode("utf-8")


class _SizedShardWriter:
    """Writes samples into ``pattern % index`` tar files, starting a new shard *before* a
    sample would push the closed file past ``max_shard_bytes``; closes every shard with its
    end-of-shard marker (see :mod:`rlbuffers.stream.tario`)."""

    def __init__(self, pattern: str, max_shard_bytes: int, max_shard_samples: int) -> None:
        self.pattern = pattern
        self.max_shard_bytes = max_shard_bytes
        self.max_shard_samples = max_shard_samples
        self.shards: list[dict[str, Any]] = []
        self._tar: TarWriter | None = None
        self._content = 0
        self._count = 0

    def write(self, sample: dict[str, Any], records: int = 1) -> None:
        """Write one tar sample holding ``records`` records (samples the reader yields)."""
        size = tar_sample_bytes(sample)
        full = closed_shard_bytes(self._content + size) > self.max_shard_bytes
        over = self._count + records > self.max_shard_samples
        if self._tar is not None and (full or over):
            self._close_current()
        if self._tar is None:
            self._tar = TarWriter(self.pattern % len(self.shards))
        for ext, payload in sample.items():
            if not ext.startswith("_"):
                self._tar.add(f"{sample['__key__']}.{ext}", payload)
        self._content += size
        self._count += records

    def _close_current(self) -> None:
        if self._tar is None:
            return
        self._tar.add(*end_marker(self._count))
        self._tar.close()
        path = self._tar.path
        self.shards.append({"name": os.path.basename(path), "samples": self._count,
                            "bytes": os.path.getsize(path)})
        self._tar = None
        self._content = 0
        self._count = 0

    def close(self) -> None:
        if self._tar is not None:
            self._close_current()


def _check_write_args(out_dir: Any, max_shard_bytes: int, max_shard_samples: int,
                      records_per_sample: int | str) -> None:
    if not isinstance(out_dir, (str, os.PathLike)):
        raise ValueError(f"out_dir: expected a directory path, got {type(out_dir).__name__} "
                         "(inputs go in files= or records=)")
    if max_shard_bytes < RECORD:
        raise ValueError(f"max_shard_bytes: expected >= {RECORD}, got {max_shard_bytes}")
    if max_shard_samples < 1:
        raise ValueError(f"max_shard_samples: expected >= 1, got {max_shard_samples}")
    if records_per_sample != "auto" and (isinstance(records_per_sample, bool) or not
                                         isinstance(records_per_sample, int) or
                                         records_per_sample < 1):
        raise ValueError(f"records_per_sample: expected 'auto' or an int >= 1, got "
                         f"{records_per_sample!r}")


AUTO_GROUP_BYTES = 16 * 2**10
"""``records_per_sample="auto"``: records shorter than this are grouped into ``jsonl``
members of about this many bytes; longer ones keep a member of their own."""


class _Grouper:
    """Turns input samples into tar samples (one per record, or ``jsonl`` groups) for
    ``put(sample, first_record_index, records)``."""

    def __init__(self, put: Any, records_per_sample: int | str, max_shard_samples: int,
                 max_shard_bytes: int) -> None:
        self.put = put
        self.auto = records_per_sample == "auto"
        self.single = records_per_sample == 1
        # A group holds at most max_shard_samples records, so it always fits in one shard.
        self.cap = max_shard_samples if self.auto else min(int(records_per_sample),
                                                           max_shard_samples)
        self.max_bytes = min(AUTO_GROUP_BYTES, max_shard_bytes // 8) if self.auto else None
        self.lines: list[bytes] = []
        self.bytes = 0
        self.first = 0

    def add(self, index: int, sample: dict[str, bytes]) -> None:
        if self.single:
            self.put(sample, index, 1)
            return
        if self.max_bytes is not None and sum(map(len, sample.values())) >= self.max_bytes:
            self.flush()
            self.put(sample, index, 1)  # a long record: tar overhead is negligible
            return
        if not self.lines:
            self.first = index
        line = _record_line(sample)
        self.lines.append(line)
        self.bytes += len(line) + 1
        if len(self.lines) >= self.cap or (self.max_bytes is not None
                                           and self.bytes >= self.max_bytes):
            self.flush()

    def flush(self) -> None:
        if self.lines:
            self.put({"jsonl": b"\n".join(self.lines)}, self.first, len(self.lines))
            self.lines, self.bytes = [], 0


def write_shards(
    out_dir: str | os.PathLike[str],
    *,
    files: Iterable[str | os.PathLike[str]] = (),
    records: Iterable[Any] = (),
    max_shard_bytes: int = 256 * 2**20,
    max_shard_samples: int = 2**31,
    records_per_sample: int | str = "auto",
    prefix: str = "shard",
    progress: bool = True,
) -> list[Path]:
    """Write ``files`` and ``records`` (see :func:`iter_input_samples`) as webdataset tar
    shards ``{prefix}-000000.tar, ...`` into ``out_dir``, each ending with an end-of-shard
    marker member holding its sample count, and a manifest ``shards.json`` (shard names,
    sample counts and bytes), written last via a temporary file and ``os.replace``.

    Args:
        files: input file paths (checked to exist before anything is written).
        records: texts (``str``/``bytes``) and JSON records (``dict``), one sample each.
        max_shard_bytes: upper bound on each tar file's size in bytes, headers, the
            end-of-shard marker and the 10,240-byte end-of-archive padding included; a single
            sample larger than that gets a shard of its own (logged).
        max_shard_samples: upper bound on samples (records) per shard.
        records_per_sample: records stored together in one ``jsonl`` tar member (see the
            module docstring); ``1``: one tar sample per record (``json`` / ``txt``), what
            plain webdataset readers expect record by record; ``"auto"`` (default): records
            shorter than ``AUTO_GROUP_BYTES`` (16 KiB) grouped into members of about that
            size, longer ones one per member (short documents then read several times
            faster). Shards and the manifest count records either way.
        progress: show a tqdm progress bar (records written).

    Returns:
        The shard paths, in order.

    Raises:
        ValueError: ``out_dir`` is not a path, ``max_shard_bytes`` < 10,240, or
            ``max_shard_samples`` < 1, or ``records_per_sample`` neither ``"auto"`` nor >= 1.
        ShardError: a missing or malformed input (see :func:`iter_input_samples`).
    """
    _check_write_args(out_dir, max_shard_bytes, max_shard_samples, records_per_sample)
    files = check_input_files(files)  # before creating anything
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = _SizedShardWriter(str(out / f"{prefix}-%06d.tar"), max_shard_bytes, max_shard_samples)
    bar = tqdm(desc=f"writing shards to {out}", unit=" samples", disable=not progress)

    def put(sample: dict[str, Any], index: int, n_records: int) -> None:
        sample["__key__"] = f"{index:012d}"
        if closed_shard_bytes(tar_sample_bytes(sample)) > max_shard_bytes:
            logger.warning("sample %d is larger than max_shard_bytes=%d; it gets its own shard",
                           index, max_shard_bytes)
        writer.write(sample, n_records)
        bar.update(n_records)

    grouper = _Grouper(put, records_per_sample, max_shard_samples, max_shard_bytes)
    try:
        for index, sample in enumerate(iter_input_samples(files=files, records=records)):
            grouper.add(index, sample)
        grouper.flush()
    finally:
        writer.close()
        bar.close()
    manifest = {"format": "rlbuffers.shards/1", "shards": writer.shards,
                "records_per_sample": records_per_sample,
                "samples": sum(s["samples"] for s in writer.shards)}
    tmp = out / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST_NAME)
    logger.info("wrote %d samples into %d shards in %s", manifest["samples"],
                len(writer.shards), out)
    return [out / s["name"] for s in writer.shards]
