"""Sampler behaviour: validity of sampled slots, prioritized distribution and importance
weights against the formulas of Schaul et al. (2016), sequence windows."""

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbuffers import FieldSpec, PrioritizedSampler, ReplayBuffer, SequenceSampler
from rlbuffers.errors import NotPrioritizedError
from rlbuffers.sampling.samplers import (
    PRIORITY,
    Draw,
    Sampler,
    register_sampler,
    sampler_from_state,
)

FIELDS = {"x": FieldSpec((), "int64"), "terminated": FieldSpec((), "bool")}


def _fill(buf, n, done_every=0, first=0):
    ids = np.arange(first, first + n)
    done = (ids % done_every == done_every - 1) if done_every else np.zeros(n, bool)
    buf.extend({"x": ids, "terminated": done})


def test_uniform_samples_only_stored_transitions(tmp_path):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=50, fields=FIELDS, seed=1)
    _fill(buf, 80)
    s = buf.sample(4000)
    assert set(np.unique(s["x"])) == set(range(30, 80))
    np.testing.assert_array_equal(s["x"], s["indices"])  # ids are the insertion counters
    assert (s["weights"] == 1).all()


def test_prioritized_distribution_and_weights(tmp_path):
    alpha, beta = 0.7, 0.5
    sampler = PrioritizedSampler(alpha=alpha, beta=beta, eps=1e-6)
    buf = ReplayBuffer.create(tmp_path / "b", capacity=8, fields=FIELDS, sampler=sampler, seed=3)
    _fill(buf, 8)
    prio = np.array([1.0, 2.0, 0.5, 4.0, 1.0, 0.0, 3.0, 8.0])
    assert buf.update_priorities(np.arange(8), prio) == 8
    p = (prio + 1e-6) ** alpha
    expected = p / p.sum()
    s = buf.sample(200_000)
    freq = np.bincount(s["x"], minlength=8) / len(s["x"])
    np.testing.assert_allclose(freq, expected, atol=0.004)
    w_expected = (len(prio) * expected) ** (-beta)
    w_expected /= w_expected.max()
    np.testing.assert_allclose(s["weights"], w_expected[s["x"]], rtol=1e-5)


def test_new_transitions_get_max_priority_and_stale_updates_skip(tmp_path):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=4, fields=FIELDS,
                              sampler=PrioritizedSampler(alpha=1.0), seed=0)
    _fill(buf, 4)
    buf.update_priorities([0, 1], [5.0, 0.1])
    _fill(buf, 1, first=4)  # overwrites id 0
    assert buf.update_priorities([0, 4], [100.0, 1.0]) == 1  # id 0 is gone: skipped
    s = buf.sample(100_000)
    freq = np.bincount(s["x"], minlength=5)[1:] / 100_000
    # ids 1..4: id 1 was set to 0.1; ids 2 and 3 kept the initial priority 1.0; id 4 arrived
    # with the max priority seen (5.0) and was then set to 1.0
    p = np.array([0.1 + 1e-6, 1.0, 1.0, 1.0 + 1e-6])
    np.testing.assert_allclose(freq, p / p.sum(), atol=0.006)


def test_priorities_and_rng_survive_save_open(tmp_path):
    path = tmp_path / "b"
    buf = ReplayBuffer.create(path, capacity=64, fields=FIELDS,
                              sampler=PrioritizedSampler(alpha=0.6, beta=0.4), seed=7)
    _fill(buf, 100)
    rng = np.random.default_rng(0)
    for _ in range(5):
        s = buf.sample(16)
        buf.update_priorities(s["indices"], rng.random(16) * 10)
    buf.save()
    after_save = [buf.sample(32) for _ in range(3)]
    buf.close()
    with ReplayBuffer.open(path) as again:
        assert again.sampler.state_dict() == buf.sampler.state_dict()
        for want in after_save:
            got = again.sample(32)
            np.testing.assert_array_equal(got["indices"], want["indices"])
            np.testing.assert_array_equal(got["weights"], want["weights"])


