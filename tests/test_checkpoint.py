"""rlbuffers.checkpoint: atomic checkpoint directories, the buffer commit as the commit point,
pruning, and atomic run creation (crashed at each of its filesystem operations)."""

import numpy as np
import pytest
import torch

from rlbuffers import FieldSpec, ReplayBuffer
from rlbuffers.checkpoint import Checkpoints, create_run, file_crc32c, load_state
from rlbuffers.errors import CorruptCheckpointError
from tests.faults import FaultInjector, SimulatedCrash


def test_prune_keeps_newest_committed_checkpoints(tmp_path):
    for name in ("gen-1", "gen-2", "gen-3", "gen-4", "gen-5.tmp"):
        (tmp_path / name).mkdir()
    Checkpoints(tmp_path, prefix="gen", keep=2, recycle=False).prune(committed=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen-2", "gen-3"]
    for name in ("gen-1", "gen-4", "gen.spare"):
        (tmp_path / name).mkdir()
    (tmp_path / "gen-1" / "a.pt").write_bytes(b"1")
    (tmp_path / "gen-2" / "a.pt").write_bytes(b"2")  # the newest dropped: the spare
    Checkpoints(tmp_path, prefix="gen", keep=1, recycle=True).prune(committed=3)  # a spare
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen-3", "gen.spare"]
    assert (tmp_path / "gen.spare" / "a.pt").read_bytes() == b"2"


def _opt_state(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"state": {0: {"exp_avg": torch.randn(n, generator=g), "step": torch.tensor(seed)}},
            "param_groups": [{"lr": 0.1, "params": [0]}]}


def test_write_reuses_the_spare_and_writes_the_same_bytes(tmp_path):
    """The dropped checkpoint's directory is reused: its files written over (a writer's file
    keeps its inode: the same cached pages), shorter or longer than before, byte for byte
    what a fresh write gives (torch files bypass the page cache, crc32c taken on the way);
    files the new checkpoint does not have are gone."""
    ckpts = Checkpoints(tmp_path / "ckpt", keep=1, recycle=True)
    fresh = Checkpoints(tmp_path / "fresh")
    for step, n in ((1, 50_000), (2, 100), (3, 70_000)):
        extra = {"w.bin": lambda p, k=step: p.write_bytes(bytes([k]) * (1000 * k))}
        if ckpts.spare.is_dir():
            (ckpts.spare / "stale.bin").write_bytes(b"old")
            inode = (ckpts.spare / "w.bin").stat().st_ino
        path = ckpts.write(step, {"opt.pt": _opt_state(n, step)}, writers=extra,
                           state={"step": step} if step != 2 else None)
        want = fresh.write(step, {"opt.pt": _opt_state(n, step)}, writers=extra,
                           state={"step": step} if step != 2 else None)
        ckpts.prune(step)
        assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in want.iterdir())
        for f in want.iterdir():
            assert (path / f.name).read_bytes() == f.read_bytes(), f.name
        assert ckpts.latest(step) == path
        if step > 2:  # step 1's files, dropped by the prune of step 2, were overwritten
            assert (path / "w.bin").stat().st_ino == inode
    assert ckpts.steps() == [3] and ckpts.spare.is_dir()


def test_a_crash_while_overwriting_the_spare_leaves_the_committed_checkpoint(tmp_path):
    """Killed at each filesystem operation of a write that recycles the spare: the committed
    checkpoint still verifies and loads, and the next write and prune work."""
    def setup(root):
        ckpts = Checkpoints(root, keep=1, recycle=True)
        for step in (1, 2):
            ckpts.write(step, {"opt.pt": _opt_state(1000, step)}, state={"step": step})
            ckpts.prune(step)
        return ckpts

    counter = FaultInjector()
    ckpts = setup(tmp_path / "count")
    with counter.installed():
        ckpts.write(3, {"opt.pt": _opt_state(1000, 3)}, state={"step": 3})
    assert counter.count > 5
    for k in range(1, counter.count + 1):
        ckpts = setup(tmp_path / f"run{k}")
        with pytest.raises(SimulatedCrash), FaultInjector(at=k).installed():
            ckpts.write(3, {"opt.pt": _opt_state(1000, 3)}, state={"step": 3})
        ckpts.prune(2)  # the buffer's commit still names step 2
        got = torch.load(ckpts.latest(2) / "opt.pt", weights_only=True)
        assert torch.equal(got["state"][0]["exp_avg"], _opt_state(1000, 2)["state"][0]["exp_avg"])
        ckpts.write(3, {"opt.pt": _opt_state(1000, 3)}, state={"step": 3})
        ckpts.prune(3)
        assert load_state(ckpts.latest(3)) == {"step": 3} and ckpts.steps() == [3]


