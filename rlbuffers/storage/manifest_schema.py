"""The manifest schema: the one check of a ``manifest.json`` (or ``history/g<N>.json``) object,
applied on every read (``ReplayBuffer.open``, ``inspect``, ``verify``, ``repair``) before
anything else looks at it, and of the manifest against what is on disk.

A manifest is data from the disk, so possibly written by someone else: every key is checked for
its type and range, the keys that depend on each other are checked together, field names are
checked by the same rule as at ``create`` (:func:`rlbuffers.spec.field_name_problem`), and the
sizes that decide how much the buffer allocates (capacity, chunks, row bytes) have the same
bounds as at ``create``. Anything wrong is one :class:`~rlbuffers.errors.ManifestError` naming
the key, the expected and the actual value. ``docs/format.md`` lists the keys.
"""

from __future__ import annotations

import math
from typing import Any

from rlbuffers.errors import FieldError, FormatVersionError, ManifestError, NotABufferError
from rlbuffers.intmath import ceil_div
from rlbuffers.spec import FieldSpec, field_name_problem
from rlbuffers.storage.compression import check_codec
from rlbuffers.storage.framestack_columns import manifest_problem

#: Most slots of a buffer (a working tier of capacity x row bytes is allocated on open).
MAX_CAPACITY = 2**40
#: Most base chunks of a buffer (``ceil(capacity / chunk_transitions)``): sets of base chunk
#: numbers are built on open and save.
MAX_BASE_CHUNKS = 2**22
#: Most kept commits.
MAX_KEEP_COMMITS = 2**20
#: Largest commit number.
MAX_COMMIT = 2**62
#: Bit generators a manifest's ``rng`` may name.
BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")
#: The keys every manifest has (format 1-2 lack ``chunks`` and ``keep_generations``).
REQUIRED = ("capacity", "chunk_transitions", "fields", "internal", "generation", "total_added",
            "episodes", "committed_at", "sampler", "rng", "metadata")


def _fail(where: str, key: str, expected: str, value: Any) -> ManifestError:
    text = repr(value)
    return ManifestError(where, key, expected, text if len(text) <= 120 else text[:117] + "...")


def _int(where: str, data: dict[str, Any], key: str, lo: int, hi: int, value: Any = None,
         *, path: str | None = None) -> int:
    v = data[key] if value is None else value
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _fail(where, path or key, f"an integer in [{lo}, {hi}]", v)
    return v


def check_limits(capacity: int, chunk_transitions: int,
                 keep_commits: int) -> tuple[str, str, int] | None:
    """``(key, expected, actual)`` of the first size out of the bounds every buffer keeps, or
    None: checked at ``create`` and on every manifest read."""
    if capacity > MAX_CAPACITY:
        return "capacity", f"at most {MAX_CAPACITY}", capacity
    if ceil_div(capacity, chunk_transitions) > MAX_BASE_CHUNKS:
        return ("chunk_transitions", f"at least capacity / {MAX_BASE_CHUNKS} = "
                f"{ceil_div(capacity, MAX_BASE_CHUNKS)} (at most {MAX_BASE_CHUNKS} chunks)",
                chunk_transitions)
    if keep_commits > MAX_KEEP_COMMITS:
        return "keep_commits", f"at most {MAX_KEEP_COMMITS}", keep_commits
    return None


def check_version(data: Any, where: str, latest: int) -> int:
    """The format version of a manifest object.

    Raises:
        NotABufferError: not an rlbuffers manifest. FormatVersionError: newer than ``latest``.
        ManifestError: a version that is not an integer >= 1.
    """
    if not isinstance(data, dict) or data.get("format") != "rlbuffers":
        raise NotABufferError(f"{where}: not an rlbuffers manifest")
    version = data.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _fail(where, "format_version", f"an integer in [1, {latest}]", version)
    if version > latest:
        raise FormatVersionError(f"{where}: format version {version} is newer than this "
                                 f"rlbuffers reads ({latest}); upgrade rlbuffers")
    return version


