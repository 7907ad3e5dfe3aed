"""Finding and reading shards: resolve a directory / glob / brace pattern / URL into shard URLs,
open them (local, fsspec, ``pipe:``), look up ``shards.json`` beside them, and iterate the
samples of one shard with every truncation check (see :mod:`rlbuffers.stream.shards` for
the format and :mod:`rlbuffers.stream.tario` for the tar reader).
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

from rlbuffers.stream.errors import ShardError
from rlbuffers.stream.state_schema import ShardManifestError, check_manifest
from rlbuffers.stream.tario import (
    END_MARKER_NAME,
    MAX_RECORD_BYTES,
    iter_members,
    read_end_marker,
)

logger = logging.getLogger(__name__)

MANIFEST_NAME = "shards.json"


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
    or it cannot be read (local paths and fsspec URLs alike; ``pipe:`` has none).

    Raises:
        ShardManifestError: it is there and parses, but is not a shard manifest (key, expected and
            actual value named; see :func:`~rlbuffers.stream.state_schema.check_manifest`).
    """
    if parent.startswith("pipe:"):
        return None
    where = f"{parent}/{MANIFEST_NAME}" if "://" in parent else os.path.join(parent,
                                                                              MANIFEST_NAME)
    try:
        if "://" in where:
            with fsspec.open(where, "rb") as f:
                manifest = json.loads(f.read())
        else:
            manifest = json.loads(Path(where).read_bytes())
    except (OSError, ValueError):
        return None
    except Exception as exn:  # a remote store's own error types: no manifest to check
        logger.debug("no readable %s at %s (%s)", MANIFEST_NAME, parent, _cause(exn))
        return None
    return check_manifest(manifest, where)


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

    def __init__(self, stream: BinaryIO, url: str, max_record_bytes: int) -> None:
        self.stream = stream
        self.url, self.max_record_bytes = url, max_record_bytes
        self.marker_samples: int | None = None

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        for name, payload in iter_members(self.stream, max_record_bytes=self.max_record_bytes,
                                          where=f"shard {self.url!r}"):
            if name == END_MARKER_NAME:
                self.marker_samples = read_end_marker(payload)
            elif not (name.startswith("__") and "/" not in name):
                yield name, payload


def iter_shard(url: str, *, skip_samples: int = 0, expected_samples: int | None = None,
               find_manifest: bool = True, max_record_bytes: int = MAX_RECORD_BYTES
               ) -> Iterator[dict[str, Any]]:
    """The samples of the shard at ``url`` in stored order, after skipping ``skip_samples``
    (skipped samples are still read: tar streams do not seek). A ``jsonl`` member (see
    ``records_per_sample`` of :func:`write_shards`) yields one ``{"json": line}`` sample per
    line, and counts as that many samples here and in ``skip_samples``.

    Truncation is detected three ways, for local paths and URLs alike: the stream must end
    with tar's end-of-archive block (a cut at a member boundary lacks it); the end-of-shard
    marker that :func:`write_shards` puts into every shard must match the samples read; and
    so must ``expected_samples``, by default (``find_manifest``) the count in a
    ``shards.json`` beside the shard.

    ``max_record_bytes``: the largest tar member read (default 256 MiB); a larger one raises
    :class:`~rlbuffers.stream.tario.RecordTooLargeError` (a ``ShardError``) naming the shard,
    the member and both sizes, before it is read.

    Raises:
        ShardError: the shard cannot be opened, is not a complete tar, has a record larger
            than ``max_record_bytes``, or holds fewer or more samples than its marker or
            manifest says (URL named).
    """
    if expected_samples is None and find_manifest:
        entry = manifest_entries([url]).get(url)
        expected_samples = int(entry["samples"]) if entry else None
    stream = open_shard(url)
    reader = _ShardReader(stream, url, max_record_bytes)
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
    """The ``shards.json`` manifest written by :func:`write_shards`, checked.

    Raises:
        ShardError: the directory has no manifest. ShardManifestError (a ``ShardError``): it is
            not JSON, or not a shard manifest (key, expected and actual value named).
    """
    path = Path(out_dir) / MANIFEST_NAME
    if not path.exists():
        raise ShardError(f"shard directory {str(out_dir)!r}: no {MANIFEST_NAME}")
    try:
        manifest = json.loads(path.read_bytes())
    except ValueError as exn:
        raise ShardManifestError(f"{path}: expected JSON, got {exn}") from None
    return check_manifest(manifest, str(path))
