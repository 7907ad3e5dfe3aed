"""One writer at a time (``writer.lock``, an flock) and nothing lost at exit: a second writer
gets BufferLockedError naming the holder, readers are unaffected, a SIGKILLed writer's lock
is free again, and a background save that is a script's last line is committed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from rlbuffers import BufferExistsError, BufferLockedError, FieldSpec, ReplayBuffer
from rlbuffers.maintenance.repair import repair

FIELDS = {"x": FieldSpec((), "int64")}
REPO = Path(__file__).resolve().parents[1]


def _child(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_second_writer_in_the_same_process_is_refused(tmp_path):
    """D1: two writers used to both commit the same number, one's rows vanishing."""
    buf = ReplayBuffer.create(tmp_path / "b", capacity=8, fields=FIELDS)
    with pytest.raises(BufferLockedError, match=rf"pid {os.getpid()} on host "
                                                rf"{socket.gethostname()}"):
        ReplayBuffer.open(tmp_path / "b")
    with pytest.raises(BufferLockedError):
        repair(tmp_path / "b")
    with pytest.raises(BufferLockedError):  # overwrite=True does not pull it from under buf
        ReplayBuffer.create(tmp_path / "b", capacity=8, fields=FIELDS, overwrite=True)
    with pytest.raises(BufferExistsError):
        ReplayBuffer.create(tmp_path / "b", capacity=8, fields=FIELDS)
    buf.extend({"x": np.arange(3)})
    assert buf.save().commit == 1
    with ReplayBuffer.open(tmp_path / "b", mode="r") as ro:  # readers are unaffected
        assert ro[:]["x"].tolist() == [0, 1, 2]
    buf.close()
    with ReplayBuffer.open(tmp_path / "b") as again:  # released by close
        assert again.commit == 1


def test_writer_in_another_process_and_a_sigkilled_one(tmp_path):
    """The holder is named across processes; the kernel drops a killed writer's flock, so its
    lock is never stale."""
    path = tmp_path / "b"
    ReplayBuffer.create(path, capacity=8, fields=FIELDS).close()
    child = _child(f"""
        import sys, time
        from rlbuffers import ReplayBuffer
        buf = ReplayBuffer.open({str(path)!r})
        print("ready", flush=True)
        time.sleep(600)
    """)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        with pytest.raises(BufferLockedError, match=rf"pid {child.pid} on host"):
            ReplayBuffer.open(path)
        with ReplayBuffer.open(path, mode="r") as ro:
            assert ro.commit == 0
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate()
    assert f'"pid": {child.pid}' in (path / "writer.lock").read_text()  # left behind...
    with ReplayBuffer.open(path) as buf:  # ...but not held
        buf.extend({"x": np.arange(2)})
        assert buf.save().commit == 1
    assert f'"pid": {os.getpid()}' in (path / "writer.lock").read_text()


def test_background_save_as_the_last_line_is_committed(tmp_path):
    """D2: it used to log "cannot schedule new futures after shutdown", exit 0 and commit
    nothing."""
    path = tmp_path / "b"
    child = _child(f"""
        import numpy as np
        from rlbuffers import FieldSpec, ReplayBuffer
        buf = ReplayBuffer.create({str(path)!r}, capacity=4096, chunk_transitions=64,
                                  fields={{"x": FieldSpec((16,), "float64")}})
        buf.extend({{"x": np.arange(3000 * 16, dtype=np.float64).reshape(3000, 16)}})
        buf.save(background=True)
    """)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert "cannot schedule" not in err
    with ReplayBuffer.open(path, mode="r") as ro:
        assert ro.commit == 1 and len(ro) == 3000
        np.testing.assert_array_equal(ro[:]["x"], np.arange(3000 * 16).reshape(3000, 16))


def test_background_save_failing_at_exit_makes_the_exit_status_nonzero(tmp_path):
    path = tmp_path / "b"
    child = _child(f"""
        import numpy as np
        from rlbuffers import FieldSpec, ReplayBuffer
        from rlbuffers.storage.zarr_tier import ZarrTier
        buf = ReplayBuffer.create({str(path)!r}, capacity=64, chunk_transitions=8,
                                  fields={{"x": FieldSpec((), "int64")}})
        buf.extend({{"x": np.arange(20)}})
        def broken(self, manifest):
            raise OSError(28, "No space left on device")
        ZarrTier.commit = broken
        buf.save(background=True)
    """)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 1
    assert "background save" in err and "failed at exit" in err and "No space left" in err
    with ReplayBuffer.open(path, mode="r") as ro:
        assert ro.commit == 0