@settings(max_examples=40, deadline=None)
@given(capacity=st.integers(5, 40), n=st.integers(5, 90), length=st.integers(1, 5),
       done_every=st.integers(0, 9), seed=st.integers(0, 2**16))
def test_sequences_never_cross_episode_or_seam(tmp_path_factory, capacity, n, length,
                                               done_every, seed):
    path = tmp_path_factory.mktemp("seq") / "b"
    buf = ReplayBuffer.create(path, capacity=capacity, fields=FIELDS,
                              sampler=SequenceSampler(length=length), seed=seed,
                              chunk_transitions=4)
    _fill(buf, n, done_every=done_every)
    try:
        s = buf.sample(64)
    except IndexError:  # no valid window: check that is true
        ids = np.arange(max(0, n - capacity), n)
        ep = ids // done_every if done_every else np.zeros_like(ids)
        assert all(ep[i] != ep[i + length - 1] for i in range(len(ids) - length + 1))
        return
    x = s["x"]
    assert x.shape == (64, length)
    assert (np.diff(x, axis=1) == 1).all()  # consecutive in time: no seam crossing
    assert (x >= max(0, n - capacity)).all() and (x < n).all()
    if done_every:  # no window contains an episode end except at its last step
        assert ((x[:, :-1] % done_every) != done_every - 1).all()
    np.testing.assert_array_equal(s["indices"], x)


@register_sampler
@dataclass
class NewestSampler:
    """A user-defined sampler: the ``k`` newest transitions, with a per-slot 'age' column."""

    k: int = 3
    name: ClassVar[str] = "test-newest"
    extra_columns: ClassVar[dict[str, FieldSpec]] = {}

    def sample(self, batch_size, ctx, rng):
        pos = ctx.size - 1 - rng.integers(0, min(self.k, ctx.size), size=batch_size)
        return Draw(ctx.slots(pos), np.ones(batch_size, np.float32))

    def on_write(self, slots, ctx):
        return None

    def state_dict(self):
        return {"type": self.name, "k": self.k}

    def load_state_dict(self, state):
        self.k = int(state["k"])

    @classmethod
    def from_state_dict(cls, state):
        return cls(k=int(state["k"]))


def test_registered_custom_sampler_saves_and_reopens(tmp_path):
    assert isinstance(NewestSampler(), Sampler)
    buf = ReplayBuffer.create(tmp_path / "b", capacity=20, fields=FIELDS,
                              sampler=NewestSampler(k=2), seed=3)
    _fill(buf, 30)
    buf.save()
    want = buf.sample(50)["x"]
    assert set(want) <= {28, 29}
    buf.close()
    with ReplayBuffer.open(tmp_path / "b") as again:
        assert again.sampler == NewestSampler(k=2)
        np.testing.assert_array_equal(again.sample(50)["x"], want)


def test_unregistered_sampler_type_and_name_clash_are_refused():
    with pytest.raises(ValueError, match="expected one of .*'prioritized'.*got 'nope'"):
        sampler_from_state({"type": "nope"})

    class Clash(NewestSampler):
        pass

    with pytest.raises(ValueError, match="'test-newest': already registered"):
        register_sampler(Clash)


def test_prioritized_sampler_declares_its_priority_column(tmp_path):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=8, fields=FIELDS,
                              sampler=PrioritizedSampler())
    assert PRIORITY in PrioritizedSampler.extra_columns
    assert (tmp_path / "b" / PRIORITY / "zarr.json").exists()
    buf.close()
    with ReplayBuffer.create(tmp_path / "u", capacity=8, fields=FIELDS) as uniform:
        assert not (tmp_path / "u" / PRIORITY).exists()
        with pytest.raises(NotPrioritizedError, match="has UniformSampler"):
            uniform.update_priorities([0], [1.0])
