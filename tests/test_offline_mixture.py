"""rlbuffers.mix: each batch from an offline and an online buffer with a fixed or scheduled
offline fraction (RLPD's symmetric sampling; a linear anneal), rows that are the buffers' own,
importance weights toward uniform over both, source indices, and exact resume of its state
(the offline buffer a read-only snapshot reader)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlbuffers import (
    BufferEmptyError,
    FieldSpec,
    LinearFraction,
    PrioritizedSampler,
    ReplayBuffer,
    mix,
)
from rlbuffers.sampling.mixture import OFFLINE, ONLINE

FIELDS = {"obs": FieldSpec((3,), "float32"), "reward": FieldSpec((), "float32"),
          "terminated": FieldSpec((), "bool")}


def _fill(buf, n, start, rng):
    buf.extend({"obs": (start + np.arange(n, dtype=np.float32))[:, None].repeat(3, 1),
                "reward": rng.normal(size=n).astype(np.float32),
                "terminated": np.arange(n) % 7 == 6})


@pytest.fixture
def pair(tmp_path):
    """An offline buffer (committed, opened read-only; an extra ``episode`` field, obs as
    float64) and an online one (obs 1000 + i)."""
    rng = np.random.default_rng(0)
    off = ReplayBuffer.create(tmp_path / "off", capacity=500,
                              fields={**FIELDS, "obs": FieldSpec((3,), "float64"),
                                      "episode": FieldSpec((), "int64")})
    off.extend({"obs": np.arange(300, dtype=np.float64)[:, None].repeat(3, 1),
                "reward": rng.normal(size=300).astype(np.float32),
                "terminated": np.arange(300) % 10 == 9, "episode": np.arange(300) // 10})
    off.save()
    off.close()
    on = ReplayBuffer.create(tmp_path / "on", capacity=200, fields=FIELDS, seed=3)
    _fill(on, 100, 1000, rng)
    reader = ReplayBuffer.open(tmp_path / "off", mode="r")
    yield reader, on
    reader.close()
    on.close()


def _check_rows(batch, off, on):
    """Every row is the buffer row its source and index name."""
    for src, buf in ((OFFLINE, off), (ONLINE, on)):
        mask = batch["source"] == src
        if mask.any():
            rows = buf[batch["indices"][mask]]  # ids == positions: neither buffer wrapped
            assert np.array_equal(batch["obs"][mask], rows["obs"].astype(np.float32))
            assert np.array_equal(batch["reward"][mask], rows["reward"])


def test_symmetric_sampling_is_half_and_half_with_source_indices(pair):
    off, on = pair
    m = mix(off, on, 0.5, seed=0)
    batch = m.sample(256)
    assert sorted(batch) == ["indices", "obs", "reward", "source", "terminated", "weights"]
    assert (batch["source"] == OFFLINE).sum() == 128 and m.last_counts == (128, 128)
    assert batch["obs"].dtype == np.float32 and batch["source"].dtype == np.uint8
    assert batch["indices"].dtype == np.int64 and batch["weights"].dtype == np.float32
    assert (batch["obs"][batch["source"] == OFFLINE] < 300).all()
    assert (batch["obs"][batch["source"] == ONLINE] >= 1000).all()
    _check_rows(batch, off, on)
    # weights toward uniform over the 400 rows: (300/400)/0.5 offline, (100/400)/0.5 online
    w = batch["weights"]
    assert np.allclose(w[batch["source"] == OFFLINE], 1.5)
    assert np.allclose(w[batch["source"] == ONLINE], 0.5)


def test_fractional_split_has_the_right_mean_and_stays_within_one_row(pair):
    m = mix(*pair, 0.25, seed=1)
    counts = [m.sample(10)["source"].tolist().count(OFFLINE) for _ in range(2000)]
    assert set(counts) == {2, 3}
    assert abs(np.mean(counts) - 2.5) < 0.05
    assert m.step == 2000


def test_linear_anneal_from_offline_to_online(pair):
    m = mix(*pair, LinearFraction(1.0, 0.0, 10), seed=0)
    fractions = []
    for _ in range(12):
        fractions.append(m.current_fraction())
        m.sample(20)
        assert m.last_counts[0] == round(fractions[-1] * 20)
    assert fractions[0] == 1.0 and fractions[5] == 0.5 and fractions[10:] == [0.0, 0.0]
    assert "LinearFraction" in repr(LinearFraction(1.0, 0.0, 10))


def test_fraction_zero_and_one_touch_one_buffer_only(pair, tmp_path):
    off, on = pair
    empty = ReplayBuffer.create(tmp_path / "empty", capacity=10, fields=FIELDS)
    assert (mix(off, empty, 1.0).sample(8)["source"] == OFFLINE).all()
    assert (mix(empty, on, 0.0).sample(8)["source"] == ONLINE).all()
    with pytest.raises(BufferEmptyError):
        mix(off, empty, 0.5).sample(8)
    empty.close()


def test_state_resumes_exactly(pair, tmp_path):
    off, on = pair
    sampler_on = ReplayBuffer.create(tmp_path / "per", capacity=200, fields=FIELDS,
                                     sampler=PrioritizedSampler(alpha=0.6, beta=0.4), seed=5)
    _fill(sampler_on, 150, 1000, np.random.default_rng(1))
    sampler_on.update_priorities(np.arange(150), np.linspace(0.1, 3.0, 150))
    for online in (on, sampler_on):
        m = mix(off, online, LinearFraction(0.9, 0.1, 6), seed=42)
        for _ in range(3):
            m.sample(32)
        state = json.loads(json.dumps(m.state_dict()))
        online.save()
        expected = [m.sample(32) for _ in range(4)]
        path = online.path
        online.close()
        reopened = ReplayBuffer.open(path)
        reader = ReplayBuffer.open(off.path, mode="r")  # another run's reader of the dataset
        again = mix(reader, reopened, LinearFraction(0.9, 0.1, 6), seed=7)
        again.load_state_dict(state)
        for want in expected:
            got = again.sample(32)
            assert got.keys() == want.keys()
            for k in want:
                assert np.array_equal(got[k], want[k]), k
        if online is sampler_on:  # prioritized weights multiplied in, not uniform
            assert len(np.unique(got["weights"][got["source"] == ONLINE])) > 1
        reopened.close()
        reader.close()
        with pytest.raises(ValueError, match="saved with fraction"):
            mix(off, on, 0.5).load_state_dict(state)


def test_bad_input_names_the_argument(pair, tmp_path):
    off, on = pair
    with pytest.raises(ValueError, match=r"fraction: expected a number in \[0, 1\], got 1.5"):
        mix(off, on, 1.5)
    with pytest.raises(ValueError, match="batch_size: expected a positive integer, got 0"):
        mix(off, on).sample(0)
    with pytest.raises(ValueError, match="fields: 'episode' is not a field of both"):
        mix(off, on, fields=["obs", "episode"])
    with pytest.raises(ValueError, match="steps: expected an integer >= 1, got 0"):
        LinearFraction(1, 0, 0)
    with pytest.raises(ValueError, match=r"fraction at batch 0: expected .* got 2"):
        mix(off, on, lambda step: 2).sample(4)
    other = ReplayBuffer.create(tmp_path / "o", capacity=4, fields={"obs": FieldSpec((2,),
                                                                                    "float32")})
    with pytest.raises(ValueError, match=r"field 'obs': offline shape \(3,\), online shape"):
        mix(off, other)
    other.close()
    with pytest.raises(ValueError, match="state: expected a dict"):
        mix(off, on).load_state_dict({"step": 1})


@settings(max_examples=30, deadline=None,  # the buffers are only read
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fraction=st.floats(0.0, 1.0), batch=st.integers(1, 64), seed=st.integers(0, 2**32))
def test_any_fraction_gives_floor_or_ceil_rows_that_are_the_buffers(pair, fraction, batch,
                                                                     seed):
    off, on = pair
    m = mix(off, on, fraction, seed=seed)
    out = m.sample(batch)
    n_off = int((out["source"] == OFFLINE).sum())
    assert np.floor(fraction * batch) <= n_off <= np.ceil(fraction * batch)
    assert len(out["obs"]) == len(out["weights"]) == batch
    assert (out["source"][:n_off] == OFFLINE).all()  # offline rows first
    _check_rows(out, off, on)


def test_core_imports_no_offline_library_and_the_integrations_name_their_extra():
    """``import rlbuffers`` (the buffer, the mixture, the CLI parser) imports none of
    minari, pyarrow, h5py, jax, datasets; without minari or pyarrow the integrations raise
    an ImportError naming the ``offline`` extra (run in a fresh interpreter)."""
    code = """
import sys
import rlbuffers
rlbuffers.ReplayBuffer, rlbuffers.mix
from rlbuffers.cli.main import build_parser
build_parser()
heavy = {"minari", "pyarrow", "h5py", "jax", "datasets"} & set(sys.modules)
assert not heavy, heavy
sys.modules["minari"] = None
sys.modules["pyarrow"] = None
for name in ("rlbuffers.integrations.minari", "rlbuffers.integrations.parquet"):
    try:
        __import__(name)
    except ImportError as e:
        assert "rlbuffers[offline]" in str(e), e
    else:
        raise AssertionError(name + " imported without its library")
print("ok")
"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
