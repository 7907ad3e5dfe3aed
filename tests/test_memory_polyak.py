"""polyak_update_ equals the naive soft update, slice sizes are bounded, bad input named."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbuffers.memory import polyak_update_
from rlbuffers.memory.peak import PeakMemory

MIB = 2**20


def nets(seed):
    torch.manual_seed(seed)
    src = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5),
                              torch.nn.Linear(5, 3))
    src(torch.randn(4, 7))  # moves BatchNorm's running stats and num_batches_tracked
    tgt = copy.deepcopy(src)
    for p in tgt.parameters():
        p.data.normal_()
    tgt[1].running_mean.normal_()
    tgt[1].num_batches_tracked.fill_(99)
    return tgt, src


def naive(tgt, src, tau):
    s = dict(src.named_parameters()) | {k: b for k, b in src.named_buffers()
                                        if b.is_floating_point()}
    out = {}
    for k, t in list(tgt.named_parameters()) + list(tgt.named_buffers()):
        out[k] = (1 - tau) * t.detach() + tau * s[k].detach() if k in s else t.clone()
    return out


@settings(max_examples=30, deadline=None)
@given(tau=st.floats(0, 1), chunk=st.integers(1, 200), seed=st.integers(0, 99))
def test_equals_the_naive_update_for_any_chunk(tau, chunk, seed):
    tgt, src = nets(seed)
    want = naive(tgt, src, tau)
    polyak_update_(tgt, src, tau, chunk_bytes=chunk)
    got = dict(tgt.named_parameters()) | dict(tgt.named_buffers())
    for k, w in want.items():
        torch.testing.assert_close(got[k].detach(), w, rtol=1e-6, atol=1e-6)
    assert int(tgt[1].num_batches_tracked) == 99  # integer buffers are left alone


def test_non_contiguous_and_mixed_dtypes():
    tgt = torch.nn.Linear(6, 4).double()
    src = torch.nn.Linear(6, 4)
    tgt.weight.data = torch.randn(6, 4, dtype=torch.float64).t()  # non-contiguous
    want = 0.7 * tgt.weight.detach() + 0.3 * src.weight.detach().double()
    polyak_update_(tgt, src, 0.3, chunk_bytes=8)
    torch.testing.assert_close(tgt.weight.detach(), want)
    assert tgt.weight.dtype == torch.float64


def test_peak_extra_memory_stays_near_one_chunk():
    tgt, src = torch.nn.Linear(2048, 4096), torch.nn.Linear(2048, 4096)  # 32 MiB weights
    with PeakMemory() as pk:
        polyak_update_(tgt, src, 0.01, chunk_bytes=2 * MIB)
    assert pk.peak_extra_rss_bytes < 2 * 2 * MIB + 4 * MIB  # < 2x chunk, plus slack


def test_bad_input_is_named():
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"source\['weight'\]: expected shape \(2, 3\)"):
        polyak_update_(a, b, 0.5)
    with pytest.raises(ValueError, match="tau: expected in \\[0, 1\\], got 1.5"):
        polyak_update_(a, a, 1.5)
    with pytest.raises(ValueError, match="chunk_bytes: expected >= 1, got 0"):
        polyak_update_(a, a, 0.5, chunk_bytes=0)
    with pytest.raises(ValueError, match="these differ"):
        polyak_update_(a, torch.nn.Linear(3, 2, bias=False), 0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_source_cpu_target():
    tgt, src = nets(0)
    want = naive(tgt, src, 0.2)
    polyak_update_(tgt, src.cuda(), 0.2, chunk_bytes=64)
    for k, p in tgt.named_parameters():
        assert p.device.type == "cpu"
        torch.testing.assert_close(p.detach(), want[k], rtol=1e-6, atol=1e-6)