def check_manifest_json(data: dict[str, Any], where: str) -> None:
    """Check an (upgraded) manifest object of any format version against the schema.

    Raises:
        ManifestError: the first key that breaks it.
    """
    v3 = ("chunks",) if data.get("format_version", 0) >= 3 else ()
    for key in (*REQUIRED, "field_chunk_transitions", *v3):
        if key not in data:
            raise ManifestError(where, key, "the key to be present", "nothing (missing)")
    capacity = _int(where, data, "capacity", 1, MAX_CAPACITY)
    base = _int(where, data, "chunk_transitions", 1, MAX_CAPACITY)
    keep = _int(where, data, "keep_generations", 1, MAX_KEEP_COMMITS,
                data.get("keep_generations", 1))
    problem = check_limits(capacity, base, keep)
    if problem:
        key, expected, actual = problem
        raise _fail(where, "keep_generations" if key == "keep_commits" else key, expected,
                    actual)
    commit = _int(where, data, "generation", 0, MAX_COMMIT)
    _check_ring(data, where, capacity)
    _check_records(data, where)
    specs = _check_specs(data, where)
    problem = manifest_problem({n: FieldSpec.from_dict(d) for n, d in data["fields"].items()},
                               {n: FieldSpec.from_dict(d) for n, d in data["internal"].items()},
                               data.get("next_of", {}), data["format_version"])
    if problem:
        raise _fail(where, *problem)
    _check_stored(data, where, specs, capacity, base)
    if "chunks" in data:
        _check_chunks(data["chunks"], where, specs, data["field_chunk_transitions"], capacity,
                      commit)


def _check_filled(data: dict[str, Any], where: str, specs: dict[str, Any]) -> None:
    """Every stored chunk holding a filled slot (``[0, size)``) was written by a save, so the
    chunk table lists it (an unlisted chunk reads as the fill value)."""
    size = min(data["total_added"], data["capacity"])
    for name in specs:
        k = data["field_chunk_transitions"][name]
        listed = {row[0] for row in data["chunks"].get(name, [])}
        missing = sorted(set(range(ceil_div(size, k))) - listed)
        if missing:
            raise _fail(where, f"chunks.{name}", f"every chunk holding slots [0, {size}) "
                        f"listed (size = {size})", f"chunks {missing[:5]} not listed")


def check_arrays(arrays: dict[str, Any], data: dict[str, Any], where: str) -> None:
    """Check the manifest (``data``, upgraded and schema-checked) against the arrays' metadata
    on disk (``arrays``: column -> its ``<column>/zarr.json`` object, or None if missing):
    shape ``[capacity, *row]``, chunks ``[stored rows, *row]`` and, where recorded, the field
    spec.

    Raises:
        ManifestError: a column whose array is missing or disagrees, or a filled chunk the
        chunk table does not list.
    """
    if "chunks" in data:
        _check_filled(data, where, {**data["fields"], **data["internal"]})
    for key in ("fields", "internal"):
        for name, d in data[key].items():
            spec = FieldSpec.from_dict(d).column
            meta = arrays.get(name)
            row = [] if spec.ragged else list(spec.row_shape)
            shape = [data["capacity"], *row]
            chunks = [data["field_chunk_transitions"][name], *row]
            if not isinstance(meta, dict):
                raise _fail(where, f"{key}.{name}", f"a column whose array {name}/zarr.json "
                            "exists", "no such array")
            grid = meta.get("chunk_grid")
            got_chunks = (grid.get("configuration", {}).get("chunk_shape")
                          if isinstance(grid, dict) else None)
            recorded = (meta.get("attributes") or {}).get("rlbuffers_field")
            if meta.get("shape") != shape:
                raise _fail(where, "capacity" if meta.get("shape", [None])[:1] != shape[:1]
                            else f"{key}.{name}.shape",
                            f"the shape of the array {name}/zarr.json, {meta.get('shape')}",
                            shape)
            if got_chunks != chunks:
                raise _fail(where, f"field_chunk_transitions.{name}", "the chunk shape of the "
                            f"array {name}/zarr.json, {got_chunks}", chunks)
            if isinstance(recorded, dict) and (recorded.get("shape"), recorded.get("dtype")) \
                    != (list(spec.shape), spec.dtype.str):
                raise _fail(where, f"{key}.{name}", f"the spec recorded in {name}/zarr.json, "
                            f"{recorded}", d)


def _check_ring(data: dict[str, Any], where: str, capacity: int) -> None:
    total = _int(where, data, "total_added", 0, 2**62)
    _int(where, data, "episodes", 0, total)
    if "cursor" in data and data["cursor"] != total % capacity:
        raise _fail(where, "cursor", f"total_added % capacity = {total % capacity}",
                    data["cursor"])
    if "size" in data and data["size"] != min(total, capacity):
        raise _fail(where, "size", f"min(total_added, capacity) = {min(total, capacity)}",
                    data["size"])


