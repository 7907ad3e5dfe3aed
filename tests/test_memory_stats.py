"""RunningMeanStd equals numpy on the concatenated data; cached_schedule calls once per step."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbuffers.memory import RunningMeanStd, cached_schedule


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 20), min_size=1, max_size=8), seed=st.integers(0, 999),
       scale=st.sampled_from([1e-3, 1.0, 1e4]))
def test_running_moments_equal_numpy_on_the_concatenation(sizes, seed, scale):
    rng = np.random.default_rng(seed)
    batches = [rng.normal(5 * scale, scale, size=(n, 3)) for n in sizes]
    rms = RunningMeanStd(shape=(3,))
    for b in batches:
        rms.update(b)
    allx = np.concatenate(batches)
    assert rms.count == len(allx)
    if len(allx):
        np.testing.assert_allclose(rms.mean, allx.mean(0), rtol=1e-9, atol=1e-12 * scale)
        np.testing.assert_allclose(rms.var, allx.var(0), rtol=1e-7, atol=1e-9 * scale**2)


def test_scalars_tensors_normalize_and_state_round_trip():
    rms = RunningMeanStd()
    rms.update(torch.tensor([1.0, 2.0, 3.0]))
    rms.update(np.float64(10.0))
    assert rms.count == 4 and rms.mean == pytest.approx(4.0)
    assert rms.var == pytest.approx(np.var([1, 2, 3, 10]))
    x = torch.tensor([4.0, 4.0 + float(np.sqrt(rms.var))])
    torch.testing.assert_close(rms.normalize(x, eps=0.0), torch.tensor([0.0, 1.0]))
    other = RunningMeanStd()
    other.load_state_dict(json.loads(json.dumps(rms.state_dict())))
    assert other.count == 4 and other.mean == rms.mean and other.var == rms.var


def test_bad_input_is_named():
    rms = RunningMeanStd(shape=(2,))
    with pytest.raises(ValueError, match=r"x: expected shape \[N, 2\], got \(4, 3\)"):
        rms.update(np.zeros((4, 3)))
    with pytest.raises(ValueError, match="x: expected finite values"):
        rms.update(np.array([[np.nan, 1.0]]))
    with pytest.raises(ValueError, match=r"state\['shape'\]: expected \[2\], got \[\]"):
        rms.load_state_dict(RunningMeanStd().state_dict())
    with pytest.raises(TypeError, match="fn: expected a callable"):
        cached_schedule(3)


def test_cached_schedule_evaluates_each_step_once():
    calls = []

    @cached_schedule
    def kl_coef(step):
        calls.append(step)
        return 0.1 * 0.99**step

    values = [kl_coef(s) for s in (0, 1, 1, 2, 0, 2)]
    assert calls == [0, 1, 2]
    assert values[1] == values[2] == pytest.approx(0.099)
    assert kl_coef.cache_info().hits == 3
