"""Webdataset tar shards: write them from JSONL / text files / Python iterables, find them
(directory, glob, brace pattern, URL), and read the samples of one shard.

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

import glob
import itertools
import json
import logging
import os
import posixpath
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import braceexpand
import fsspec
from tqdm.auto import tqdm

from rlbuffers.stream.errors import ShardError
from rlbuffers.stream.tario import (
    BLOCK,
    END_MARKER_NAME,
    RECORD,
    TarWriter,
    end_marker,
    iter_members,
    member_bytes,
    read_end_marker,
    round_up,
)

logger = logging.getLogger(__name__)

MANIFEST_NAME = "shards.json"
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


def _expand(sample: dict[str, Any]) -> list[dict[str, Any]] | tuple[dict[str, Any]]:
    """The records of one tar sample: itself, or one ``{"json": line}`` per line of its
    ``jsonl`` member, keyed as if each had been a sample of its own."""
    lines = sample.get("jsonl")
    if lines is None:
        return (sample,)
    key, url = sample["__key__"], sample["__url__"]
    first = int(key) if key.isdigit() else None
    return [{"json": line, "__url__": url,
             "__key__": f"{first + i:0{len(key)}d}" if first is not None else f"{key}/{i}"}
            for i, line in enumerate(lines.split(b"\n"))]


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
                      records_per_sample: int) -> None:
    if not isinstance(out_dir, (str, os.PathLike)):
        raise ValueError(f"out_dir: expected a directory path, got {type(out_dir).__name__} "
                         "(inputs go in files= or records=)")
    if max_shard_bytes < RECORD:
        raise ValueError(f"max_shard_bytes: expected >= {RECORD}, got {max_shard_bytes}")
    if max_shard_samples < 1:
        raise ValueError(f"max_shard_samples: expected >= 1, got {max_shard_samples}")
    if records_per_sample < 1:
        raise ValueError(f"records_per_sample: expected >= 1, got {records_per_sample}")


def write_shards(
    out_dir: str | os.PathLike[str],
    *,
    files: Iterable[str | os.PathLike[str]] = (),
    records: Iterable[Any] = (),
    max_shard_bytes: int = 256 * 2**20,
    max_shard_samples: int = 2**31,
    records_per_sample: int = 1,
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
            module docstring); ``1``: one tar sample per record (``json`` / ``txt``). Shards
            and the manifest count records either way.
        progress: show a tqdm progress bar (records written).

    Returns:
        The shard paths, in order.

    Raises:
        ValueError: ``out_dir`` is not a path, ``max_shard_bytes`` < 10,240, or
            ``max_shard_samples`` or ``records_per_sample`` < 1.
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

    group: list[bytes] = []
    # A group holds at most max_shard_samples records, so it always fits in one shard.
    group_cap = min(records_per_sample, max_shard_samples)
    try:
        for index, sample in enumerate(iter_input_samples(files=files, records=records)):
            if records_per_sample == 1:
                put(sample, index, 1)
                continue
            group.append(_record_line(sample))
            if len(group) == group_cap:
                put({"jsonl": b"\n".join(group)}, index + 1 - len(group), len(group))
                group = []
        if group:
            put({"jsonl": b"\n".join(group)}, index + 1 - len(group), len(group))
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


def _is_url(text: str) -> bool:
    return text.startswith("pipe:") or "://" in text


def resolve_shards(source: str | os.PathLike[str] | Iterable[str]) -> list[str]:
    """Shard URLs named by ``source``: a local directory (its ``*.tar`` files, sorted), a glob
    (``data/*.tar``), a brace pattern (``data/shard-{000000..000009}.tar``, also for URLs),
    a URL (``s3://...``, ``https://...``, ``file://...``, ``pipe:cmd``), or a list of these.

    Raises:
        ShardError: nothing matches, or a local brace pattern names files that do not exist
            (the first missing ones are named; a pattern is not a filter).
    """
    if not isinstance(source, (str, os.PathLike)):
        return [url for item in source for url in resolve_shards(item)]
    text = os.fspath(source)
    if _is_url(text):
        return list(braceexpand.braceexpand(text))
    if os.path.isdir(text):
        urls = sorted(glob.glob(os.path.join(text, "*.tar")))
    else:
        urls, missing = [], []
        for pattern in braceexpand.braceexpand(text):
            found = sorted(glob.glob(pattern))
            if not found:
                missing.append(pattern)
            urls += found
        if missing and urls:
            raise ShardError(f"shard source {text!r}: {len(missing)} of the shards it names do "
                             f"not exist: {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    if not urls:
        raise ShardError(f"shard source {text!r}: expected at least one .tar file, found none")
    return urls


def _cause(exn: BaseException) -> str:
    """``exn`` and its chain of causes, one ``Type: message`` after the other."""
    parts, seen = [], set()
    cur: BaseException | None = exn
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        parts.append(f"{type(cur).__name__}: {cur}")
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return " <- ".join(parts)


def open_shard(url: str) -> BinaryIO:
    """Open one shard for streaming reads: ``pipe:`` URLs via webdataset's ``gopen`` (imported
    only then), other URLs (``s3://``, ``gs://``, ``https://``, ``file://``, ...) via fsspec,
    plain paths directly (1 MiB buffer).

    Raises:
        ShardError: the shard cannot be opened (URL and the chain of causes named).
    """
    try:
        if url.startswith("pipe:"):
            from webdataset.gopen import gopen

            return gopen(url, "rb")
        if "://" in url:
            return fsspec.open(url, "rb").open()
        return open(url, "rb", buffering=2**20)
    except Exception as exn:  # fsspec back ends raise their own types: name the cause
        raise ShardError(f"shard {url!r}: cannot open ({_cause(exn)})") from exn


def _parent(url: str) -> str:
    if "://" in url:
        return url.rsplit("/", 1)[0]
    return os.path.dirname(url) or "."


def _shard_name(url: str) -> str:
    return posixpath.basename(url) if "://" in url else os.path.basename(url)


def read_manifest_at(parent: str) -> dict[str, Any] | None:
    """The ``shards.json`` in directory or URL prefix ``parent``, or None if there is none
    or it cannot be read (local paths and fsspec URLs alike; ``pipe:`` has none)."""
    if parent.startswith("pipe:"):
        return None
    where = f"{parent}/{MANIFEST_NAME}" if "://" in parent else os.path.join(parent,
                                                                              MANIFEST_NAME)
    try:
        if "://" in where:
            with fsspec.open(where, "rb") as f:
                return json.loads(f.read())
        return json.loads(Path(where).read_bytes())
    except (OSError, ValueError):
        return None
    except Exception as exn:  # a remote store's own error types: no manifest to check
        logger.debug("no readable %s at %s (%s)", MANIFEST_NAME, parent, _cause(exn))
        return None


def manifest_entries(urls: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``url -> {"name", "samples", "bytes"?}`` from the ``shards.json`` beside each shard
    (read once per directory); shards without a manifest entry are left out."""
    manifests: dict[str, dict[str, Any] | None] = {}
    out = {}
    for url in urls:
        parent = _parent(url)
        if parent not in manifests:
            m = read_manifest_at(parent)
            manifests[parent] = ({s.get("name"): s for s in m.get("shards", [])}
                                 if isinstance(m, dict) else None)
        entries = manifests[parent]
        if entries and _shard_name(url) in entries:
            out[url] = entries[_shard_name(url)]
    return out


def shard_table(urls: Iterable[str]) -> list[list[Any]]:
    """``[name, samples, bytes]`` per shard URL, in order: what identifies a shard set.
    Samples and bytes come from the ``shards.json`` beside the shards (local or URL); bytes
    of a local shard without one from the file system; ``None`` where unknown (a remote
    shard without manifest is not probed)."""
    urls = list(urls)
    entries = manifest_entries(urls)
    out = []
    for url in urls:
        entry = entries.get(url, {})
        size = entry.get("bytes")
        if size is None and not _is_url(url):
            try:
                size = os.path.getsize(url)
            except OSError:
                size = None
        samples = entry.get("samples")
        out.append([_shard_name(url), None if samples is None else int(samples),
                    None if size is None else int(size)])
    return out


_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def _group_by_keys(members: Iterator[tuple[str, bytes]], url: str
                   ) -> Iterator[dict[str, Any]]:
    """Consecutive members ``<key>.<ext>`` with the same key as one sample
    ``{"__key__", "__url__", ext: payload}`` (webdataset's grouping; extensions lowercased)."""
    current: dict[str, Any] | None = None
    for name, payload in members:
        m = _KEY_EXT.match(name)
        if m is None:
            continue
        key, ext = m.group(1), m.group(2).lower()
        if current is None or current["__key__"] != key:
            if current is not None:
                yield current
            current = {"__key__": key, "__url__": url}
        elif ext in current:
            raise ShardError(f"shard {url!r}: sample {key!r} has two {ext!r} members")
        current[ext] = payload
    if current is not None:
        yield current


class _ShardReader:
    """The members of one shard, remembering the end-of-shard marker's count if it has one."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.marker_samples: int | None = None

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        for name, payload in iter_members(self.stream):
            if name == END_MARKER_NAME:
                self.marker_samples = read_end_marker(payload)
            elif not (name.startswith("__") and "/" not in name):
                yield name, payload


def iter_shard(url: str, *, skip_samples: int = 0, expected_samples: int | None = None,
               find_manifest: bool = True) -> Iterator[dict[str, Any]]:
    """The samples of the shard at ``url`` in stored order, after skipping ``skip_samples``
    (skipped samples are still read: tar streams do not seek). A ``jsonl`` member (see
    ``records_per_sample`` of :func:`write_shards`) yields one ``{"json": line}`` sample per
    line, and counts as that many samples here and in ``skip_samples``.

    Truncation is detected three ways, for local paths and URLs alike: the stream must end
    with tar's end-of-archive block (a cut at a member boundary lacks it); the end-of-shard
    marker that :func:`write_shards` puts into every shard must match the samples read; and
    so must ``expected_samples``, by default (``find_manifest``) the count in a
    ``shards.json`` beside the shard.

    Raises:
        ShardError: the shard cannot be opened, is not a complete tar, or holds fewer or more
            samples than its marker or manifest says (URL named).
    """
    if expected_samples is None and find_manifest:
        entry = manifest_entries([url]).get(url)
        expected_samples = int(entry["samples"]) if entry else None
    stream = open_shard(url)
    reader = _ShardReader(stream)
    read = skip_samples
    try:
        records = itertools.chain.from_iterable(map(_expand, _group_by_keys(iter(reader), url)))
        for sample in itertools.islice(records, skip_samples, None):
            read += 1
            yield sample
    except ShardError:
        raise
    except Exception as exn:  # damaged tar, stream errors of any back end: name the shard
        raise ShardError(f"shard {url!r}: cannot read ({_cause(exn)})") from exn
    finally:
        stream.close()
    for what, count in (("its end-of-shard marker", reader.marker_samples),
                        (MANIFEST_NAME, expected_samples)):
        if count is not None and read != count:
            raise ShardError(f"shard {url!r}: {what} says {count} samples, read {read} "
                             "(truncated or corrupt)")


def read_manifest(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``shards.json`` manifest written by :func:`write_shards`.

    Raises:
        ShardError: the directory has no manifest.
    """
    path = Path(out_dir) / MANIFEST_NAME
    if not path.exists():
        raise ShardError(f"shard directory {str(out_dir)!r}: no {MANIFEST_NAME}")
    return json.loads(path.read_text())
