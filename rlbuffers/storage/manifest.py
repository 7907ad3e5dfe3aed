"""The commit record of a buffer: ``manifest.json`` in the root of the Zarr group.

The manifest is the only file whose content says what is committed. It is written last in a
save and replaced atomically (see :meth:`Location.write_atomic`), so readers see either the
previous commit or the new one, never a mix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlbuffers.errors import FormatVersionError, NotABufferError
from rlbuffers.storage.location import Location

MANIFEST = "manifest.json"
#: Version of the on-disk format this code writes; it reads this and older. Version 2 added
#: per-field chunk sizes (``field_chunk_transitions``); version 1 chunked every field by
#: ``chunk_transitions``.
FORMAT_VERSION = 2

def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to the local file ``path`` atomically."""
    Location(path.parent).write_atomic(path.name, json.dumps(data, indent=1).encode())


def write_manifest(loc: Location, data: dict[str, Any]) -> None:
    """Commit ``data`` as the manifest at ``loc`` (atomic replace)."""
    loc.write_atomic(MANIFEST, json.dumps(data, indent=1, sort_keys=True).encode())


def read_manifest(loc: Location) -> dict[str, Any]:
    """Read and check the manifest of the buffer at ``loc``.

    Raises:
        NotABufferError: no buffer there (no manifest, or not valid rlbuffers JSON).
        FormatVersionError: the buffer was written by a newer format version.
    """
    try:
        data = json.loads(loc.read_bytes(MANIFEST))
    except NotABufferError:
        raise
    except FileNotFoundError:
        raise NotABufferError(f"{loc}: not an rlbuffers buffer (no {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NotABufferError(f"{loc}/{MANIFEST}: not a valid manifest ({e})") from None
    if not isinstance(data, dict) or data.get("format") != "rlbuffers":
        raise NotABufferError(f"{loc}/{MANIFEST}: not an rlbuffers manifest")
    version = data.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{loc}: format version {version} is newer than this rlbuffers reads "
            f"({FORMAT_VERSION}); upgrade rlbuffers"
        )
    return data


def field_chunk_rows(data: dict[str, Any]) -> dict[str, int]:
    """Field name (internal fields included) -> transitions per stored chunk, from a manifest
    (format 1 manifests chunk every field by ``chunk_transitions``)."""
    names = [*data["fields"], *data["internal"]]
    rows = data.get("field_chunk_transitions") or {}
    return {n: int(rows.get(n, data["chunk_transitions"])) for n in names}
