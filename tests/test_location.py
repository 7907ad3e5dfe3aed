"""``make_location`` picks the Location by URL, and both implementations behave the same on
what the persistent tier calls (memory:// stands in for an object store here; moto's S3 runs
in tests/test_object_store.py)."""

import uuid

import pytest

from rlbuffers.errors import NotABufferError
from rlbuffers.storage.location import FsspecLocation, LocalLocation, make_location


def test_paths_and_file_urls_are_local_other_urls_use_fsspec(tmp_path):
    for url in (tmp_path / "b", str(tmp_path / "b"), f"file://{tmp_path}/b"):
        loc = make_location(url)
        assert type(loc) is LocalLocation and loc.local and loc.root == tmp_path / "b"
        assert loc.path == tmp_path / "b"
    loc = make_location("memory://bucket/b", {"skip_instance_cache": True})
    assert type(loc) is FsspecLocation and not loc.local and loc.root is None
    assert loc.path == "memory://bucket/b" and loc.zarr_args("x") == {
        "store": "memory://bucket/b/x", "storage_options": {"skip_instance_cache": True}}


def test_storage_options_with_a_local_path_are_refused(tmp_path):
    with pytest.raises(ValueError, match="storage_options: only for URLs"):
        make_location(tmp_path / "b", {"key": "k"})


@pytest.fixture(params=["local", "memory"])
def loc(request, tmp_path):
    if request.param == "local":
        return make_location(tmp_path / "b")
    return make_location(f"memory://rlbuffers-test-{uuid.uuid4().hex}/b")


def test_both_locations_do_the_same(loc):
    with pytest.raises(NotABufferError):
        loc.read_bytes("manifest.json")
    loc.write_atomic("a/x.json", b"1")
    loc.write_atomic("a/x.json", b"22")  # replaces
    loc.copy("a/x.json", "c/y.json")
    loc.move("a/x.json", "a/z.json")
    loc.sync_tree("a")
    loc.sync_dirs(["a", "c"])
    assert (loc.read_bytes("a/z.json"), loc.read_bytes("c/y.json")) == (b"22", b"22")
    assert loc.files() == {"a/z.json": 2, "c/y.json": 2} and loc.size("c/y.json") == 2
    assert sorted(loc.listdir()) == ["a", "c"] and loc.is_dir("a") and not loc.exists("a/x.json")
    with pytest.raises(FileNotFoundError):
        loc.read_bytes("a/x.json")
    loc.remove_file("a/z.json")
    loc.remove_file("a/z.json")  # already gone: nothing
    loc.remove_tree("c")
    loc.remove_tree("c")
    assert loc.files() == {}
