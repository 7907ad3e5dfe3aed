"""The commit record of a buffer: ``manifest.json`` in the root of the Zarr group.

The manifest is the only file whose content says what is committed. It is written last in a
save, to a temporary file that is fsynced and then renamed over the old one, so readers see
either the previous commit or the new one, never a mix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlbuffers.errors import FormatVersionError, NotABufferError

MANIFEST = "manifest.json"
#: Version of the on-disk format this code writes; it reads this and older.
FORMAT_VERSION = 1


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it survives power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temp file, fsync, rename, fsync dir)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_manifest(root: Path) -> dict[str, Any]:
    """Read and check the manifest of the buffer at ``root``.

    Raises:
        NotABufferError: ``root`` has no manifest, or it is not valid rlbuffers JSON.
        FormatVersionError: the buffer was written by a newer format version.
    """
    path = root / MANIFEST
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise NotABufferError(f"{root}: not an rlbuffers buffer (no {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NotABufferError(f"{path}: not a valid manifest ({e})") from None
    if not isinstance(data, dict) or data.get("format") != "rlbuffers":
        raise NotABufferError(f"{path}: not an rlbuffers manifest (no 'format': 'rlbuffers')")
    version = data.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{root}: format version {version} is newer than this rlbuffers reads "
            f"({FORMAT_VERSION}); upgrade rlbuffers"
        )
    return data
