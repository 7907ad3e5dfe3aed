"""RingState against a naive model: a list of every transition id ever added, of which the
newest ``capacity`` are stored, transition ``t`` in slot ``t % capacity``."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlbuffers.errors import FieldError
from rlbuffers.ring import RingState


@given(capacity=st.integers(1, 12), appends=st.lists(st.integers(0, 30), max_size=8))
def test_derived_state_matches_a_list_of_ids(capacity, appends):
    ring, added = RingState(capacity), []
    for n in appends:
        first, slots = ring.append_slots(n)
        new = list(range(len(added), len(added) + n))
        kept = new[-capacity:] if n else []
        assert slots.tolist() == [t % capacity for t in kept]
        assert (first == slots[0]) if len(slots) else True
        added += new
        ring = ring.appended(n, 0)
        stored = added[-capacity:] if added else []
        assert (ring.size, ring.total_added) == (len(stored), len(added))
        assert ring.cursor == len(added) % capacity
        assert ring.first_live_id == (stored[0] if stored else 0)
        slots_in_order = ring.slots(np.arange(ring.size))
        assert slots_in_order.tolist() == [t % capacity for t in stored]
        assert ring.ids(slots_in_order).tolist() == stored
        assert ring.positions(slice(None)).tolist() == list(range(len(stored)))
        if stored:
            assert int(ring.positions(-1)) == len(stored) - 1
            assert ring.live(np.array(added)).tolist() == [t in stored for t in added]


def test_episode_ids_count_ends():
    ring = RingState(10, total_added=3, episodes=2)
    ids, ended = ring.episode_ids(np.array([False, True, False, True, True]))
    assert ids.tolist() == [2, 2, 3, 3, 4] and ended == 3
    assert ring.appended(5, ended) == RingState(10, 8, 5)


def test_bad_positions_and_ids_are_named():
    ring = RingState(4, total_added=6)
    with pytest.raises(IndexError, match=r"index \[4\] out of range for buffer of 4"):
        ring.positions(4)
    with pytest.raises(IndexError, match="1-d int array"):
        ring.positions(np.zeros((2, 2), np.int64))
    with pytest.raises(FieldError, match=r"transition ids in \[0, 6\), got min -1 max 6"):
        ring.live(np.array([-1, 6]))


def test_a_key_that_is_not_positions_is_refused_by_name():
    """A field name (``buf['obs']``) or a boolean mask is not taken for positions: before, a
    mask read rows 0 and 1 and a name failed inside numpy's int conversion."""
    ring = RingState(4, total_added=6)
    with pytest.raises(TypeError, match=r"to read field 'obs', select rows first: "
                                        r"buf\[positions\]\['obs'\]"):
        ring.positions("obs")
    with pytest.raises(TypeError, match="expected an int, slice or 1-d int array"):
        ring.positions(np.array([True, False, True, False]))
    with pytest.raises(TypeError, match="got float"):
        ring.positions(1.5)
    assert ring.positions([]).tolist() == [] and ring.positions(np.int32(-1)) == 3
    assert ring.positions([0, -1]).tolist() == [0, 3]
