"""Child process of test_crash.py: extend and save in a loop until killed.

``python -m tests.crash_writer PATH SEED [KILL_AT]``: with ``KILL_AT``, the process sends itself
SIGKILL just before its ``KILL_AT``-th filesystem operation (tests/faults.py, counted from the
start: the buffer's create or open, then every extend and save).

Transition ``i`` holds ``i`` in every field, so any reopened state can be checked against the
ids alone. Prints ``start`` first, ``ready`` once the buffer is created or opened, and
``committed <commit> <total_added>`` after each save returns.
"""

import sys

if __name__ == "__main__":  # before the imports, so a parent can time kills from here
    print("start", flush=True)

import numpy as np  # noqa: E402

from rlbuffers import FieldSpec, NotABufferError, PrioritizedSampler, ReplayBuffer  # noqa: E402

FIELDS = {
    "frame": FieldSpec((4, 32, 32), "uint8"),
    "value": FieldSpec((), "int64"),
    "tokens": FieldSpec((None,), "int32"),
}
CAPACITY, CHUNK = 600, 32


def batch(first: int, n: int) -> dict:
    ids = np.arange(first, first + n)
    return {
        "frame": np.broadcast_to((ids % 256).astype(np.uint8)[:, None, None, None],
                                 (n, 4, 32, 32)).copy(),
        "value": ids,
        "tokens": [np.full(i % 50, i, np.int32) for i in ids],
    }


def main(path: str, seed: int) -> None:
    try:
        buf = ReplayBuffer.open(path)
    except NotABufferError:
        buf = ReplayBuffer.create(path, capacity=CAPACITY, fields=FIELDS, chunk_transitions=CHUNK,
                                  sampler=PrioritizedSampler(), seed=0)
    rng = np.random.default_rng(seed)
    print("ready", flush=True)
    while True:
        n = int(rng.integers(1, 150))
        buf.extend(batch(buf.total_added, n))
        s = buf.sample(16)
        buf.update_priorities(s["indices"], s["value"] % 5 + 1.0)
        total = buf.total_added
        if rng.random() < 0.5:
            report = buf.save(metadata={"total": total})
        else:  # background save while more transitions arrive (committed by the next save)
            fut = buf.save(metadata={"total": total}, background=True)
            buf.extend(batch(buf.total_added, int(rng.integers(1, 150))))
            report = fut.result()
        print(f"committed {report.commit} {total}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 3:
        from tests.faults import FaultInjector

        with FaultInjector(at=int(sys.argv[3]), mode="kill").installed():
            main(sys.argv[1], int(sys.argv[2]))
    main(sys.argv[1], int(sys.argv[2]))
