"""rlbuffers.storage.safe_files: writes inside a directory refuse symlinks (anywhere below the
root), FIFOs (without blocking), directories, devices and hard links, and never touch the
target they would have written through."""

from __future__ import annotations

import os

import numpy as np
import pytest

from rlbuffers.errors import UnsafePathError
from rlbuffers.storage.safe_files import (
    append_inside,
    check_regular,
    create_npy_inside,
    open_file_inside,
    open_inside,
    open_npy_inside,
    parts_of,
    remove_inside,
    stat_inside,
    write_atomic_inside,
)


@pytest.fixture
def root(tmp_path):
    (tmp_path / "root" / "sub").mkdir(parents=True)
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    return tmp_path / "root", outside


def _writers():
    return {
        "atomic": lambda r, rel: write_atomic_inside(r, rel, b"new"),
        "append": lambda r, rel: append_inside(r, rel, b"new"),
        "open_rw": lambda r, rel: os.close(open_inside(r, rel, os.O_RDWR)),
        "open_create": lambda r, rel: os.close(open_inside(r, rel, os.O_RDWR | os.O_CREAT)),
        "file_a": lambda r, rel: open_file_inside(r, rel, "a").close(),
    }


@pytest.mark.parametrize("how", sorted(_writers()))
def test_symlinked_dir_component_is_refused(root, how, tmp_path):
    r, outside = root
    os.symlink(tmp_path, r / "link")
    with pytest.raises(UnsafePathError, match="link: is a symlink"):
        _writers()[how](r, "link/outside.txt")
    assert outside.read_bytes() == b"precious"


@pytest.mark.parametrize("how", sorted(set(_writers()) - {"atomic"}))
def test_symlinked_file_is_refused(root, how):
    r, outside = root
    os.symlink(outside, r / "sub" / "f")
    with pytest.raises(UnsafePathError, match="is a symlink"):
        _writers()[how](r, "sub/f")
    assert outside.read_bytes() == b"precious"


def test_atomic_write_replaces_a_symlink_instead_of_following_it(root):
    r, outside = root
    os.symlink(outside, r / "sub" / "f")
    write_atomic_inside(r, "sub/f", b"new")
    assert not os.path.islink(r / "sub" / "f")
    assert (r / "sub" / "f").read_bytes() == b"new"
    assert outside.read_bytes() == b"precious"
    assert os.listdir(r / "sub") == ["f"]  # no temporary left


@pytest.mark.parametrize("how", sorted(set(_writers()) - {"atomic"}))
def test_fifo_is_refused_without_blocking(root, how):
    r, _ = root
    os.mkfifo(r / "sub" / "f")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        _writers()[how](r, "sub/f")


def test_fifo_is_refused_for_reading_too(root):
    r, _ = root
    os.mkfifo(r / "f")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        open_file_inside(r, "f", "rb")


@pytest.mark.parametrize("how", sorted(set(_writers()) - {"atomic"}))
def test_directory_is_refused(root, how):
    r, _ = root
    with pytest.raises(UnsafePathError, match="not a regular file"):
        _writers()[how](r, "sub")


def test_hard_link_is_not_written_in_place(root):
    r, outside = root
    os.link(outside, r / "f")
    with pytest.raises(UnsafePathError, match="2 hard links"):
        append_inside(r, "f", b"x")
    assert outside.read_bytes() == b"precious"
    write_atomic_inside(r, "f", b"new")  # a replacement unlinks the name only
    assert outside.read_bytes() == b"precious"
    assert (r / "f").read_bytes() == b"new"


@pytest.mark.parametrize("rel", ["/etc/passwd", "../outside.txt", "sub/../../x", "", "."])
def test_paths_leaving_the_root_are_refused(root, rel):
    r, outside = root
    with pytest.raises(UnsafePathError, match="relative path"):
        write_atomic_inside(r, rel, b"x")
    with pytest.raises(UnsafePathError):
        parts_of(rel)
    assert outside.read_bytes() == b"precious"


def test_root_may_be_a_symlink(root, tmp_path):
    r, _ = root
    os.symlink(r, tmp_path / "alias")
    write_atomic_inside(tmp_path / "alias", "sub/x", b"1")
    append_inside(tmp_path / "alias", "sub/x", b"2")
    assert (r / "sub" / "x").read_bytes() == b"12"


