"""DataLoader workers exit when their consumer is SIGKILLed (issue 18, item 10)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from rlbuffers.stream import write_shards

from .conftest import make_texts

CONSUMER = """
import sys
from rlbuffers.stream import Packing, StreamConfig, StreamLoader, TextTokenizer
tok = TextTokenizer(open(sys.argv[2]).read())
# big batches (8 x 2048 int64 x 3 arrays, ~400 KB): a worker's pipe to the dead consumer
# fills up, which is where torch workers used to hang in queue finalisation
cfg = StreamConfig(max_length=2048, batching=Packing(rows_per_batch=8), overflow="split",
                   shuffle_buffer_samples=0, batches_per_epoch=10_000)
loader = StreamLoader.from_shards(sys.argv[1], tok, cfg, num_workers=2)
for i, batch in enumerate(loader):
    if i == 0:
        print("running", flush=True)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_workers_exit_when_the_consumer_is_killed(tmp_path: Path, tokenizer_json):
    write_shards(tmp_path / "shards", records=make_texts(400, seed=1, max_words=2000),
                 max_shard_bytes=200_000, progress=False)
    (tmp_path / "tok.json").write_text(tokenizer_json)
    (tmp_path / "consumer.py").write_text(CONSUMER)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "consumer.py"),
                             str(tmp_path / "shards"), str(tmp_path / "tok.json")],
                            stdout=subprocess.PIPE, env=env, text=True)
    workers: list[psutil.Process] = []
    try:
        assert proc.stdout.readline().strip() == "running"  # blocks until the first batch
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) >= 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5.0
        while not all(_gone(w.pid) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling with a deadline, not a sleep to hit a moment
        assert [w.pid for w in workers if not _gone(w.pid)] == []
    finally:  # whatever happened, leave no process of ours behind
        if proc.poll() is None:
            proc.kill()
        for w in workers:
            if not _gone(w.pid):
                w.kill()
        proc.stdout.close()
