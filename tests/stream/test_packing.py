import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbuffers.stream import IGNORE_INDEX, block_causal_mask, collate, pack_bfd, split_overflow


def test_bfd_matches_hand_worked_example():
    # capacity 10, decreasing order: 7(i0) 6(i3) 4(i1) 3(i2) 3(i4) 2(i5)
    # 7 -> new bin0 (rem 3); 6 -> new bin1 (rem 4); 4 -> bin1 (exact fit, rem 0);
    # 3 -> bin0 (rem 0); 3 -> new bin2 (rem 7); 2 -> bin2 (rem 5)
    assert pack_bfd([7, 4, 3, 6, 3, 2], 10) == [[0, 2], [3, 1], [4, 5]]


def test_bfd_best_fit_prefers_tightest_bin():
    # after 6 (rem 4) and 5 (rem 5): a 4 goes into the rem-4 bin, not the rem-5 one
    assert pack_bfd([6, 5, 4], 10) == [[0, 2], [1]]


def test_bfd_rejects_bad_lengths():
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        pack_bfd([3, 11], 10)
    with pytest.raises(ValueError, match=r"lengths\[0\]"):
        pack_bfd([0], 10)
    assert pack_bfd([], 10) == []


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 64).flatmap(
    lambda L: st.tuples(st.just(L), st.lists(st.integers(1, L), max_size=80))))
def test_bfd_places_every_sequence_once_within_capacity(case):
    max_length, lengths = case
    bins = pack_bfd(lengths, max_length)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= max_length for b in bins)
    # any-fit property (Johnson 1973): at most one bin is at most half full, since a later
    # bin's items would all have fit into an earlier half-empty one
    fills = [sum(lengths[i] for i in b) for b in bins]
    assert sum(2 * f <= max_length for f in fills) <= 1


def test_split_overflow_split_and_truncate():
    seq = np.arange(10)
    parts, lost = split_overflow([seq, np.arange(0), np.arange(3)], 4, "split")
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2]]
    assert lost == 0
    parts, lost = split_overflow([seq], 4, "truncate")
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3]] and lost == 6
    with pytest.raises(ValueError, match="overflow"):
        split_overflow([seq], 4, "drop")


def test_collate_packed_rows_hand_example():
    rows = [[np.array([5, 6, 7]), np.array([8, 9])], [np.array([3])]]
    b = collate(rows, pad_token_id=0, max_length=6, pad_to_multiple_of=4,
                truncated_tokens=2)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 0]]
    assert b["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, -100, -100], [-100] * 8]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert b["cu_seqlens"].tolist() == [0, 3, 5, 8, 9, 16] and b["cu_seqlens"].dtype == np.int32
    assert b.max_seqlen == 7
    assert b["input_ids"].dtype == np.int64 and "attention_mask" not in b
    assert b.stats == {"num_sequences": 3, "num_tokens": 6, "padding_fraction": 10 / 16,
                       "packing_efficiency": 6 / 12, "truncated_tokens": 2}
    assert set(b) == {"input_ids", "labels", "position_ids", "cu_seqlens"}  # arrays only


def test_collate_padding_mask_and_fixed_padding():
    b = collate([[np.array([1, 2])], [np.array([3])]], pad_token_id=9, pad_to=4,
                attention="padding")
    assert b["input_ids"].tolist() == [[1, 2, 9, 9], [3, 9, 9, 9]]
    assert b["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    with pytest.raises(ValueError, match="pad_to"):
        collate([[np.arange(5)]], pad_token_id=0, pad_to=4)
    with pytest.raises(ValueError, match="rows"):
        collate([], pad_token_id=0)


def test_block_causal_mask_hand_example():
    m = block_causal_mask(np.array([[0, 1, 0, 1]]))
    assert m.shape == (1, 1, 4, 4) and m.dtype == bool
    assert m[0, 0].astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0],
                                            [0, 0, 1, 1]]


@settings(max_examples=100, deadline=None)
@given(st.integers(4, 40).flatmap(lambda L: st.tuples(
    st.just(L), st.lists(st.integers(1, L), min_size=1, max_size=30), st.integers(1, 4))))
def test_packed_batch_invariants(case):
    max_length, lengths, rows_per_batch = case
    rng = np.random.default_rng(len(lengths))
    seqs = [rng.integers(1, 1000, size=n) for n in lengths]
    bins = pack_bfd(lengths, max_length)
    for start in range(0, len(bins), rows_per_batch):
        rows = [[seqs[i] for i in b] for b in bins[start:start + rows_per_batch]]
        b = collate(rows, pad_token_id=0, max_length=max_length)
        ids, pos, lab, cu = b["input_ids"], b["position_ids"], b["labels"], b["cu_seqlens"]
        B, T = ids.shape
        assert T <= max_length
        # every token of every row is placed, in order, followed by padding
        for r, row in enumerate(rows):
            flat = np.concatenate(row)
            assert ids[r, :len(flat)].tolist() == flat.tolist()
            assert (ids[r, len(flat):] == 0).all()
        # cu_seqlens is consistent with position_ids
        assert cu[0] == 0 and cu[-1] == B * T
        assert np.flatnonzero(pos.reshape(-1) == 0).tolist() == cu[:-1].tolist()
        seg = np.diff(cu)
        assert b.max_seqlen == seg.max()
        assert pos.reshape(-1).tolist() == [p for n in seg for p in range(n)]
        # labels: -100 exactly at sequence starts and at padding, token ids elsewhere
        starts = np.zeros((B, T), bool)
        pad = np.zeros((B, T), bool)
        for r, row in enumerate(rows):
            offs = np.cumsum([0] + [len(s) for s in row])
            starts[r, offs[:-1]] = True
            pad[r, offs[-1]:] = True
        assert ((lab == IGNORE_INDEX) == (starts | pad)).all()
        assert (lab[~(starts | pad)] == ids[~(starts | pad)]).all()
        real = sum(len(s) for row in rows for s in row)
        assert b.stats["num_tokens"] == real
        assert b.stats["packing_efficiency"] == real / (B * max_length)
