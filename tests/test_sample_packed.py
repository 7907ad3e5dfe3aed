"""``sample(B, ragged="packed")``: each ragged field as one :class:`Packed` (values end to
end + ``cu_seqlens``) equal to the concatenation of the ``ragged="list"`` rows drawn from the
same generator state, on the working tier and on a read-only reader; and bad ``ragged``
values rejected before anything is drawn."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbuffers import FieldSpec, Packed, PrioritizedSampler, ReplayBuffer, SequenceSampler

SHAPES = {"tok": ((None,), "int32"), "pts": ((None, 3), "float64"), "flag": ((None,), "bool")}


def make_rows(lengths: list[int], name: str, seed: int) -> list[np.ndarray]:
    shape, dtype = SHAPES[name]
    rng = np.random.default_rng(seed)
    return [rng.integers(-99, 99, (k, *shape[1:])).astype(dtype) for k in lengths]


def check_packed(packed: Packed, rows: list, dtype: str, row_shape: tuple[int, ...]) -> None:
    """``packed`` is exactly ``rows`` (a list of arrays) end to end, offsets included."""
    assert isinstance(packed, Packed)
    assert packed.values.dtype == np.dtype(dtype) and packed.values.shape[1:] == row_shape
    assert packed.cu_seqlens.dtype == np.int32 and packed.cu_seqlens.shape == (len(rows) + 1,)
    want_cu = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    np.testing.assert_array_equal(packed.cu_seqlens, want_cu)
    want = (np.concatenate(rows) if rows else np.empty((0, *row_shape), dtype))
    np.testing.assert_array_equal(packed.values, want.reshape(-1, *row_shape))
    assert len(packed) == len(rows)
    np.testing.assert_array_equal(packed.seqlens, [len(r) for r in rows])
    assert packed.seqlens.dtype == np.int32
    for i, r in enumerate(rows):
        np.testing.assert_array_equal(packed[i], r)
        assert packed[i].dtype == r.dtype and packed[i].shape == r.shape


def same_draw(buf: ReplayBuffer, batch: int, seed: int) -> tuple[dict, dict]:
    """The list and packed samples of ``batch`` from two generators in the same state."""
    listed = buf.sample(batch, rng=np.random.default_rng(seed))
    packed = buf.sample(batch, rng=np.random.default_rng(seed), ragged="packed")
    return listed, packed


def check_same_draw(buf: ReplayBuffer, batch: int, seed: int) -> None:
    listed, packed = same_draw(buf, batch, seed)
    assert listed.keys() == packed.keys()
    np.testing.assert_array_equal(listed["indices"], packed["indices"])
    np.testing.assert_array_equal(listed["weights"], packed["weights"])
    for name, spec in buf.fields.items():
        if not spec.ragged:
            np.testing.assert_array_equal(listed[name], packed[name])
            continue
        rows = listed[name]
        if listed["indices"].ndim == 2:  # a sequence sampler: B lists of L arrays
            rows = [r for seq in rows for r in seq]
        check_packed(packed[name], rows, spec.dtype, spec.row_shape)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 7), min_size=1, max_size=50),
       capacity=st.integers(3, 20), chunk=st.integers(1, 6), batch=st.integers(1, 40),
       seed=st.integers(0, 2**32 - 1), prioritized=st.booleans())
def test_packed_is_the_list_format_end_to_end(tmp_path_factory, lengths, capacity, chunk,
                                              batch, seed, prioritized):
    """Random ragged buffers (empty rows, rows of (None, 3), wrap-around past the capacity),
    on the working tier, then saved and reopened read-only."""
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
        got = reader.sample(batch, rng=np.random.default_rng(seed), ragged="packed")
        ids = got["indices"] - (len(lengths) - len(kept))
        check_packed(got["pts"], [kept[i] for i in ids.tolist()], "float64", (3,))


@settings(max_examples=10, deadline=None)
@given(lengths=st.lists(st.integers(0, 5), min_size=6, max_size=30),
       window=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_sequence_samples_pack_b_times_l_rows(tmp_path_factory, lengths, window, seed):
    """With a sequence sampler, row ``(b, l)`` is packed row ``b * L + l``: offsets [B*L + 1]."""
    path = tmp_path_factory.mktemp("s") / "b"
    buf = ReplayBuffer.create(path, capacity=len(lengths), fields={
        "tok": FieldSpec(*SHAPES["tok"]), "done": FieldSpec((), "bool")},
        sampler=SequenceSampler(window), chunk_transitions=4, seed=seed)
    buf.extend({"tok": make_rows(lengths, "tok", 0), "done": np.zeros(len(lengths), bool)})
    listed, packed = same_draw(buf, 5, seed)
    assert packed["tok"].cu_seqlens.shape == (5 * window + 1,)
    check_same_draw(buf, 5, seed)
    buf.save()
    buf.close()
    with ReplayBuffer.open(path, mode="r") as reader:
        check_same_draw(reader, 5, seed)


def test_list_format_is_unchanged_by_default(tmp_path):
    """No ``ragged`` argument: lists of arrays, the same values as ``ragged="list"``."""
    buf = ReplayBuffer.create(tmp_path / "b", capacity=8, fields={
        "tok": FieldSpec((None,), "int32")}, seed=3)
    buf.extend({"tok": make_rows([3, 0, 5, 1], "tok", 0)})
    a = buf.sample(6, rng=np.random.default_rng(1))
    b = buf.sample(6, rng=np.random.default_rng(1), ragged="list")
    assert isinstance(a["tok"], list) and len(a["tok"]) == 6
    for x, y in zip(a["tok"], b["tok"], strict=True):
        np.testing.assert_array_equal(x, y)
    buf.close()


@pytest.mark.parametrize("bad", ["packed ", "LIST", None, 1, ["packed"]])
@pytest.mark.parametrize("mode", ["r+", "r"])
def test_bad_ragged_argument_is_refused_before_drawing(tmp_path, bad, mode):
    path = tmp_path / "b"
    buf = ReplayBuffer.create(path, capacity=8, fields={"tok": FieldSpec((None,), "int32")},
                              seed=3)
    buf.extend({"tok": make_rows([2, 4, 1], "tok", 0)})
    if mode == "r":
        buf.save()
        buf.close()
        buf = ReplayBuffer.open(path, mode="r")
    state = buf.rng.bit_generator.state
    with pytest.raises(ValueError, match=r"ragged: expected one of \('list', 'packed', "
                       r"'padded'\), got " + repr(bad).replace("[", r"\[").replace("]", r"\]")):
        buf.sample(2, ragged=bad)
    assert buf.rng.bit_generator.state == state  # nothing drawn
    buf.close()


def test_packed_without_ragged_fields_is_the_plain_batch(tmp_path):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=8, fields={
        "obs": FieldSpec((2,), "float32")}, seed=3)
    buf.extend({"obs": np.arange(12, dtype=np.float32).reshape(6, 2)})
    a, b = same_draw(buf, 4, 9)
    np.testing.assert_array_equal(a["obs"], b["obs"])
    buf.close()


def test_packed_row_index_out_of_range():
    p = Packed(np.arange(5, dtype=np.int32), np.array([0, 2, 5], dtype=np.int64))
    np.testing.assert_array_equal(p[-1], [2, 3, 4])
    with pytest.raises(IndexError, match=r"row: expected an index in \[-2, 2\), got 2"):
        p[2]


@pytest.mark.parametrize("mode", ["r+", "r"])
def test_packed_values_are_a_copy(tmp_path, mode):
    """Writing into a packed sample changes nothing stored; a reader's list rows are
    read-only views of its chunk cache (as before the packed format), the packed values a
    new array."""
    path = tmp_path / "b"
    rows = make_rows([4, 0, 6, 2, 3], "tok", 0)
    buf = ReplayBuffer.create(path, capacity=8, fields={"tok": FieldSpec((None,), "int32")},
                              seed=3, chunk_transitions=2)
    buf.extend({"tok": rows})
    if mode == "r":
        buf.save()
        buf.close()
        buf = ReplayBuffer.open(path, mode="r")
        assert not any(r.flags.writeable for r in buf.sample(8, rng=np.random.default_rng(0))
                       ["tok"] if len(r))
    got = buf.sample(8, rng=np.random.default_rng(1), ragged="packed")["tok"]
    assert got.values.flags.writeable and got.values.size > 0
    got.values[:] = -1
    again = buf.sample(8, rng=np.random.default_rng(1), ragged="packed")
    check_packed(again["tok"], [rows[i] for i in again["indices"].tolist()], "int32", ())
    buf.close()


def test_cu_seqlens_is_int32_like_the_stream_batches():
    """One ``cu_seqlens`` dtype across the library: the buffer's :class:`Packed` and the
    streaming pipeline's batches (flash-attn varlen and HF's flattening collator take int32)."""
    from rlbuffers.stream import collate

    batch = collate([[np.arange(3), np.arange(2)], [np.arange(4)]], pad_token_id=0)
    p = Packed(np.arange(5), [0, 2, 5])  # other integer offsets are converted on construction
    assert p.cu_seqlens.dtype == batch["cu_seqlens"].dtype == np.int32
    assert p.cu_seqlens.tolist() == [0, 2, 5]
    same = np.array([0, 2, 5], dtype=np.int32)
    assert Packed(np.arange(5), same).cu_seqlens is same  # int32 already: kept, not copied


@pytest.mark.parametrize(("cu", "error", "message"), [
    (np.array([0, 2**31], dtype=np.int64), ValueError,
     "cu_seqlens[1]: expected an int32 offset (at most 2,147,483,647 values in one Packed), "
     "got 2,147,483,648"),
    (np.array([-(2**31) - 1, 0], dtype=np.int64), ValueError, "cu_seqlens[0]: expected an int32"),
    (np.array([0.0, 2.0]), TypeError, "cu_seqlens: expected integer offsets (int32), got dtype "
     "float64"),
    (np.array([False, True]), TypeError, "got dtype bool"),
])
def test_packed_refuses_offsets_int32_cannot_hold(cu, error, message):
    with pytest.raises(error) as e:
        Packed(np.arange(5), cu)
    assert message in str(e.value)


@pytest.mark.parametrize("mode", ["r+", "r"])
def test_a_packed_sample_over_int32_values_names_the_field(tmp_path, mode, monkeypatch):
    """More values than int32 ``cu_seqlens`` address: a ValueError naming the field, raised
    before anything is gathered; the list format (int64 offsets inside) is not limited. The
    limit is lowered to 10 values here (the real one needs 2**31 values)."""
    from rlbuffers import packed as packed_module

    path = tmp_path / "b"
    rows = make_rows([4, 6, 5], "tok", 0)
    buf = ReplayBuffer.create(path, capacity=8, fields={"tok": FieldSpec((None,), "int32")},
                              seed=3)
    buf.extend({"tok": rows})
    if mode == "r":
        buf.save()
        buf.close()
        buf = ReplayBuffer.open(path, mode="r")
    monkeypatch.setattr(packed_module, "MAX_PACKED_VALUES", 10)
    state = buf.rng.bit_generator.state
    listed = buf.sample(3, rng=np.random.default_rng(0))  # the same draw as a list
    total = sum(len(rows[i]) for i in listed["indices"].tolist())
    assert total > 10
    with pytest.raises(ValueError) as e:
        buf.sample(3, rng=np.random.default_rng(0), ragged="packed")
    assert str(e.value) == (f"field 'tok': the 3 rows hold {total} values, more than "
                            "ragged='packed' addresses with int32 cu_seqlens (10); sample fewer "
                            "rows, or use ragged='list' or 'padded'")
    for got, i in zip(listed["tok"], listed["indices"].tolist(), strict=True):
        np.testing.assert_array_equal(got, rows[i])
    assert buf.rng.bit_generator.state == state  # explicit generators: the buffer's untouched
    buf.close()
