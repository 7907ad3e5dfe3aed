"""Resume determinism: the sample stream after save + open equals the stream of an
uninterrupted run, for every sampler."""

import numpy as np
import pytest

from rlbuffers import FieldSpec, PrioritizedSampler, ReplayBuffer, SequenceSampler, UniformSampler

FIELDS = {"x": FieldSpec((2,), "float32"), "tok": FieldSpec((None,), "int32"),
          "truncated": FieldSpec((), "bool")}


def _batch(first, n):
    ids = np.arange(first, first + n)
    return {"x": np.stack([ids, ids], 1).astype(np.float32),
            "tok": [np.arange(i % 5, dtype=np.int32) for i in ids],
            "truncated": ids % 13 == 12}


def _run(path, sampler, steps, *, interrupt_at=None):
    """Add, sample and (if prioritized) update for ``steps`` rounds; optionally save, close and
    reopen before round ``interrupt_at``. Returns the sampled ids of every round."""
    buf = ReplayBuffer.create(path, capacity=97, fields=FIELDS, sampler=sampler, seed=11,
                              chunk_transitions=16)
    out = []
    for step in range(steps):
        if step == interrupt_at:
            buf.save()
            buf.close()
            buf = ReplayBuffer.open(path)
        buf.extend(_batch(step * 10, 10))
        s = buf.sample(8)
        out.append(s["indices"].copy())
        if isinstance(buf.sampler, PrioritizedSampler):
            buf.update_priorities(s["indices"][:, 0] if s["indices"].ndim > 1 else s["indices"],
                                  (s["indices"].reshape(8, -1)[:, 0] % 7).astype(float))
    buf.close()
    return out


@pytest.mark.parametrize("make", [UniformSampler, lambda: PrioritizedSampler(alpha=0.6),
                                  lambda: SequenceSampler(length=3)])
@pytest.mark.parametrize("interrupt_at", [1, 7, 15])
def test_stream_after_resume_equals_uninterrupted(tmp_path, make, interrupt_at):
    straight = _run(tmp_path / "a", make(), 20)
    resumed = _run(tmp_path / "b", make(), 20, interrupt_at=interrupt_at)
    for a, b in zip(straight, resumed, strict=True):
        np.testing.assert_array_equal(a, b)
