"""Frame-stacked fields (``FieldSpec(stack_axis=)``) and derived next fields (``next_of``):
each frame stored once, stacks rebuilt bit-identically to a naive buffer that stores whole
stacks, across episode ends, the ring's seam, saves and reopens."""

import json

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlbuffers import FieldSpec, ReplayBuffer
from rlbuffers.cli.inspect import render
from rlbuffers.errors import FieldError, FormatVersionError, ManifestError
from rlbuffers.maintenance.export import export_commit
from rlbuffers.maintenance.inspection import inspect_path
from rlbuffers.sampling.samplers import PrioritizedSampler, SequenceSampler
from rlbuffers.storage.manifest_schema import check_version

FRAME = (2, 3)


def stream(seed, lengths, k, axis, dtype, padding, ends):
    """Transitions of episodes of ``lengths``, stacked as gymnasium's FrameStackObservation
    (``padding``: "reset" repeats the first frame, "zero" pads with zeros as SB3's
    VecFrameStack): ``obs`` and ``next_obs`` ``[k, *FRAME]`` moved to ``axis``; the last of an
    episode is terminated or truncated by ``ends``."""
    rng = np.random.default_rng(seed)

    def frame():
        f = rng.integers(0, 4, FRAME).astype(dtype)
        if dtype == np.float32:  # bit patterns a value compare would miss
            f.flat[0] = rng.choice([np.nan, -0.0, 0.0, 1.5])
        return f

    out = []
    for e, length in enumerate(lengths):
        f0 = frame()
        pad = f0 if padding == "reset" else np.zeros_like(f0)
        stack = np.stack([pad] * (k - 1) + [f0])
        for t in range(length):
            nxt = np.concatenate([stack[1:], frame()[None]])
            last = t == length - 1
            term = last and ends[e % len(ends)]
            out.append({"obs": np.moveaxis(stack, 0, axis), "next_obs": np.moveaxis(nxt, 0, axis),
                        "reward": np.float32(len(out)), "terminated": term,
                        "truncated": last and not term})
            stack = nxt
    return out


def fields(k, axis, dtype):
    shape = list(FRAME)
    shape.insert(axis, k)
    return {"obs": FieldSpec(tuple(shape), dtype, stack_axis=axis),
            "reward": FieldSpec((), "float32"), "terminated": FieldSpec((), "bool"),
            "truncated": FieldSpec((), "bool")}


def naive_fields(k, axis, dtype):
    f = fields(k, axis, dtype)
    plain = FieldSpec(f["obs"].shape, dtype)
    return {**f, "obs": plain, "next_obs": plain}


def batch(rows):
    return {key: np.stack([np.asarray(r[key]) for r in rows]) for key in rows[0]}


def assert_bits(got, want):
    """Bit-identical field by field (NaN and -0.0 included)."""
    assert set(got) >= set(want)
    for key, w in want.items():
        g, w = np.asarray(got[key]), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, key
        assert g.tobytes() == w.tobytes(), key


def check_against(buf, naive, added, seed):
    """``buf[:]`` equals the last ``len(buf)`` added transitions, and a sample equals the
    naive buffer's sample drawn with the same generator."""
    live = added[len(added) - len(buf):]
    assert len(buf) == len(naive) == len(live)
    if not live:
        return
    assert_bits(buf[:], batch(live))
    assert_bits(buf[-1], live[-1])
    a = buf.sample(16, rng=np.random.default_rng(seed))
    b = naive.sample(16, rng=np.random.default_rng(seed))
    assert_bits(a, {key: b[key] for key in [*live[0], "indices"]})


ops = st.lists(st.tuples(st.sampled_from(["add", "extend", "save", "reopen"]),
                         st.integers(1, 9)), min_size=1, max_size=14)


