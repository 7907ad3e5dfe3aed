"""The persistent tier's interface is what storage code actually uses: ZarrTier implements
:class:`PersistentTier`, and every attribute the library reads off a tier is declared there."""

import ast
from pathlib import Path

from rlbuffers import ReplayBuffer
from rlbuffers.storage.engine import open_tier
from rlbuffers.storage.location import make_location
from rlbuffers.storage.persistent import PersistentTier
from rlbuffers.storage.zarr_tier import ZarrTier
from tests.conftest import make_batch

LIBRARY = Path(__file__).resolve().parents[1] / "rlbuffers"


def _declared() -> set[str]:
    return {n for n in dir(PersistentTier) if not n.startswith("_")} | set(
        PersistentTier.__annotations__)


def test_zarr_tier_implements_the_interface(tmp_path, fields):
    with ReplayBuffer.create(tmp_path / "b", capacity=8, fields=fields, chunk_transitions=4) as w:
        w.extend(make_batch(0, 6))
        w.save()
        w.extend(make_batch(6, 2))
        w.save()
    tier = open_tier(make_location(tmp_path / "b"))
    assert isinstance(tier, ZarrTier) and isinstance(tier, PersistentTier)
    for name in _declared():
        assert hasattr(tier, name), name
    assert (tier.manifest.commit, tier.reopen(commit=1).manifest.commit) == (2, 1)


def test_every_tier_attribute_the_library_uses_is_declared():
    """``tier.X`` anywhere in rlbuffers/ outside the Zarr implementation names a member of
    PersistentTier (so a second engine needs nothing the interface does not say)."""
    used = set()
    for path in LIBRARY.rglob("*.py"):
        if path.name == "zarr_tier.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and (
                    (isinstance(node.value, ast.Name) and node.value.id == "tier")
                    or (isinstance(node.value, ast.Attribute) and node.value.attr == "tier")):
                used.add(node.attr)
    assert {"manifest", "loc", "read_chunk", "stage_chunks", "commit"} <= used
    assert sorted(used - _declared()) == []