def test_write_checkpoint_replaces_a_stale_directory_atomically(tmp_path):
    (tmp_path / "gen-2").mkdir()
    (tmp_path / "gen-2" / "stale.pt").write_bytes(b"x")
    final = Checkpoints(tmp_path, prefix="gen").write(2, {"state.pt": {"generation": 2}},
                                                      state={"step": 2, "lr": 0.1})
    assert sorted(p.name for p in final.iterdir()) == ["checksums.json", "state.json",
                                                       "state.pt"]
    assert torch.load(final / "state.pt", weights_only=True) == {"generation": 2}
    assert load_state(final) == {"step": 2, "lr": 0.1}
    assert not (tmp_path / "gen-2.tmp").exists()


def test_latest_checks_every_file_against_its_crc32c(tmp_path):
    """Tensors written without torch's zip CRC load back exactly; a flipped byte, a missing
    file or a truncated one is named at resume (latest), not silently loaded."""
    ckpts = Checkpoints(tmp_path, prefix="step")
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
    extra = {"weights.bin": lambda p: p.write_bytes(bytes(range(256)) * 64)}
    path = ckpts.write(3, {"opt.pt": state}, state={"step": 3}, writers=extra)
    assert ckpts.latest(3) == path
    got = torch.load(path / "opt.pt", weights_only=True)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3
    import crc32c
    assert file_crc32c(path / "weights.bin") == crc32c.crc32c(bytes(range(256)) * 64)

    raw = bytearray((path / "weights.bin").read_bytes())
    raw[1000] ^= 0x01
    (path / "weights.bin").write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=r"weights.bin: crc32c expected 0x"):
        ckpts.latest(3)
    path = ckpts.write(3, {"opt.pt": state}, state={"step": 3}, writers=extra)
    (path / "opt.pt").write_bytes((path / "opt.pt").read_bytes()[:-10])
    with pytest.raises(CorruptCheckpointError, match="opt.pt: crc32c"):
        ckpts.latest(3)
    path = ckpts.write(3, {"opt.pt": state}, state={"step": 3})
    (path / "state.json").unlink()
    with pytest.raises(CorruptCheckpointError, match="state.json: missing"):
        ckpts.latest(3)


def test_the_buffer_commit_names_the_checkpoint(tmp_path):
    ckpts = Checkpoints(tmp_path / "ckpt", keep=2)
    buf = ReplayBuffer.create(tmp_path / "buffer", capacity=8, fields={"x": FieldSpec((), "int64")})
    for step in (1, 2, 3):
        buf.extend({"x": np.arange(2) + step})
        ckpts.write(step, state={"step": step})
        buf.save(metadata={"step": step})
        ckpts.prune(step)
    ckpts.write(4, state={"step": 4})  # killed before the buffer commit of step 4
    buf.close()
    committed = ReplayBuffer.open(tmp_path / "buffer", mode="r").metadata["step"]
    assert load_state(ckpts.latest(committed)) == {"step": 3}
    ckpts.prune(committed)
    assert ckpts.steps() == [2, 3]
    assert ckpts.latest(0) is None
    with pytest.raises(FileNotFoundError, match="names step 1, but its checkpoint is missing"):
        ckpts.latest(1)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="keep: expected an integer >= 1, got 0"):
        Checkpoints(tmp_path, keep=0)
    with pytest.raises(ValueError, match="step: expected an integer >= 0, got -1"):
        Checkpoints(tmp_path).write(-1, state={})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "x").write_text("")
    with pytest.raises(FileExistsError, match="already holds a run"):
        create_run(tmp_path / "run", {}, lambda d: None)


def _make(d):
    (d / "ckpt").mkdir()
    ReplayBuffer.create(d / "buffer", capacity=4, fields={"x": FieldSpec((), "int64")}).close()


def test_run_creation_is_atomic_under_a_crash_at_each_operation(tmp_path):
    counter = FaultInjector()
    with counter.installed():
        create_run(tmp_path / "count", {"lr": 1}, _make)
    assert counter.count > 10
    for k in range(1, counter.count + 1):
        run = tmp_path / f"run{k}"
        try:
            with FaultInjector(at=k, mode="crash").installed():
                create_run(run, {"lr": 1}, _make)
        except SimulatedCrash:
            pass
        if run.exists():  # complete: resumable
            assert (run / "config.json").read_text() and (run / "ckpt").is_dir()
            ReplayBuffer.open(run / "buffer").close()
        else:  # absent: a fresh start works
            create_run(run, {"lr": 1}, _make)
            ReplayBuffer.open(run / "buffer").close()