@settings(max_examples=40, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(k=st.integers(1, 4), axis_last=st.booleans(), capacity=st.integers(1, 12),
       chunk=st.integers(1, 5), lengths=st.lists(st.integers(1, 7), min_size=1, max_size=8),
       padding=st.sampled_from(["reset", "zero"]), dtype=st.sampled_from([np.uint8, np.float32]),
       ends=st.lists(st.booleans(), min_size=1, max_size=3), ops=ops, seed=st.integers(0, 99))
def test_matches_naive_buffer(tmp_path_factory, k, axis_last, capacity, chunk, lengths, padding,
                              dtype, ends, ops, seed):
    """Property: across adds, extends (also over the capacity), episode ends (terminated and
    truncated), the ring's seam, saves, reopens (resume) and read-only snapshots, every
    stored transition and every sample equals a naive buffer of whole stacks."""
    tmp = tmp_path_factory.mktemp("fs")
    axis = len(FRAME) if axis_last else 0
    data = stream(seed, lengths, k, axis, dtype, padding, ends)
    buf = ReplayBuffer.create(tmp / "b", capacity=capacity, chunk_transitions=chunk,
                              fields=fields(k, axis, dtype), next_of={"next_obs": "obs"})
    naive = ReplayBuffer.create(tmp / "n", capacity=capacity, chunk_transitions=chunk,
                                fields=naive_fields(k, axis, dtype))
    added, at = [], 0
    try:
        for op, n in ops:
            if op in ("add", "extend") and at < len(data):
                rows = data[at:at + n]
                at += len(rows)
                if op == "add":
                    for r in rows:
                        buf.add(**r)
                        naive.add(**r)
                else:
                    buf.extend(batch(rows))
                    naive.extend(batch(rows))
                added += rows
            elif op == "save":
                buf.save()
                with ReplayBuffer.open(tmp / "b", mode="r") as snap:  # a committed snapshot
                    check_against(snap, naive, added, seed)
            elif op == "reopen":  # resume: uncommitted transitions are dropped in both
                buf.close()
                buf = ReplayBuffer.open(tmp / "b")
                added = added[:buf.total_added]
                naive.close()
                naive = ReplayBuffer.create(tmp / "n", capacity=capacity, chunk_transitions=chunk,
                                            fields=naive_fields(k, axis, dtype), overwrite=True)
                if added:
                    naive.extend(batch(added))
                at = len(added)
            check_against(buf, naive, added, seed)
    finally:
        buf.close()
        naive.close()


def atari(tmp_path, capacity=8, **kw):
    return ReplayBuffer.create(tmp_path / "b", capacity=capacity, chunk_transitions=4,
                               fields=fields(4, 0, np.uint8), next_of={"next_obs": "obs"}, **kw)


def test_stores_one_frame_per_transition(tmp_path):
    """The working tier and the persistent array of a stacked field hold ``[capacity,
    *frame]``; the manifest records ``stack_axis`` and ``next_of`` and is format 4."""
    buf = atari(tmp_path)
    buf.extend(batch(stream(0, [5, 6], 4, 0, np.uint8, "reset", [True])))
    buf.save()
    assert buf._storage.working.columns["obs"].spec.shape == FRAME
    assert "next_obs" not in buf._storage.working.columns
    assert zarr.open_group(tmp_path / "b", mode="r")["obs"].shape == (8, *FRAME)
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert m["format_version"] == 4 and m["next_of"] == {"next_obs": "obs"}
    assert m["fields"]["obs"]["shape"] == [4, *FRAME] and m["fields"]["obs"]["stack_axis"] == 0
    assert set(m["internal"]) >= {"_head_obs", "_final_obs"}
    assert buf.fields["next_obs"] == buf.fields["obs"]
    buf.close()


def test_stacked_field_chunks_are_sized_by_the_frame(tmp_path):
    """The default chunking of a stacked Atari field at capacity 100,000: each stored chunk of
    the frame column is one base chunk of ~4 MiB of frames (as for a plain field of that
    frame), not 169 base chunks: the sparse head/final columns' ragged size guess no longer
    sets the chunk target (at capacity 1M it made 7 GB chunks: OOM at the first commit)."""
    frame = FieldSpec((84, 84), "uint8")
    stacked = ReplayBuffer.create(tmp_path / "s", capacity=100_000,
                                  fields={"obs": FieldSpec((4, 84, 84), "uint8", stack_axis=0),
                                          "reward": FieldSpec((), "float32")},
                                  next_of={"next_obs": "obs"})
    plain = ReplayBuffer.create(tmp_path / "p", capacity=100_000,
                                fields={"obs": frame, "reward": FieldSpec((), "float32")})
    for buf in (stacked, plain):
        buf.close()
    rows = {k: json.loads((tmp_path / k / "manifest.json").read_text())
            for k in ("s", "p")}
    base = rows["p"]["chunk_transitions"]
    assert base == 4 * 2**20 // (84 * 84)
    assert rows["s"]["chunk_transitions"] == base
    assert rows["s"]["field_chunk_transitions"]["obs"] == base
    assert (rows["s"]["field_chunk_transitions"]["reward"]
            == rows["p"]["field_chunk_transitions"]["reward"])


def test_old_reader_refuses(tmp_path):
    """A format-3 reader (the release before frame stacks) refuses the buffer clearly."""
    atari(tmp_path).close()
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    with pytest.raises(FormatVersionError, match="format version 4 is newer"):
        check_version(m, "manifest.json", 3)


def test_manifest_without_its_columns_is_refused(tmp_path):
    """A manifest whose stacked field lost its head column, or a stacked field in a format 3
    manifest, is a ManifestError naming the key."""
    atari(tmp_path).close()
    path = tmp_path / "b" / "manifest.json"
    good = json.loads(path.read_text())
    bad = json.loads(path.read_text())
    del bad["internal"]["_head_obs"]
    del bad["field_chunk_transitions"]["_head_obs"]
    del bad["chunks"]["_head_obs"]
    path.write_text(json.dumps(bad))
    with pytest.raises(ManifestError, match="_head_obs"):
        ReplayBuffer.open(tmp_path / "b", mode="r")
    path.write_text(json.dumps({**good, "format_version": 3}))
    with pytest.raises(ManifestError, match="format_version"):
        ReplayBuffer.open(tmp_path / "b", mode="r")


def test_inconsistent_stacks_are_refused(tmp_path):
    """A stack that does not continue its episode's previous one, a next observation that is
    not the stack shifted, or one that differs from the next transition's stack: FieldError
    naming the field, and the buffer is unchanged."""
    buf = atari(tmp_path)
    data = stream(1, [6], 4, 0, np.uint8, "reset", [True])
    buf.extend(batch(data[:3]))
    before = buf[:]
    broken = dict(data[3], obs=data[3]["obs"].copy())
    broken["obs"][0] += 1
    with pytest.raises(FieldError, match="'obs'.*does not continue"):
        buf.add(**broken)
    shifted = dict(data[3], next_obs=data[3]["next_obs"].copy())
    shifted["next_obs"][1] += 1
    with pytest.raises(FieldError, match="'next_obs'.*shifted"):
        buf.extend(batch([shifted]))
    other = [data[3], dict(data[4], obs=data[4]["obs"].copy(),
                           next_obs=data[4]["next_obs"].copy())]
    other[1]["obs"][-1] += 1  # continues obs[3][1:] but is not next_obs[3]
    other[1]["next_obs"][-2] += 1
    with pytest.raises(FieldError, match="'next_obs'.*differs"):
        buf.extend(batch(other))
    assert len(buf) == 3
    assert_bits(buf[:], before)
    buf.extend(batch(data[3:]))  # the right continuation is still taken
    assert_bits(buf[:], batch(data[:6]))
    buf.close()


def test_episode_start_takes_any_padding(tmp_path):
    """The first stack of an episode is stored as given: after an episode end the next stack
    may pad with the reset frame (gymnasium's default), zeros (SB3 VecFrameStack) or anything."""
    buf = atari(tmp_path, capacity=32)
    a = stream(2, [3], 4, 0, np.uint8, "reset", [False])
    b = stream(3, [2], 4, 0, np.uint8, "zero", [True])
    c = stream(4, [2], 4, 0, np.uint8, "reset", [True])
    c[0]["obs"] = c[0]["obs"].copy()
    c[0]["obs"][:3] = 7  # custom padding
    c[0]["next_obs"] = c[0]["next_obs"].copy()
    c[0]["next_obs"][:2] = 7
    c[1]["obs"] = c[0]["next_obs"]
    c[1]["next_obs"] = np.concatenate([c[1]["obs"][1:], c[1]["next_obs"][-1:]])
    for r in a + b + c:
        buf.add(**r)
    assert_bits(buf[:], batch(a + b + c))
    buf.close()


def test_end_episode_restarts_stacks(tmp_path):
    """``end_episode``: a stack that does not continue the newest one is refused before, and
    taken (head stored as given) after; every stack and next observation reads back exact,
    across a save and reopen; a second call, or one on an empty buffer, changes nothing."""
    buf = atari(tmp_path, capacity=16)
    assert not buf.end_episode()
    first = stream(0, [5], 4, 0, np.uint8, "zero", [True])[:3]   # an episode left open
    again = stream(1, [4], 4, 0, np.uint8, "zero", [False])
    buf.extend(batch(first))
    with pytest.raises(FieldError, match="continue"):
        buf.extend(batch(again))
    assert len(buf) == 3 and buf.episodes == 0
    assert buf.end_episode() and not buf.end_episode()
    assert buf.episodes == 1
    buf.extend(batch(again))
    buf.save()
    buf.close()
    with ReplayBuffer.open(tmp_path / "b", mode="r") as r:
        rows = r[:]
        assert r.episodes == 2
    for name in ("obs", "next_obs", "terminated"):
        np.testing.assert_array_equal(rows[name], np.stack([t[name] for t in first + again]))


def test_truncated_last_next_obs_is_kept(tmp_path):
    """The next observation of a truncated episode's last transition (which SB3's
    optimize_memory_usage loses) and of the newest transition read back exactly."""
    buf = atari(tmp_path, capacity=16)
    data = stream(5, [3, 4], 4, 0, np.uint8, "reset", [False, False])  # both truncated
    buf.extend(batch(data))
    assert buf[2]["truncated"] and not buf[2]["terminated"]
    np.testing.assert_array_equal(buf[2]["next_obs"], data[2]["next_obs"])
    np.testing.assert_array_equal(buf[-1]["next_obs"], data[-1]["next_obs"])
    assert not np.array_equal(buf[2]["next_obs"], buf[3]["obs"])
    buf.close()


def test_inspect_shows_stacked_field(tmp_path):
    """``inspect`` reports the stacked shape, the stored frame shape and frame bytes; verify
    finds no corrupt chunk."""
    buf = atari(tmp_path)
    buf.extend(batch(stream(6, [5, 6], 4, 0, np.uint8, "reset", [True])))
    buf.save()
    buf.close()
    r = inspect_path(tmp_path / "b", verify=True)
    obs = r["fields"]["obs"]
    assert (obs["shape"], obs["stored_shape"], obs["stack_axis"], obs["stack"]) == (
        [4, *FRAME], list(FRAME), 0, 4)
    assert obs["next_of"] == ["next_obs"] and obs["raw_bytes"] == 8 * 6
    assert r["format_version"] == 4 and r["corrupt"] == []
    assert "stack_axis=0, stores (2, 3), next_obs = next" in render(r)


def test_bad_declarations(tmp_path):
    """Bad ``stack_axis`` or ``next_of``: FieldError naming the argument."""
    with pytest.raises(FieldError, match="stack_axis"):
        FieldSpec((4, 2), "uint8", stack_axis=2)
    with pytest.raises(FieldError, match="stack_axis"):
        FieldSpec((None, 2), "uint8", stack_axis=0)
    f = {"obs": FieldSpec((4, 2), "uint8", stack_axis=-2), "r": FieldSpec((), "float32")}
    assert f["obs"].stack_axis == 0 and f["obs"].column == FieldSpec((2,), "uint8")
    for next_of, match in [({"nx": "r"}, "stacked field"), ({"r": "obs"}, "a field already"),
                           ({"a": "obs", "b": "obs"}, "at most one"), (["obs"], "mapping")]:
        with pytest.raises(FieldError, match=match):
            ReplayBuffer.create(tmp_path / "b", capacity=4, fields=f, next_of=next_of)
    with pytest.raises(FieldError, match="too long"):
        ReplayBuffer.create(tmp_path / "b", capacity=4,
                            fields={"o" * 200: FieldSpec((2, 2), "uint8", stack_axis=0)})
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("padding", ["reset", "zero"])
def test_gymnasium_frame_stack(tmp_path, padding):
    """Transitions of gymnasium's FrameStackObservation (CartPole, episodes truncated at 12
    steps or terminated) in a capacity-20 ring read back exactly, for its default padding
    (the reset frame repeated) and zeros."""
    import gymnasium as gym
    from gymnasium.wrappers import FrameStackObservation

    env = FrameStackObservation(gym.make("CartPole-v1", max_episode_steps=12), 3,
                                padding_type=padding)
    buf = ReplayBuffer.create(tmp_path / "b", capacity=20, chunk_transitions=8, fields={
        "obs": FieldSpec((3, 4), "float32", stack_axis=0), "action": FieldSpec((), "int64"),
        "terminated": FieldSpec((), "bool"), "truncated": FieldSpec((), "bool")},
        next_of={"next_obs": "obs"})
    rng = np.random.default_rng(0)
    obs, _ = env.reset(seed=0)
    added = []
    for _ in range(70):
        action = int(rng.integers(2))
        nxt, _, term, trunc, _ = env.step(action)
        added.append({"obs": obs, "action": action, "terminated": term, "truncated": trunc,
                      "next_obs": nxt})
        buf.add(**added[-1])
        obs = env.reset()[0] if term or trunc else nxt
    assert any(r["truncated"] for r in added) and buf.episodes > 3
    assert_bits(buf[:], batch(added[-20:]))
    buf.close()


@pytest.mark.parametrize("sampler", [SequenceSampler(3), PrioritizedSampler()])
def test_samplers_and_background_save(tmp_path, sampler):
    """Sequence windows ``[B, L]`` and prioritized draws rebuild stacks like ``buf[i]``; a
    background save taken while adds go on commits the state at the call, which reopens
    exactly."""
    buf = ReplayBuffer.create(tmp_path / "b", capacity=10, chunk_transitions=3,
                              fields=fields(3, 0, np.uint8), next_of={"next_obs": "obs"},
                              sampler=sampler)
    data = stream(7, [4, 6, 5, 7], 3, 0, np.uint8, "zero", [True, False])
    buf.extend(batch(data[:12]))
    future = buf.save(background=True)
    for r in data[12:]:
        buf.add(**r)
    future.result()
    s = buf.sample(5)
    ids = s["indices"].reshape(-1)
    live = data[len(data) - len(buf):]
    first = len(data) - len(buf)
    want = batch([live[i - first] for i in ids])
    shape = s["indices"].shape
    assert_bits({k: s[k].reshape(-1, *s[k].shape[len(shape):]) for k in want}, want)
    buf.close()
    with ReplayBuffer.open(tmp_path / "b", mode="r") as snap:
        assert_bits(snap[:], batch(data[2:12]))


def test_export_rebuilds_with_the_documented_rule(tmp_path):
    """``export_commit`` writes the frame columns as stored; the rebuild rule of
    docs/format.md ("Frame stacks"), applied with plain zarr + numpy to the export, gives
    back every stored stack and next observation (the ring has wrapped: the seam's head)."""
    k = 3
    buf = ReplayBuffer.create(tmp_path / "b", capacity=9, chunk_transitions=2,
                              fields=fields(k, 0, np.uint8), next_of={"next_obs": "obs"})
    data = stream(8, [4, 2, 7, 3], k, 0, np.uint8, "reset", [False, True])  # oldest: 7, mid-ep.
    for r in data:
        buf.add(**r)
    buf.save()
    buf.close()
    export_commit(tmp_path / "b", tmp_path / "plain")
    g = zarr.open_group(tmp_path / "plain", mode="r")
    m = g.attrs["rlbuffers"]["manifest"]
    cap, total = m["capacity"], m["total_added"]
    first = total - m["size"]
    frame, episode = g["obs"][:], g["_episode_id"][:]
    columns = {name: g[name][:] for name in ("_head_obs", "_final_obs")}

    def ragged(name, slot):
        return np.frombuffer(columns[name][slot], np.uint8).reshape(-1, *FRAME)

    for t in range(first, total):
        mm = 0
        while mm < k - 1 and t - mm - 1 >= first and \
                episode[(t - mm - 1) % cap] == episode[t % cap]:
            mm += 1
        a = t - mm
        head = list(ragged("_head_obs", a % cap)[mm:]) if mm < k - 1 else []
        stack = np.stack(head + [frame[s % cap] for s in range(a, t + 1)])
        if t + 1 < total and episode[(t + 1) % cap] == episode[t % cap]:
            nxt = frame[(t + 1) % cap]
        else:
            nxt = ragged("_final_obs", t % cap)[0]
        np.testing.assert_array_equal(stack, data[t]["obs"])
        np.testing.assert_array_equal(np.concatenate([stack[1:], nxt[None]]),
                                      data[t]["next_obs"])
