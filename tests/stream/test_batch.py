"""A batch is a dict of arrays only (so a naive ``v.to(device)`` loop over it works) with
``max_seqlen`` and ``stats`` as attributes, in process and through DataLoader workers, numpy or
torch; ``.to(device)`` keeps them; a lookup of a former entry says where it went."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import numpy as np
import pytest

from rlbuffers.stream import Padding, StreamBatch, StreamConfig, StreamLoader, collate

from .test_loader import PACK

torch = pytest.importorskip("torch")

KEYS = {"input_ids", "labels", "position_ids", "cu_seqlens"}


def _same(a: StreamBatch, b: StreamBatch) -> None:
    """``a`` and ``b`` hold equal arrays (numpy or torch) and attributes."""
    assert a.keys() == b.keys() and a.max_seqlen == b.max_seqlen and a.stats == b.stats
    for k in a:
        x, y = (np.asarray(v.cpu()) if isinstance(v, torch.Tensor) else v for v in (a[k], b[k]))
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_naive_device_loop_works_on_every_batch(shard_dir, tokenizer, num_workers):
    """as_torch batches (in process, or from 2 DataLoader workers) are the numpy batches of
    the same loader as tensors, attributes included; every entry moves with ``v.to(device)``."""
    want = list(StreamLoader.from_shards(shard_dir, tokenizer, PACK, num_workers=num_workers))
    got = list(StreamLoader.from_shards(shard_dir, tokenizer, PACK, as_torch=True,
                                        num_workers=num_workers))
    assert len(got) == len(want) > 2
    for batch, ref in zip(got, want, strict=True):
        assert isinstance(batch, StreamBatch) and set(batch) == KEYS
        moved = {k: v.to("cpu") for k, v in batch.items()}  # the naive loop
        assert all(isinstance(v, torch.Tensor) for v in moved.values())
        assert isinstance(batch.max_seqlen, int) and batch.stats["num_tokens"] > 0
        assert all(isinstance(v, np.ndarray) for v in ref.values())
        _same(batch, ref)


def test_to_device_keeps_the_attributes_and_converts_numpy():
    rows = [[np.array([5, 6, 7]), np.array([8, 9])], [np.array([3])]]
    b = collate(rows, pad_token_id=0, attention="padding")
    assert set(b) == KEYS | {"attention_mask"}
    assert all(isinstance(v, np.ndarray) for v in b.values())
    t = b.to("cpu")
    assert isinstance(t, StreamBatch) and t.keys() == b.keys()
    assert all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in t.values())
    _same(t, b)
    assert t["cu_seqlens"].dtype == torch.int32 and t.max_seqlen == 4  # [2, 1] in a row of 5
    t.stats["num_tokens"] = -1  # a copy: the original batch's stats are untouched
    assert b.stats["num_tokens"] == 6
    assert t.to("cpu")["input_ids"] is t["input_ids"]  # already there: no copy (torch's .to)


def test_a_former_entry_names_the_attribute():
    b = collate([[np.array([1, 2])]], pad_token_id=0)
    for key in ("stats", "max_seqlen"):
        with pytest.raises(KeyError, match=f"'{key}' is an attribute of the batch, not an "
                                           f"entry .*: use batch.{key}"):
            b[key]
    with pytest.raises(KeyError, match="^'nothing'$"):
        b["nothing"]


def test_pickling_keeps_the_attributes():
    cfg = StreamConfig(max_length=16, batching=Padding(batch_size=2))
    b = collate([[np.array([1, 2, 3])], [np.array([4])]], pad_token_id=cfg.pad_token_id,
                counters={"skipped_malformed": 2})
    again = pickle.loads(pickle.dumps(b))
    assert type(again) is StreamBatch
    _same(again, b)
    assert again.stats["skipped_malformed"] == 2


def test_workers_module_does_not_import_the_loader():
    """The loader hands its workers a plain callable: workers.py imports nothing of the loader,
    not even for annotations (no cycle, however the import graph is drawn)."""
    path = Path(__file__).resolve().parents[2] / "rlbuffers" / "stream" / "workers.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names |= {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    assert not {n for n in names if "loader" in n or n.startswith("rlbuffers")}, names


def test_workers_fork_even_when_another_library_set_spawn(shard_dir, tokenizer):
    """TorchRL sets the process-wide start method to ``spawn`` on import; the loader's
    workers are still forked and give the in-process batches."""
    import multiprocessing

    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("spawn", force=True)
    try:
        got = list(StreamLoader.from_shards(shard_dir, tokenizer, PACK, num_workers=2))
    finally:
        multiprocessing.set_start_method(before, force=True)
    want = list(StreamLoader.from_shards(shard_dir, tokenizer, PACK, num_workers=2))
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        _same(a, b)
