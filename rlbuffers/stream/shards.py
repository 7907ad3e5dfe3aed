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
"""

from __future__ import annotations

import glob
import itertools
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import braceexpand
import fsspec
import webdataset as wds
from tqdm.auto import tqdm
from webdataset.tariterators import group_by_keys, tar_file_iterator

from rlbuffers.stream.errors import ShardError

logger = logging.getLogger(__name__)

MANIFEST_NAME = "shards.json"
_TAR_BLOCK = 512
_TAR_RECORD = 10240  # tarfile pads the closed archive to a multiple of this


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def tar_sample_bytes(sample: dict[str, Any]) -> int:
    """Bytes one sample occupies inside a tar: a 512-byte header plus the payload rounded up
    to 512 bytes, per field (webdataset writes one tar member per field)."""
    total = 0
    for k, v in sample.items():
        if k.startswith("_"):
            continue
        total += _TAR_BLOCK + _round_up(len(v), _TAR_BLOCK)
    return total


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
    elif path.suffix in (".txt", ".md", ".text"):
        yield {"txt": path.read_bytes()}
    else:
        raise ShardError(
            f"input {str(path)!r}: expected a .jsonl/.ndjson or .txt/.md file, got suffix "
            f"{path.suffix!r}"
        )


def _sample_from_item(item: Any) -> dict[str, bytes]:
    if isinstance(item, str):
        return {"txt": item.encode("utf-8")}
    if isinstance(item, (bytes, bytearray)):
        return {"txt": bytes(item)}
    if isinstance(item, dict):
        return {"json": json.dumps(item, ensure_ascii=False).encode("utf-8")}
    raise ShardError(f"iterable item: expected str, bytes or dict, got {type(item).__name__}")


def iter_input_samples(inputs: Iterable[Any]) -> Iterator[dict[str, bytes]]:
    """Samples (without ``__key__``) from ``inputs``: each element is a path (``str`` or
    :class:`~pathlib.Path` naming an existing ``.jsonl``/``.ndjson`` file -> one sample per
    line under ``json``; ``.txt``/``.md`` -> one sample per file under ``txt``), or, when
    ``inputs`` is not a list of paths, any ``str`` (text), ``bytes`` or ``dict`` (JSON) item.

    Raises:
        ShardError: an unsupported file suffix, a malformed JSON line (file and line named),
            or an item of another type.
    """
    for item in inputs:
        if isinstance(item, Path) or (isinstance(item, str) and os.path.isfile(item)):
            yield from _samples_from_path(Path(item))
        else:
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
    """A ``webdataset.ShardWriter`` that starts a new shard *before* a sample would push the
    closed tar file past ``max_shard_bytes`` (webdataset checks after, on payload bytes only)."""

    def __init__(self, pattern: str, max_shard_bytes: int, max_shard_samples: int) -> None:
        self.max_shard_bytes = max_shard_bytes
        self.max_shard_samples = max_shard_samples
        self._writer = wds.ShardWriter(
            pattern, maxcount=2**62, maxsize=float("inf"), verbose=0, mtime=0
        )
        self.shards: list[dict[str, Any]] = []
        self._content = 0
        self._count = 0

    def write(self, sample: dict[str, Any], records: int = 1) -> None:
        """Write one tar sample holding ``records`` records (samples the reader yields)."""
        size = tar_sample_bytes(sample)
        full = _round_up(self._content + size + 2 * _TAR_BLOCK, _TAR_RECORD) > self.max_shard_bytes
        over = self._count + records > self.max_shard_samples
        if self._count and (full or over):
            self._close_current()
            self._writer.next_stream()
        self._writer.write(sample)
        self._content += size
        self._count += records

    def _close_current(self) -> None:
        name = os.path.basename(self._writer.fname)
        self.shards.append({"name": name, "samples": self._count})
        self._content = 0
        self._count = 0

    def close(self) -> None:
        fname = self._writer.fname
        self._writer.close()
        if self._count:
            self._close_current()
        elif fname is not None and os.path.exists(fname):
            os.remove(fname)  # the writer opens a shard eagerly; drop it if it stayed empty


def write_shards(
    inputs: Iterable[Any],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_bytes: int = 256 * 2**20,
    max_shard_samples: int = 2**31,
    records_per_sample: int = 1,
    prefix: str = "shard",
    progress: bool = True,
) -> list[Path]:
    """Write ``inputs`` (see :func:`iter_input_samples`) as webdataset tar shards
    ``{prefix}-000000.tar, ...`` into ``out_dir`` and a manifest ``shards.json`` (shard names
    and sample counts), written last via a temporary file and ``os.replace``.

    Args:
        max_shard_bytes: upper bound on each tar file's size in bytes, headers and the
            10,240-byte end-of-archive padding included; a single sample larger than that gets
            a shard of its own (logged).
        max_shard_samples: upper bound on samples (records) per shard.
        records_per_sample: records stored together in one ``jsonl`` tar member (see the
            module docstring); ``1``: one tar sample per record (``json`` / ``txt``). Shards
            and the manifest count records either way.
        progress: show a tqdm progress bar (records written).

    Returns:
        The shard paths, in order.

    Raises:
        ValueError: ``max_shard_bytes`` < 10,240, or ``max_shard_samples`` or
            ``records_per_sample`` < 1.
        ShardError: a malformed input (see :func:`iter_input_samples`).
    """
    if max_shard_bytes < _TAR_RECORD:
        raise ValueError(f"max_shard_bytes: expected >= {_TAR_RECORD}, got {max_shard_bytes}")
    if max_shard_samples < 1:
        raise ValueError(f"max_shard_samples: expected >= 1, got {max_shard_samples}")
    if records_per_sample < 1:
        raise ValueError(f"records_per_sample: expected >= 1, got {records_per_sample}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = _SizedShardWriter(str(out / f"{prefix}-%06d.tar"), max_shard_bytes, max_shard_samples)
    bar = tqdm(desc=f"writing shards to {out}", unit=" samples", disable=not progress)
    def put(sample: dict[str, Any], index: int, records: int) -> None:
        sample["__key__"] = f"{index:012d}"
        if tar_sample_bytes(sample) + 3 * _TAR_BLOCK > max_shard_bytes:
            logger.warning("sample %d is larger than max_shard_bytes=%d; it gets its own shard",
                           index, max_shard_bytes)
        writer.write(sample, records)
        bar.update(records)

    group: list[bytes] = []
    # A group holds at most max_shard_samples records, so it always fits in one shard.
    group_cap = min(records_per_sample, max_shard_samples)
    try:
        for index, sample in enumerate(iter_input_samples(inputs)):
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


def resolve_shards(source: str | os.PathLike[str] | Iterable[str]) -> list[str]:
    """Shard URLs named by ``source``: a local directory (its ``*.tar`` files, sorted), a glob
    (``data/*.tar``), a brace pattern (``data/shard-{000000..000009}.tar``, also for URLs),
    a URL (``s3://...``, ``https://...``, ``pipe:cmd``), or a list of any of these.

    Raises:
        ShardError: nothing matches (the pattern is named).
    """
    if not isinstance(source, (str, os.PathLike)):
        return [url for item in source for url in resolve_shards(item)]
    text = os.fspath(source)
    if text.startswith("pipe:") or "://" in text:
        return list(braceexpand.braceexpand(text))
    if os.path.isdir(text):
        urls = sorted(glob.glob(os.path.join(text, "*.tar")))
    else:
        urls = sorted(u for p in braceexpand.braceexpand(text) for u in glob.glob(p))
    if not urls:
        raise ShardError(f"shard source {text!r}: expected at least one .tar file, found none")
    return urls


def open_shard(url: str) -> BinaryIO:
    """Open one shard for streaming reads: ``pipe:`` URLs via webdataset's ``gopen``, other
    URLs (``s3://``, ``gs://``, ``https://``, ``file://``, ...) via fsspec, plain paths directly.

    Raises:
        ShardError: the shard cannot be opened (URL and cause named).
    """
    try:
        if url.startswith("pipe:"):
            return wds.gopen(url, "rb")
        if "://" in url:
            return fsspec.open(url, "rb").open()
        return open(url, "rb")
    except (OSError, ValueError) as exn:
        raise ShardError(f"shard {url!r}: cannot open ({exn})") from exn


def _manifest_count(url: str) -> int | None:
    """Samples that ``shards.json`` beside a local shard says it holds (None if unknown)."""
    if "://" in url or url.startswith("pipe:"):
        return None
    path = Path(url)
    try:
        manifest = json.loads((path.parent / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    for shard in manifest.get("shards", []):
        if shard.get("name") == path.name:
            return int(shard["samples"])
    return None


def iter_shard(url: str, *, skip_samples: int = 0) -> Iterator[dict[str, Any]]:
    """The samples of the shard at ``url`` in stored order, after skipping ``skip_samples``
    (skipped samples are still read: tar streams do not seek). A ``jsonl`` member (see
    ``records_per_sample`` of :func:`write_shards`) yields one ``{"json": line}`` sample per
    line, and counts as that many samples here and in ``skip_samples``.

    ``tarfile`` reads a tar stream that ends early, or whose later header is damaged, as if
    the archive ended there; so for a local shard listed in a ``shards.json`` beside it (as
    :func:`write_shards` leaves), the number of samples read is checked against the manifest.

    Raises:
        ShardError: the shard cannot be opened, is not a readable tar, or holds fewer or more
            samples than its manifest says (URL named).
    """
    expected = _manifest_count(url)
    stream = open_shard(url)
    read = skip_samples
    try:
        members = ({**m, "__url__": url} for m in tar_file_iterator(stream))
        records = itertools.chain.from_iterable(map(_expand, group_by_keys(members)))
        for sample in itertools.islice(records, skip_samples, None):
            read += 1
            yield sample
    except ShardError:
        raise
    except Exception as exn:  # tarfile / decoding errors of any kind: name the shard
        raise ShardError(f"shard {url!r}: cannot read ({type(exn).__name__}: {exn})") from exn
    finally:
        stream.close()
    if expected is not None and read != expected:
        raise ShardError(f"shard {url!r}: {MANIFEST_NAME} lists {expected} samples, read "
                         f"{read} (truncated or corrupt)")


def read_manifest(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``shards.json`` manifest written by :func:`write_shards`.

    Raises:
        ShardError: the directory has no manifest.
    """
    path = Path(out_dir) / MANIFEST_NAME
    if not path.exists():
        raise ShardError(f"shard directory {str(out_dir)!r}: no {MANIFEST_NAME}")
    return json.loads(path.read_text())
