"""The commit record of a buffer: ``manifest.json`` in the root of the Zarr group, read and
written as a typed :class:`Manifest`.

The manifest is the only file whose content says what is committed. It is written last in a
save and replaced atomically (see :meth:`Location.write_atomic`), so readers see either the
previous commit or the new one, never a mix. ``docs/format.md`` documents every key.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbuffers.errors import ManifestError, NotABufferError
from rlbuffers.ring import RingState
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.layout import ChunkLayout
from rlbuffers.storage.location import LocalLocation, Location
from rlbuffers.storage.manifest_schema import check_manifest_json, check_version

MANIFEST = "manifest.json"
#: Version of the on-disk format this code writes; it reads this and older. Version 3 keeps
#: every chunk version in its own commit's array and lists the committed chunks in the
#: manifest (``chunks``), with older commits kept readable (``keep_commits``); version 2
#: added per-field chunk sizes (``field_chunk_transitions``); version 1 chunked every field by
#: ``chunk_transitions``.
FORMAT_VERSION = 3
#: The format of a buffer with a frame-stacked field (``FieldSpec(stack_axis=)``) or a derived
#: next field (``next_of``): version 3 plus ``stack_axis`` in a field spec (whose array then
#: holds one frame per transition), the ``next_of`` key and the ``_head_<field>`` /
#: ``_final_<field>`` internal columns (``docs/format.md``, "Frame stacks"). Written only for
#: such buffers, so a format-3 reader refuses them (FormatVersionError) instead of misreading
#: a frame column as whole stacks; every other buffer stays format 3.
STACKED_FORMAT_VERSION = 4
#: The newest format this code reads.
READ_FORMAT_VERSION = STACKED_FORMAT_VERSION
#: Commits kept readable by default (the newest and the one before it).
KEEP_COMMITS = 2
#: The JSON keys of :attr:`Manifest.commit` and :attr:`Manifest.keep_commits` in
#: ``manifest.json``. They keep their format-3 spelling (the counter was once called the
#: generation), so every format-3 reader opens what this code writes (``docs/format.md``).
COMMIT_KEY = "generation"
KEEP_COMMITS_KEY = "keep_generations"
#: A committed chunk: (commit whose array holds it, stored bytes).
ChunkEntry = tuple[int, int]


@dataclass(frozen=True)
class Manifest:
    """One commit of a buffer.

    Attributes:
        buffer_id: random hex id given at create (ties a working tier to its buffer).
        layout: capacity and chunk sizes (base and stored, per field).
        fields: user field name -> spec. codecs: user field name -> codec name.
        internal: internal column name (``_episode_id``, ``_priority``) -> spec.
        ring: transitions ever added and episodes ended.
        commit: commit number (0 at create, +1 per save).
        committed_at: Unix time of the commit, seconds.
        sampler: the sampler's ``state_dict()``. rng: the buffer generator's
            ``bit_generator.state``. metadata: the user's JSON dict from ``save(metadata=)``.
        chunks: column -> {stored chunk index: (commit whose array holds it, bytes)}:
            every chunk this commit has; a chunk not listed was never written (reads as the
            fill value). None for format 1-2 manifests until the tier lists their chunks.
        keep_commits: how many of the newest commits stay readable (>= 1).
        format_version: the format this commit is in.
        next_of: derived field name -> the stacked field it is the next observation of
            (``ReplayBuffer.create(next_of=)``); it has no column of its own.
    """

    buffer_id: str
    layout: ChunkLayout
    fields: dict[str, FieldSpec]
    codecs: dict[str, str]
    internal: dict[str, FieldSpec]
    ring: RingState
    commit: int
    committed_at: float
    sampler: dict[str, Any]
    rng: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)
    chunks: dict[str, dict[int, ChunkEntry]] | None = None
    keep_commits: int = KEEP_COMMITS
    format_version: int = FORMAT_VERSION
    next_of: dict[str, str] = field(default_factory=dict)

    @property
    def capacity(self) -> int:
        return self.layout.capacity

    @property
    def specs(self) -> dict[str, FieldSpec]:
        """Every column as stored per slot: user fields (a stacked field: one frame,
        :attr:`FieldSpec.column`), then internal ones."""
        return {**{n: s.column for n, s in self.fields.items()}, **self.internal}

    def replace(self, **changes: Any) -> Manifest:
        """A copy with ``changes`` (as :func:`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """The JSON object stored in ``manifest.json``."""
        ring = self.ring
        out: dict[str, Any] = {
            "format": "rlbuffers",
            "format_version": self.format_version,
            "buffer_id": self.buffer_id,
            "capacity": self.capacity,
            "chunk_transitions": self.layout.base_chunk_rows,
            "fields": {n: {**s.to_dict(), "codec": self.codecs[n]} for n, s in self.fields.items()},
            "internal": {n: s.to_dict() for n, s in self.internal.items()},
            COMMIT_KEY: self.commit,
            "cursor": ring.cursor,
            "size": ring.size,
            "total_added": ring.total_added,
            "episodes": ring.episodes,
            "episode_id": ring.episodes,
            "metadata": self.metadata,
            "committed_at": self.committed_at,
            "sampler": self.sampler,
            "rng": self.rng,
        }
        if self.next_of:
            out["next_of"] = dict(self.next_of)
        if self.format_version >= 2:
            out["field_chunk_transitions"] = dict(self.layout.stored_chunk_rows)
        if self.format_version >= 3:
            out[KEEP_COMMITS_KEY] = self.keep_commits
            out["chunks"] = {n: [[c, g, b] for c, (g, b) in sorted(t.items())]
                             for n, t in (self.chunks or {}).items()}
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = MANIFEST) -> Manifest:
        """Parse (and upgrade) a manifest object read from ``where``.

        Raises:
            NotABufferError: not an rlbuffers manifest. ManifestError (a NotABufferError): a
            key breaks the schema (:mod:`rlbuffers.storage.manifest_schema`).
            FormatVersionError: written by a newer format version.
        """
        version = check_version(data, where, READ_FORMAT_VERSION)
        data = upgrade(data)
        check_manifest_json(data, where)
        try:
            capacity = data["capacity"]
            return cls(
                buffer_id=data.get("buffer_id", ""),
                layout=ChunkLayout(capacity, data["chunk_transitions"],
                                   dict(data["field_chunk_transitions"])),
                fields={n: FieldSpec.from_dict(d) for n, d in data["fields"].items()},
                codecs={n: d["codec"] for n, d in data["fields"].items()},
                internal={n: FieldSpec.from_dict(d) for n, d in data["internal"].items()},
                ring=RingState(capacity, data["total_added"], data["episodes"]),
                commit=data[COMMIT_KEY],
                committed_at=float(data["committed_at"]),
                sampler=dict(data["sampler"]),
                rng=dict(data["rng"]),
                metadata=dict(data["metadata"]),
                chunks=None if version < 3 else {
                    n: {c: (g, b) for c, g, b in data["chunks"].get(n, [])}
                    for n in [*data["fields"], *data["internal"]]},
                keep_commits=data.get(KEEP_COMMITS_KEY, KEEP_COMMITS),
                format_version=version,
                next_of=dict(data.get("next_of", {})),
            )
        except (KeyError, TypeError, ValueError) as e:  # the schema should have caught it
            raise ManifestError(where, "?", "a manifest the schema accepts",
                                f"{type(e).__name__}: {e}") from None


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """Bring a manifest object of any older format up to the current one's keys (a copy).

    Format 1 chunked every field by ``chunk_transitions``: it gets
    ``field_chunk_transitions`` saying so.
    """
    data = dict(data)
    if data["format_version"] < 2 or not data.get("field_chunk_transitions"):
        fields, internal = data.get("fields"), data.get("internal")
        if isinstance(fields, dict) and isinstance(internal, dict):
            names = [*fields, *internal]
            data["field_chunk_transitions"] = {n: data.get("chunk_transitions") for n in names}
    return data


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to the local file ``path`` atomically."""
    LocalLocation(path.parent).write_atomic(path.name, json.dumps(data, indent=1).encode())


#: Directory of the retained commits' manifests, ``history/g<commit>.json``.
HISTORY = "history"


def history_file(commit: int) -> str:
    """Path (relative to the buffer) of the kept manifest of ``commit``."""
    return f"{HISTORY}/g{commit}.json"


def write_manifest(loc: Location, manifest: Manifest, rel: str = MANIFEST) -> None:
    """Write ``manifest`` at ``loc``/``rel`` (atomic replace, fsynced); at ``MANIFEST`` this is
    the commit."""
    loc.write_atomic(rel, json.dumps(manifest.to_json(), indent=1, sort_keys=True).encode())


def read_manifest(loc: Location, rel: str = MANIFEST) -> Manifest:
    """Read and check a manifest of the buffer at ``loc`` (default: the last commit's).

    Raises:
        NotABufferError: no buffer there (no manifest, or not valid rlbuffers JSON).
        FormatVersionError: the buffer was written by a newer format version.
    """
    try:
        data = json.loads(loc.read_bytes(rel))
    except NotABufferError:
        raise
    except FileNotFoundError:
        raise NotABufferError(f"{loc}: not an rlbuffers buffer (no {rel})") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too deep
        raise ManifestError(f"{loc}/{rel}", "(document)", "a JSON object",
                            f"unreadable JSON ({type(e).__name__}: {str(e)[:200]})") from None
    return Manifest.from_json(data, f"{loc}/{rel}")
