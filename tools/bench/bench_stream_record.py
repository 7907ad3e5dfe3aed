"""Peak memory of one large stream record (issue 32 C4): a shard holding a single JSON record
of N MB of text (words of the test corpus), read by ``StreamLoader`` with a BPE tokenizer
trained on that corpus, packing into rows of 2,048 tokens.

Each row runs in a fresh child process (this parent imports nothing heavy), which reports the
rise of its RSS high-water mark (``VmHWM``) while the loader ran, above the RSS after imports,
tokenizer load and loader construction, once with long texts tokenized in pieces (the
default) and once whole (``PIECE_CHARS`` set beyond the text: the behaviour before).

Run: ``python -m tools.bench.bench_stream_record [--mb 5 20]``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

_MAKE = r"""
import sys, numpy as np
from tests.stream.conftest import make_texts, WORDS
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from rlbuffers.stream import write_shards
d, mb = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
big = " ".join(rng.choice(WORDS, size=mb * 2**20 // 5).tolist())[: mb * 2**20]
write_shards(f"{d}/shards{mb}", records=[{"text": big}], progress=False, records_per_sample=1)
tok = Tokenizer(models.BPE(unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.train_from_iterator(make_texts(300), trainers.BpeTrainer(
    vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[EOS]"], show_progress=False))
open(f"{d}/tok.json", "w").write(tok.to_str())
"""

_MEASURE = r"""
import sys, time
from rlbuffers.stream import Packing, StreamConfig, StreamLoader, TextTokenizer, tokenize
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
d, mb, whole = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "whole"
if whole:
    tokenize.PIECE_CHARS = 2**40
tt = TextTokenizer(open(f"{d}/tok.json").read(), eos_token_id=2)
loader = StreamLoader.from_shards(f"{d}/shards{mb}", tt,
                                  StreamConfig(max_length=2048, batching=Packing(rows_per_batch=8)))
base = hwm()
t0 = time.perf_counter()
n = sum(1 for _ in loader)
print(f"{hwm() - base:.0f} {time.perf_counter() - t0:.2f} {n}")
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, nargs="+", default=[5, 20])
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        print("record MB | tokenized | peak RSS rise MiB | x record | seconds | batches")
        for mb in args.mb:
            subprocess.run([sys.executable, "-c", _MAKE, d, str(mb)], check=True)
            for mode in ("whole", "pieces"):
                out = subprocess.run([sys.executable, "-c", _MEASURE, d, str(mb), mode],
                                     check=True, capture_output=True, text=True).stdout.split()
                rise, secs, n = float(out[0]), float(out[1]), int(out[2])
                print(f"{mb:9d} | {mode:9s} | {rise:17.0f} | {rise / mb:8.1f} | {secs:7.2f} | "
                      f"{n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
