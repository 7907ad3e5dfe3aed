"""ReplayBuffer.draw (issue 46): the sampler's draw of ``sample`` without reading any field,
with the same generator steps, for every sampler kind."""

from __future__ import annotations

import numpy as np
import pytest

from rlbuffers import (
    BufferEmptyError,
    FieldSpec,
    PrioritizedSampler,
    ReplayBuffer,
    SequenceSampler,
    UniformSampler,
)


@pytest.mark.parametrize("sampler", [UniformSampler(), PrioritizedSampler(0.6, 0.4),
                                     SequenceSampler(3)], ids=["uniform", "prioritized", "seq"])
def test_draw_is_sample_without_the_rows(tmp_path, sampler):
    bufs = [ReplayBuffer.create(tmp_path / name, capacity=16, seed=5, sampler=sampler,
                                fields={"x": FieldSpec((), "int64"),
                                        "done": FieldSpec((), "bool")})
            for name in ("a", "b")]
    for b in bufs:
        b.extend({"x": np.arange(21), "done": np.arange(21) % 6 == 5})
    for _ in range(4):
        want = bufs[0].sample(4)
        ids, weights = bufs[1].draw(4)
        assert np.array_equal(ids, want["indices"]) and np.array_equal(weights, want["weights"])
        assert np.array_equal(bufs[1][(ids - (21 - 16)).ravel()]["x"], want["x"].ravel())
    with pytest.raises(ValueError, match="batch_size"):
        bufs[1].draw(0)


def test_draw_from_an_empty_buffer_raises(tmp_path):
    b = ReplayBuffer.create(tmp_path / "e", capacity=4, fields={"x": FieldSpec((), "int64")})
    with pytest.raises(BufferEmptyError):
        b.draw(1)
