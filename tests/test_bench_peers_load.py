"""The pickle peer of ``tools/bench/bench_peers.py`` loads its own state (a dict of numpy
arrays, lists of arrays and ints) exactly, and refuses a pickle that would call anything else."""

import io
import os
import pickle

import numpy as np
import pytest

from tools.bench.bench_peers import _ArraysOnly


def test_the_peers_state_round_trips_and_a_planted_pickle_is_refused():
    state = {"obs": np.arange(24, dtype=np.uint8).reshape(2, 3, 4),
             "reward": np.array([0.5, -1.0], np.float32), "ragged": [np.arange(3), np.arange(1)],
             "terminated": np.array([True, False]), "cursor": 1, "size": 2, "flag": np.bool_(True)}
    back = _ArraysOnly(io.BytesIO(pickle.dumps(state, protocol=4))).load()
    assert back.keys() == state.keys() and back["cursor"] == 1 and back["flag"]
    for k in ("obs", "reward", "terminated"):
        assert back[k].dtype == state[k].dtype and np.array_equal(back[k], state[k])
    assert all(np.array_equal(a, b) for a, b in zip(back["ragged"], state["ragged"], strict=True))

    class Planted:
        def __reduce__(self):
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="system: not a numpy array part"):
        _ArraysOnly(io.BytesIO(pickle.dumps(Planted()))).load()
