"""Fuzz ``StreamLoader.load_state_dict``: states taken from a small shard set at several points
(start, mid-epoch, after an epoch; packing and padding), mutated key by key (values replaced
by ints at type limits, strings, None, floats, lists, dicts; keys deleted or added). Property:
the load either raises an rlbuffers error (``StreamStateError``) or the loader then ends
within twice the batches of an epoch (a state may name any epoch, whose shuffle yields a few
batches more or less), raising nothing but rlbuffers errors.

``python -m tools.fuzz.fuzz_stream_state --minutes 10``"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tools.fuzz.common import Finding, check_only_own_errors, mutate_json, run


def _tokenizer_json(texts: list[str]) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[EOS]"], show_progress=False))
    return tok.to_str()


class Fuzz:
    def __init__(self, workdir: Path) -> None:
        from rlbuffers.stream import (
            Packing,
            Padding,
            StreamConfig,
            StreamLoader,
            TextTokenizer,
            write_shards,
        )

        self.work = Path(workdir)
        texts = [" ".join(f"w{(i * 7 + j) % 31}" for j in range(3 + i % 40)) for i in range(80)]
        self.shards = self.work / "shards"
        write_shards(self.shards, records=[{"text": t} for t in texts], max_shard_bytes=12_000,
                     records_per_sample=1, progress=False)
        self.tokenizer = TextTokenizer(_tokenizer_json(texts), eos_token_id=2)
        self.configs = [
            StreamConfig(max_length=64, batching=Packing(rows_per_batch=2,
                                                         packing_window_sequences=16),
                         shuffle_buffer_samples=8, tokenize_batch_texts=8, seed=3),
            StreamConfig(max_length=64, batching=Padding(batch_size=4,
                                                         bucket_window_sequences=12),
                         shuffle_buffer_samples=8, tokenize_batch_texts=8, seed=3),
        ]
        self.loader = lambda cfg: StreamLoader.from_shards(self.shards, self.tokenizer, cfg)
        self.seeds: list[tuple[int, dict[str, Any]]] = []
        self.epoch_batches = []
        for c, cfg in enumerate(self.configs):
            loader = self.loader(cfg)  # epochs differ by a few batches (other shuffles)
            counts = [sum(1 for _ in loader) for _ in range(3)]
            self.epoch_batches.append(2 * max(counts))
            for k in (0, 1, counts[0] // 2, counts[0]):
                loader = self.loader(cfg)
                it = iter(loader)
                for _ in range(k):
                    next(it)
                self.seeds.append((c, json.loads(json.dumps(loader.state_dict()))))

    def generate(self, rng: random.Random) -> bytes:
        c, state = rng.choice(self.seeds)
        return json.dumps({"config": c, "state": mutate_json(state, rng)}).encode()

    def check(self, data: bytes) -> None:
        case = json.loads(data)
        c = case["config"]
        loader = self.loader(self.configs[c])
        try:
            loader.load_state_dict(case["state"])
            n = 0
            for _ in loader:
                n += 1
                if n > self.epoch_batches[c]:
                    raise Finding(f"more than {self.epoch_batches[c]} batches (2 epochs)")
        except Finding:
            raise
        except BaseException as exn:  # noqa: BLE001 - the property is about what escapes
            check_only_own_errors(exn)


if __name__ == "__main__":
    raise SystemExit(run("tools.fuzz.fuzz_stream_state", __doc__ or ""))
