"""Shared-prefix packing (rlbuffers.stream.prefix_packing): every completion, read back through
the row layout, is exactly its prompt + itself: tokens, positions, which keys each token sees,
which hidden state predicts it; groups too long for a row are split; bad input is named."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbuffers.stream.prefix_packing import pack_shared_prefix, shared_prefix_mask

token_arrays = st.lists(st.integers(3, 99), min_size=1, max_size=7).map(
    lambda x: np.array(x, np.int64))
groups_st = st.lists(st.tuples(token_arrays, st.lists(token_arrays, min_size=1, max_size=5)),
                     min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(groups=groups_st, slack=st.integers(0, 12), cut=st.integers(0, 30))
def test_rows_read_back_as_prompt_plus_completion(groups, slack, cut):
    prompts = [p for p, _ in groups]
    completions = [cs for _, cs in groups]
    max_tokens = max(len(p) + len(c) for p, cs in groups for c in cs) + slack
    flat = [(g, c) for g, (_, cs) in enumerate(groups) for c in cs]
    values = [np.arange(len(c), dtype=np.float32) + 100 * k for k, (_, c) in enumerate(flat)]
    row_tokens = max(1, max_tokens - cut)
    b = pack_shared_prefix(prompts, completions, max_tokens, pad_id=0, per_token={"v": values},
                           row_tokens=row_tokens)
    mask = shared_prefix_mask(b["block"], b["parent"])[:, 0]
    assert b["input_ids"].shape[1] == max_tokens
    # A row over row_tokens holds one item: one prompt (position 0 once) and its completions.
    for r in np.flatnonzero(b["real"].sum(1) > row_tokens):
        assert (b["real"][r] & (b["position_ids"][r] == 0)).sum() == 1
    assert b["mask"].sum() == sum(len(c) for _, c in flat)
    np.testing.assert_array_equal(np.sort(b["index"][b["mask"]]), np.arange(b["mask"].sum()))
    starts = np.cumsum([0] + [len(c) for _, c in flat])
    for k, (g, c) in enumerate(flat):
        row_cols = np.argwhere((b["index"] >= starts[k]) & (b["index"] < starts[k + 1]))
        rows = set(row_cols[:, 0].tolist())
        assert len(rows) == 1, "a completion never spans rows"
        r, cols = row_cols[0, 0], row_cols[:, 1]
        np.testing.assert_array_equal(b["input_ids"][r, cols], c)
        np.testing.assert_array_equal(b["v"][r, cols], values[k])
        p = prompts[g]
        np.testing.assert_array_equal(b["position_ids"][r, cols],
                                      np.arange(len(p), len(p) + len(c)))
        # The keys the completion's last token sees are exactly its prompt and itself.
        seen = np.flatnonzero(mask[r, cols[-1]])
        seq = b["input_ids"][r, seen]
        np.testing.assert_array_equal(seq, np.concatenate([p, c]))
        np.testing.assert_array_equal(b["position_ids"][r, seen], np.arange(len(p) + len(c)))
        # Each token is predicted by the hidden state of the token before it in that sequence.
        np.testing.assert_array_equal(b["source"][r, cols], seen[len(p) - 1:-1])
    # Padding: not real, sees only itself; real tokens never see padding.
    pad = ~b["real"]
    for r, q in zip(*np.nonzero(pad), strict=True):
        assert np.flatnonzero(mask[r, q]).tolist() == [q]
    assert not (mask & pad[:, None, :] & b["real"][:, :, None]).any()
    # A prompt is written once per item: once if its group fits a row, at most once per
    # completion otherwise.
    written = int(b["real"].sum() - b["mask"].sum())
    if all(len(p) + sum(map(len, cs)) <= max_tokens for p, cs in groups):
        assert written == sum(len(p) for p in prompts)
    assert sum(len(p) for p in prompts) <= written <= sum(len(p) * len(cs) for p, cs in groups)


def test_a_group_longer_than_a_row_is_split_with_its_prompt_copied():
    p = np.array([5, 6, 7])
    comps = [np.array([10, 11, 12, 13]), np.array([20, 21, 22]), np.array([30, 31, 32, 33])]
    b = pack_shared_prefix([p], [comps], max_tokens=10, pad_id=0)
    assert len(b["input_ids"]) == 2
    assert b["real"].sum() == 2 * len(p) + sum(map(len, comps))
    for row in b["input_ids"]:
        np.testing.assert_array_equal(row[:3], p)


def test_row_tokens_keeps_short_groups_apart_and_long_groups_whole():
    short = [(np.array([1, 2]), [np.array([3]), np.array([4])]) for _ in range(3)]  # 4 tokens
    long = (np.array([5, 6, 7]), [np.array([8, 9, 10]), np.array([11, 12, 13])])  # 9 tokens
    groups = [*short, long]
    b = pack_shared_prefix([p for p, _ in groups], [c for _, c in groups], 12, 0, row_tokens=8)
    # The long group keeps its prompt once in a row of its own; short ones pair up within 8.
    assert sorted(b["real"].sum(1).tolist()) == [4, 8, 9]
    assert b["real"].sum() - b["mask"].sum() == 3 * 2 + 3  # each prompt written once
    assert len(pack_shared_prefix([p for p, _ in groups], [c for _, c in groups], 12, 0)
               ["input_ids"]) == 2  # without row_tokens: rows of up to 12 (9 + 0, 4 + 4 + 4)


def test_shared_prefix_mask_numpy_and_torch_agree():
    torch = pytest.importorskip("torch")
    b = pack_shared_prefix([np.array([1, 2]), np.array([3])],
                           [[np.array([4]), np.array([5, 6])], [np.array([7, 8, 9])]], 12, 0)
    want = shared_prefix_mask(b["block"], b["parent"])
    got = shared_prefix_mask(torch.from_numpy(b["block"]), torch.from_numpy(b["parent"]))
    np.testing.assert_array_equal(got.numpy(), want)
    # The query at token 6 (second completion of the first group) sees its prompt and itself.
    q = int(np.flatnonzero(b["input_ids"][0] == 6)[0])
    assert b["input_ids"][0, np.flatnonzero(want[0, 0, q])].tolist() == [1, 2, 5, 6]


@pytest.mark.parametrize("prompts, completions, max_tokens, per_token, match", [
    ([np.array([1])], [], 8, None, r"completions: expected one list per prompt \(1\), got 0"),
    ([np.array([], np.int64)], [[np.array([1])]], 8, None, r"prompts\[0\]: expected at least 1"),
    ([np.array([1])], [[np.array([], np.int64)]], 8, None, r"completions\[0\]\[0\]: expected"),
    ([np.array([1, 2, 3])], [[np.array([1]), np.array([1] * 6)]], 8, None,
     r"completions\[0\]\[1\]: prompt \+ completion is 9 tokens, more than max_tokens=8"),
    ([np.array([1])], [[np.array([2, 3])]], 8, {"v": [np.zeros(3)]},
     r"per_token\['v'\]\[0\]: expected 2 values, got 3"),
    ([np.array([1])], [[np.array([2, 3])]], 8, {"v": []},
     r"per_token\['v'\]: expected 1 arrays, got 0"),
])
def test_bad_input_is_named(prompts, completions, max_tokens, per_token, match):
    with pytest.raises(ValueError, match=match):
        pack_shared_prefix(prompts, completions, max_tokens, 0, per_token)


@pytest.mark.parametrize("row_tokens", [0, 9])
def test_bad_row_tokens_is_named(row_tokens):
    with pytest.raises(ValueError, match=rf"row_tokens: expected 1 <= row_tokens <= "
                                         rf"max_tokens=8, got {row_tokens}"):
        pack_shared_prefix([np.array([1])], [[np.array([2])]], 8, 0, row_tokens=row_tokens)
