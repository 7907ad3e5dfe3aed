"""The schema of the working tier's ``state.json`` (``rlbuffers/storage/working.py``).

``state.json`` is data on disk that anybody who can write the buffer's directory may have
written, so it is checked before anything trusts it; a state that fails the check is treated
as missing (the working tier is rebuilt whole from the last commit).
"""

from __future__ import annotations

from typing import Any

#: Most dirty chunks a state may list before it is looked at more closely (the layout limits
#: a buffer to 2^22 base chunks; see ``manifest_schema.check_limits``).
MAX_BASE_CHUNKS = 2**22


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_state(state: Any, n_base_chunks: int) -> str | None:
    """Why ``state`` (a parsed ``state.json``) is not a valid working-tier state of a tier
    with ``n_base_chunks`` base chunks, or None if it is.

    A valid state is a JSON object whose optional keys have these types: ``buffer_id`` and
    ``boot_id`` strings, ``commit`` an integer >= 0 (``generation``, its old name, is renamed
    before the check), ``layout`` a list of two integers >= 1, ``dirty_chunks`` a list of
    distinct integers in ``[0, n_base_chunks)``, ``files`` a digest (a string of at most
    64 characters) of the tier's files.

    Returns:
        ``"key 'K': expected E, got A"``, or None.
    """
    if not isinstance(state, dict):
        return f"expected a JSON object, got {type(state).__name__}"
    for key in ("buffer_id", "boot_id"):
        if key in state and not isinstance(state[key], str):
            return f"key {key!r}: expected a string, got {state[key]!r:.80}"
    if "commit" in state and not (_is_int(state["commit"]) and state["commit"] >= 0):
        return f"key 'commit': expected an integer >= 0, got {state['commit']!r:.80}"
    layout = state.get("layout", [1, 1])
    if not (isinstance(layout, list) and len(layout) == 2
            and all(_is_int(v) and v >= 1 for v in layout)):
        return f"key 'layout': expected [capacity, chunk_transitions], got {layout!r:.80}"
    files = state.get("files", "")
    if not (isinstance(files, str) and len(files) <= 64):
        return f"key 'files': expected a digest string, got {files!r:.80}"
    return _check_dirty(state.get("dirty_chunks", []), n_base_chunks)


def _check_dirty(dirty: Any, n_base_chunks: int) -> str | None:
    if not isinstance(dirty, list) or len(dirty) > min(n_base_chunks, MAX_BASE_CHUNKS):
        return (f"key 'dirty_chunks': expected a list of at most {n_base_chunks} chunk "
                f"numbers, got {dirty!r:.80}")
    for c in dirty:
        if not (_is_int(c) and 0 <= c < n_base_chunks):
            return (f"key 'dirty_chunks': expected integers in [0, {n_base_chunks}), "
                    f"got {c!r:.80}")
    if len(set(dirty)) != len(dirty):
        return "key 'dirty_chunks': expected distinct chunk numbers, got a repeated one"
    return None