def _check_records(data: dict[str, Any], where: str) -> None:
    at = data["committed_at"]
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at) \
            or not 0 <= at < 2**40:
        raise _fail(where, "committed_at", "a finite Unix time in seconds", at)
    if not isinstance(data.get("buffer_id", ""), str) or len(data.get("buffer_id", "")) > 64:
        raise _fail(where, "buffer_id", "a string of at most 64 characters",
                    data.get("buffer_id"))
    for key in ("sampler", "rng", "metadata"):
        if not isinstance(data[key], dict):
            raise _fail(where, key, "a JSON object", data[key])
    if not isinstance(data["sampler"].get("type"), str):
        raise _fail(where, "sampler.type", "a sampler name (a string)",
                    data["sampler"].get("type"))
    if data["rng"].get("bit_generator") not in BIT_GENERATORS:
        raise _fail(where, "rng.bit_generator", f"one of {BIT_GENERATORS}",
                    data["rng"].get("bit_generator"))


def _check_stored(data: dict[str, Any], where: str, specs: dict[str, FieldSpec], capacity: int,
                  base: int) -> None:
    stored = data["field_chunk_transitions"]
    if not isinstance(stored, dict) or set(stored) != set(specs):
        raise _fail(where, "field_chunk_transitions", f"a size for each of {sorted(specs)}",
                    stored)
    n_base = ceil_div(capacity, base)
    for name, k in stored.items():
        _int(where, stored, name, base, base * n_base, path=f"field_chunk_transitions.{name}")
        if k % base:
            raise _fail(where, f"field_chunk_transitions.{name}",
                        f"a multiple of chunk_transitions ({base})", k)
        if specs[name].ragged and k != base:
            raise _fail(where, f"field_chunk_transitions.{name}",
                        f"chunk_transitions ({base}) for a ragged field", k)


def _check_specs(data: dict[str, Any], where: str) -> dict[str, FieldSpec]:
    specs: dict[str, FieldSpec] = {}
    for key, internal in (("fields", False), ("internal", True)):
        table = data[key]
        if not isinstance(table, dict) or (not internal and not table):
            raise _fail(where, key, "a JSON object of field name -> spec"
                        + ("" if internal else " (at least one)"), table)
        for name, d in table.items():
            problem = field_name_problem(name, ("indices", "weights"), internal=internal)
            if problem:
                raise _fail(where, f"{key}.{name}", f"a field name that {problem}", name)
            try:
                spec = FieldSpec.from_dict(d)
            except FieldError as e:
                raise _fail(where, f"{key}.{name}", f"a valid field spec ({e})", d) from None
            if not internal:
                try:
                    check_codec(d.get("codec"), name)
                except (ValueError, TypeError) as e:
                    raise _fail(where, f"fields.{name}.codec", str(e), d.get("codec")) from None
            specs[name] = spec
    if set(data["fields"]) & set(data["internal"]):
        raise _fail(where, "internal", "names distinct from the fields'",
                    sorted(set(data["fields"]) & set(data["internal"])))
    return specs


def _check_chunks(chunks: Any, where: str, specs: dict[str, FieldSpec], stored: dict[str, int],
                  capacity: int, commit: int) -> None:
    if not isinstance(chunks, dict) or not set(chunks) <= set(specs):
        raise _fail(where, "chunks", f"a JSON object keyed by columns of {sorted(specs)}",
                    chunks if not isinstance(chunks, dict) else sorted(chunks))
    for name, rows in chunks.items():
        n_stored = ceil_div(capacity, stored[name])
        key = f"chunks.{name}"
        if not isinstance(rows, list):
            raise _fail(where, key, "a list of [chunk, commit, bytes]", rows)
        seen = set()
        for row in rows:
            if not (isinstance(row, list) and len(row) == 3 and all(
                    isinstance(v, int) and not isinstance(v, bool) for v in row)):
                raise _fail(where, key, "a list of [chunk, commit, bytes] (integers)", row)
            c, g, b = row
            if not 0 <= c < n_stored or c in seen:
                raise _fail(where, key, f"distinct chunk numbers in [0, {n_stored})", row)
            if not 0 <= g <= commit:
                raise _fail(where, key, f"a commit number in [0, {commit}] (generation)", row)
            if not 0 <= b < 2**62:
                raise _fail(where, key, "a size in bytes >= 0", row)
            seen.add(c)
