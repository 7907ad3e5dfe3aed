"""Checkpoint writes through the page cache, with ``O_DIRECT``, and over the spare.

Writes a trainer-sized checkpoint (``--torch-gib`` of tensors through ``torch.save``, as an
AdamW state, and ``--safetensors-gib`` through safetensors, as the weights) with
``rlbuffers.checkpoint.Checkpoints`` every step for ``--steps`` steps (``keep=1``: from the
third write on, the spare of the recycling mode exists), three ways: everything to new files
through the page cache (the ``torch.save`` passed as a writer, as before ``O_DIRECT``), the
``torch.save`` file with ``O_DIRECT`` (``torch_files``) and the safetensors file new (the
default), and ``recycle=True`` (``O_DIRECT``, the safetensors file written over the spare's);
``--gap`` seconds between writes (the training step: long enough for freed memory to be
handed back to a VM's host, ~2 s here). Each mode runs in a fresh subprocess, modes
alternating, ``--runs`` times; the table gives the median over runs of each run's median
write (steps 3..N): wall seconds and the process's kernel (sys) seconds, which is where a
page touched afresh is paid for. Writes section ``checkpoint`` of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench import report

MODES = {"page cache, new files": ("cache", False),
         "O_DIRECT torch.save, new safetensors file (default)": ("direct", False),
         "O_DIRECT torch.save, safetensors over the spare (recycle=True)": ("direct", True)}


def child(mode: tuple[str, bool], args: argparse.Namespace, root: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from rlbuffers.checkpoint import Checkpoints
    how, recycle = mode

    per = 1 << 26  # 256 MiB fp32 tensors
    opt = {"state": {i: {"exp_avg": torch.rand(per // 4)}
                     for i in range(int(args.torch_gib * 4))}}
    weights = {f"w{i}": torch.rand(per // 4) for i in range(int(args.safetensors_gib * 4))}
    ckpts = Checkpoints(root, keep=1, recycle=recycle)
    rows = []
    for step in range(1, args.steps + 1):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        writers = {"weights.safetensors": lambda p: save_file(weights, str(p))}
        if how == "cache":
            writers["optimizer.pt"] = lambda p: torch.save(opt, p)
        ckpts.write(step, {"optimizer.pt": opt} if how == "direct" else {},
                    state={"step": step}, writers=writers)
        ckpts.prune(step)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        rows.append({"wall": time.perf_counter() - t0, "sys": r1.ru_stime - r0.ru_stime})
        time.sleep(args.gap)  # the training step between two checkpoints
    print("ROWS " + json.dumps(rows), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--torch-gib", type=float, default=1.0)
    p.add_argument("--safetensors-gib", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--gap", type=float, default=5.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--child", choices=list(MODES), help="internal")
    p.add_argument("--root", help="internal")
    args = p.parse_args()
    if args.child:
        child(MODES[args.child], args, Path(args.root))
        return
    got: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(args.runs):
        for mode in MODES:
            with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parents[2]) as d:
                cmd = [sys.executable, "-m", "tools.bench.bench_checkpoint", "--child", mode,
                       "--root", d, *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args)
                                      .items() if k not in ("child", "root", "runs")]]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows = json.loads(out.split("ROWS ", 1)[1])[2:]
            got[mode].append({k: statistics.median(r[k] for r in rows) for k in ("wall", "sys")})
            print(mode, got[mode][-1], flush=True)
    med = {m: {k: statistics.median(r[k] for r in runs) for k in ("wall", "sys")}
           for m, runs in got.items()}
    base = med["page cache, new files"]
    table = report.table(
        ["mode", "write + prune, s", "kernel time, s", "wall vs page cache"],
        [[m, f"{v['wall']:.2f}", f"{v['sys']:.2f}", f"{v['wall'] / base['wall']:.2f}x"]
         for m, v in med.items()])
    body = (f"## Checkpoint writes: page cache, O_DIRECT, the spare overwritten "
            f"(`tools/bench/bench_checkpoint.py`)\n\n{report.stamp()}\n\n"
            f"A checkpoint of {args.torch_gib:g} GiB through `torch.save` and "
            f"{args.safetensors_gib:g} GiB of safetensors written every step by "
            f"`Checkpoints(keep=1)`, {args.gap:g} s between writes, writes 3-{args.steps} of "
            f"each run; medians over {args.runs} fresh processes per mode, alternating.\n\n"
            f"{table}\n")
    report.write_section("checkpoint", body)
    print(body)


if __name__ == "__main__":
    main()
