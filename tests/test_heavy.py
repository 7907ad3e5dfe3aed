"""tests/heavy.py: a missing heavy package skips with an install hint locally, fails under CI."""

import pytest

from tests.heavy import require


def test_missing_package_skips_locally_and_fails_under_ci(monkeypatch):
    monkeypatch.delenv("RLBUFFERS_REQUIRE_ALL", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs no_such_pkg_xyz .*pip install"):
        require("numpy", "no_such_pkg_xyz")
    monkeypatch.setenv("RLBUFFERS_REQUIRE_ALL", "1")
    with pytest.raises(ImportError, match="no_such_pkg_xyz"):
        require("no_such_pkg_xyz")
    require("numpy")  # present: nothing happens
