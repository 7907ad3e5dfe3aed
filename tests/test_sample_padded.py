"""``sample(B, ragged="padded")``: each ragged field as one :class:`Padded` (``[N, L, *row]``
values, zeros after each row, ``L`` the longest; int64 lengths) whose rows are exactly the
``ragged="list"`` rows drawn from the same generator state, on the working tier and on a
read-only reader, for uniform, prioritized and sequence samplers."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbuffers import FieldSpec, Padded, PrioritizedSampler, ReplayBuffer, SequenceSampler

SHAPES = {"tok": ((None,), "int32"), "pts": ((None, 3), "float64"), "flag": ((None,), "bool")}


def make_rows(lengths: list[int], name: str, seed: int) -> list[np.ndarray]:
    """Rows of ``name`` with no zero value (bool: all True), so padding is told apart."""
    shape, dtype = SHAPES[name]
    rng = np.random.default_rng(seed)
    vals = [rng.integers(1, 99, (k, *shape[1:])) * rng.choice([-1, 1], (k, *shape[1:]))
            for k in lengths]
    return [v.astype(dtype) for v in vals]


def check_padded(padded: Padded, rows: list, dtype: str, row_shape: tuple[int, ...]) -> None:
    """``padded`` is exactly ``rows`` (a list of arrays), each followed by zeros to the
    longest."""
    assert isinstance(padded, Padded)
    lengths = [len(r) for r in rows]
    longest = max(lengths)
    assert padded.values.dtype == np.dtype(dtype)
    assert padded.values.shape == (len(rows), longest, *row_shape)
    assert padded.lengths.dtype == np.int64
    np.testing.assert_array_equal(padded.lengths, lengths)
    assert len(padded) == len(rows)
    want = np.zeros((len(rows), longest, *row_shape), dtype)  # the naive reference
    for i, r in enumerate(rows):
        want[i, :len(r)] = r
    np.testing.assert_array_equal(padded.values, want)
    np.testing.assert_array_equal(padded.mask, np.arange(longest) < np.array(lengths)[:, None])
    for i, (r, got) in enumerate(zip(rows, padded.to_list(), strict=True)):
        for row in (padded[i], padded[i - len(rows)], got):
            assert row.dtype == r.dtype and row.shape == r.shape
            np.testing.assert_array_equal(row, r)


def check_same_draw(buf: ReplayBuffer, batch: int, seed: int) -> None:
    listed = buf.sample(batch, rng=np.random.default_rng(seed))
    padded = buf.sample(batch, rng=np.random.default_rng(seed), ragged="padded")
    assert listed.keys() == padded.keys()
    np.testing.assert_array_equal(listed["indices"], padded["indices"])
    np.testing.assert_array_equal(listed["weights"], padded["weights"])
    for name, spec in buf.fields.items():
        if not spec.ragged:
            np.testing.assert_array_equal(listed[name], padded[name])
            continue
        rows = listed[name]
        if listed["indices"].ndim == 2:  # a sequence sampler: B lists of L arrays
            rows = [r for seq in rows for r in seq]
        check_padded(padded[name], rows, spec.dtype, spec.row_shape)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 7), min_size=1, max_size=50),
       capacity=st.integers(3, 20), chunk=st.integers(1, 6), batch=st.integers(1, 40),
       seed=st.integers(0, 2**32 - 1), prioritized=st.booleans())
def test_padded_rows_are_the_list_rows(tmp_path_factory, lengths, capacity, chunk, batch, seed,
                                       prioritized):
    """Random ragged buffers (empty rows, all-empty batches, rows of (None, 3) and bool,
    wrap-around past the capacity), on the working tier, then saved and reopened read-only."""
    path = tmp_path_factory.mktemp("p") / "b"
    fields = {n: FieldSpec(*SHAPES[n]) for n in SHAPES} | {"reward": FieldSpec((), "float32")}
    buf = ReplayBuffer.create(path, capacity=capacity, fields=fields, chunk_transitions=chunk,
                              sampler=PrioritizedSampler() if prioritized else None, seed=seed)
    buf.extend({**{n: make_rows(lengths, n, i) for i, n in enumerate(SHAPES)},
                "reward": np.arange(len(lengths), dtype=np.float32)})
    check_same_draw(buf, batch, seed)
    buf.save()
    buf.close()
    with ReplayBuffer.open(path, mode="r") as reader:
        check_same_draw(reader, batch, seed)
        kept = make_rows(lengths, "pts", 1)[-capacity:]  # the rows a reader must give back
        got = reader.sample(batch, rng=np.random.default_rng(seed), ragged="padded")
        ids = got["indices"] - (len(lengths) - len(kept))
        check_padded(got["pts"], [kept[i] for i in ids.tolist()], "float64", (3,))


@settings(max_examples=10, deadline=None)
@given(lengths=st.lists(st.integers(0, 5), min_size=6, max_size=30),
       window=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_sequence_samples_pad_b_times_l_rows(tmp_path_factory, lengths, window, seed):
    """With a sequence sampler, row ``(b, l)`` is padded row ``b * L + l``."""
    path = tmp_path_factory.mktemp("s") / "b"
    buf = ReplayBuffer.create(path, capacity=len(lengths), fields={
        "tok": FieldSpec(*SHAPES["tok"]), "done": FieldSpec((), "bool")},
        sampler=SequenceSampler(window), chunk_transitions=4, seed=seed)
    buf.extend({"tok": make_rows(lengths, "tok", 0), "done": np.zeros(len(lengths), bool)})
    got = buf.sample(5, rng=np.random.default_rng(seed), ragged="padded")
    assert got["tok"].lengths.shape == (5 * window,)
    check_same_draw(buf, 5, seed)
    buf.save()
    buf.close()
    with ReplayBuffer.open(path, mode="r") as reader:
        check_same_draw(reader, 5, seed)


def test_padded_beside_a_frame_stack(tmp_path):
    """A stacked field rebuilt on read beside a ragged field sampled padded: both as with
    ``ragged="list"``."""
    buf = ReplayBuffer.create(tmp_path / "b", capacity=6, fields={
        "obs": FieldSpec((2, 3), "uint8", stack_axis=0), "tok": FieldSpec((None,), "int32"),
        "done": FieldSpec((), "bool")}, seed=0, chunk_transitions=2)
    lengths = [0, 1, 2, 3, 0, 2, 1, 3, 2]
    for i, k in enumerate(lengths):  # wraps past the capacity
        buf.add(obs=np.stack([np.full(3, max(i - 1, 0)), np.full(3, i)]).astype(np.uint8),
                tok=np.arange(1, k + 1, dtype=np.int32) * (i + 1), done=i == 4)
    check_same_draw(buf, 8, 5)
    got = buf.sample(8, rng=np.random.default_rng(5), ragged="padded")
    rows = [np.arange(1, lengths[i] + 1, dtype=np.int32) * (i + 1) for i in got["indices"].tolist()]
    check_padded(got["tok"], rows, "int32", ())
    buf.close()


@pytest.mark.parametrize("mode", ["r+", "r"])
def test_padded_values_are_a_copy(tmp_path, mode):
    """Writing into a padded sample changes nothing stored."""
    path = tmp_path / "b"
    rows = make_rows([4, 0, 6, 2, 3], "tok", 0)
    buf = ReplayBuffer.create(path, capacity=8, fields={"tok": FieldSpec((None,), "int32")},
                              seed=3, chunk_transitions=2)
    buf.extend({"tok": rows})
    if mode == "r":
        buf.save()
        buf.close()
        buf = ReplayBuffer.open(path, mode="r")
    got = buf.sample(8, rng=np.random.default_rng(1), ragged="padded")["tok"]
    assert got.values.flags.writeable and got.values.size > 0
    got.values[:] = -1
    again = buf.sample(8, rng=np.random.default_rng(1), ragged="padded")
    check_padded(again["tok"], [rows[i] for i in again["indices"].tolist()], "int32", ())
    buf.close()


def test_all_empty_rows_pad_to_zero_width(tmp_path):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=4, fields={
        "pts": FieldSpec((None, 3), "float64")}, seed=3)
    buf.extend({"pts": [np.empty((0, 3))] * 3})
    got = buf.sample(5, ragged="padded")["pts"]
    assert got.values.shape == (5, 0, 3) and got.values.dtype == np.float64
    np.testing.assert_array_equal(got.lengths, np.zeros(5, np.int64))
    assert got.mask.shape == (5, 0)
    assert [r.shape for r in got.to_list()] == [(0, 3)] * 5
    buf.close()


def test_padded_row_index_out_of_range():
    p = Padded(np.array([[1, 2, 0], [3, 4, 5]], np.int32), np.array([2, 3], np.int64))
    np.testing.assert_array_equal(p[-2], [1, 2])
    np.testing.assert_array_equal(p.mask, [[True, True, False], [True, True, True]])
    with pytest.raises(IndexError, match=r"row: expected an index in \[-2, 2\), got 2"):
        p[2]


@pytest.mark.parametrize("bad", ["padded ", "Padded", "pad", None, 0])
def test_bad_ragged_argument_names_the_formats(tmp_path, bad):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=8,
                              fields={"tok": FieldSpec((None,), "int32")}, seed=3)
    buf.extend({"tok": make_rows([2, 4, 1], "tok", 0)})
    state = buf.rng.bit_generator.state
    with pytest.raises(ValueError, match=r"ragged: expected one of \('list', 'packed', "
                       r"'padded'\), got " + repr(bad)):
        buf.sample(2, ragged=bad)
    assert buf.rng.bit_generator.state == state  # nothing drawn
    buf.close()
