"""The manifest fuzzer (``tools/fuzz/manifest.py``), bounded for the suite: tampered manifests
read by every entry point raise only rlbuffers' own exceptions, write nothing outside the buffer
directory and do not hang. ``python -m tools.fuzz.manifest --minutes 10`` runs it longer."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings

from tools.fuzz.manifest import check_one, make_template, mutations


def test_tampered_manifests_raise_only_rlbuffers_errors(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    template = make_template(root)
    manifest = json.loads((template / "manifest.json").read_text())
    tried = []

    @settings(max_examples=20, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(plan=mutations(manifest))
    def fuzz(plan):
        tried.append(plan)
        found = check_one(template, root / "sandbox", plan)
        assert found is None, f"{plan!r:.300}\n{found}"

    fuzz()
    assert len(tried) >= 20