def test_make_dirs_creates_real_directories_and_refuses_planted_ones(root, tmp_path):
    r, outside = root
    write_atomic_inside(r, "a/b/c.bin", b"x", make_dirs=True)
    assert (r / "a" / "b" / "c.bin").read_bytes() == b"x"
    os.symlink(tmp_path, r / "d")
    with pytest.raises(UnsafePathError, match="is a symlink"):
        write_atomic_inside(r, "d/e/f", b"x", make_dirs=True)
    assert not (tmp_path / "e").exists()


def test_failed_atomic_write_keeps_target_and_leaves_no_temporary(root):
    r, _ = root
    (r / "t").write_bytes(b"old")

    def boom(f):
        f.write(b"partial")
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError, match="writer failed"):
        write_atomic_inside(r, "t", boom)
    assert (r / "t").read_bytes() == b"old"
    assert sorted(os.listdir(r)) == ["sub", "t"]


def test_round_trips(root):
    r, _ = root
    write_atomic_inside(r, "sub/j.json", lambda f: f.write(b'{"a": 1}'))
    with open_file_inside(r, "sub/j.json", "r") as f:
        assert f.read() == '{"a": 1}'
    with open_file_inside(r, "sub/log", "a") as f:
        f.write("one\n")
    append_inside(r, "sub/log", b"two\n")
    assert (r / "sub" / "log").read_text() == "one\ntwo\n"
    with pytest.raises(ValueError, match="mode: expected one of"):
        open_file_inside(r, "sub/log", "w")


def test_check_regular(root):
    r, outside = root
    assert check_regular(outside).st_size == len(b"precious")
    os.symlink(outside, r / "l")
    os.mkfifo(r / "p")
    with pytest.raises(UnsafePathError, match="is a symlink"):
        check_regular(r / "l")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        check_regular(r / "p")
    with pytest.raises(FileNotFoundError):
        check_regular(r / "missing")


def test_npy_maps_are_made_and_opened_without_following_symlinks(root):
    r, outside = root
    os.symlink(outside, r / "sub" / "a.npy")
    create_npy_inside(r, "sub/a.npy", np.float32, (5, 3))  # replaces the symlink
    assert outside.read_bytes() == b"precious" and not (r / "sub" / "a.npy").is_symlink()
    m = open_npy_inside(r, "sub/a.npy", "r+")
    assert m.shape == (5, 3) and m.dtype == np.float32 and not m.any()
    m[2] = 7
    m.flush()
    del m
    np.testing.assert_array_equal(np.load(r / "sub" / "a.npy")[2], [7, 7, 7])
    os.remove(r / "sub" / "a.npy")
    os.symlink(outside, r / "sub" / "a.npy")
    with pytest.raises(UnsafePathError, match="a.npy: is a symlink"):
        open_npy_inside(r, "sub/a.npy", "r")
    os.remove(r / "sub" / "a.npy")
    os.mkfifo(r / "sub" / "a.npy")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        open_npy_inside(r, "sub/a.npy", "r")  # without blocking
    np.save(r / "short.npy", np.zeros(4))
    with open(r / "short.npy", "r+b") as f:
        f.truncate(os.path.getsize(r / "short.npy") - 8)
    with pytest.raises(ValueError, match="expected at least"):
        open_npy_inside(r, "short.npy", "r")
    (r / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(ValueError):
        open_npy_inside(r, "junk.npy", "r")


def test_stat_and_remove_inside(root, tmp_path):
    r, outside = root
    (r / "sub" / "f").write_bytes(b"abc")
    assert stat_inside(r, "sub/f").st_size == 3
    os.symlink(r / "sub", r / "linkdir")
    with pytest.raises(UnsafePathError, match="linkdir: is a symlink"):
        stat_inside(r, "linkdir/f")
    os.mkfifo(r / "p")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        stat_inside(r, "p")
    os.symlink(outside, r / "l")
    for rel in ("l", "p", "sub", "missing", "linkdir"):
        remove_inside(r, rel)
    assert outside.read_bytes() == b"precious"
    assert sorted(os.listdir(r)) == []
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "k").write_bytes(b"k")
    (r / "d").mkdir()
    os.symlink(tmp_path / "keep", r / "d" / "into")
    remove_inside(r, "d")  # rmtree does not follow the symlink below it
    assert (tmp_path / "keep" / "k").read_bytes() == b"k"
