"""What the fuzzers share: byte and JSON mutators driven by a ``random.Random`` (hypothesis's
``st.randoms()`` in the test suite, a seeded one here), the check that only rlbuffers' own
errors escape, and the runner of ``python -m tools.fuzz.NAME``: a worker process under
``RLIMIT_AS`` tries inputs one after the other and reports each; a worker that dies (signal,
memory) or stops reporting (hang) is a finding, its input saved, and a new worker goes on."""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlbuffers.errors import RLBuffersError

#: Numbers that make parsers and allocators misbehave: sizes at type limits and off by one.
INTERESTING = [0, 1, 2, 7, 8, 255, 256, 511, 512, 513, 2**16, 2**20, 2**31 - 1, 2**31,
               2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**64 - 1, -1, -2**31, -2**63]


def mutate_bytes(data: bytes, rng: random.Random, *, max_steps: int = 4) -> bytes:
    """``data`` after 1..``max_steps`` random edits: flip, overwrite with a little-endian
    interesting number (1/2/4/8 bytes), insert or delete a run, duplicate a slice, or
    truncate."""
    b = bytearray(data)
    for _ in range(rng.randint(1, max_steps)):
        if not b:
            b += bytes([rng.randrange(256)])
        i = rng.randrange(len(b))
        op = rng.randrange(7)
        if op == 0:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[i] = rng.randrange(256)
        elif op == 2:
            width = rng.choice([1, 2, 4, 8])
            n = rng.choice(INTERESTING) % (1 << (8 * width))
            b[i:i + width] = n.to_bytes(width, "little")
        elif op == 3:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif op == 4:
            del b[i:i + rng.randint(1, 64)]
        elif op == 5:
            j = rng.randrange(len(b))
            b[i:i] = b[j:j + rng.randint(1, 128)]
        else:
            del b[i:]
    return bytes(b)


def octal_field(n: int, width: int) -> bytes:
    """A tar number field holding ``n`` (octal, or GNU base-256 when too large)."""
    text = b"%o" % max(n, 0)
    if len(text) < width:
        return text.rjust(width - 1, b"0") + b"\0"
    return b"\x80" + (n % 256 ** (width - 1)).to_bytes(width - 1, "big")


def random_json(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value, biased towards what state checks must refuse."""
    kind = rng.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return rng.choice(INTERESTING)
    if kind == 1:
        return rng.randint(-3, 400)
    if kind == 2:
        return rng.choice(["", "abc", "shards", "stream_loader", "0", "1e9"])
    if kind == 3:
        return rng.choice([None, True, False])
    if kind == 4:
        return rng.choice([0.5, -1.0, 1e308, float("nan")])
    if kind == 5:
        return rng.choice([[], {}])
    if kind == 6:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["kind", "pass", "shard", "offset", "window", "emitted", "upstream",
                        "x"]): random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def mutate_json(value: Any, rng: random.Random, *, max_steps: int = 3) -> Any:
    """A deep copy of ``value`` with 1..``max_steps`` edits at random places: replace a value,
    delete a key, add a key, or nudge an int by a small or interesting amount."""
    value = json.loads(json.dumps(value))
    for _ in range(rng.randint(1, max_steps)):
        slots: list[tuple[Any, Any]] = []
        todo = [value]
        while todo:
            node = todo.pop()
            items = node.items() if isinstance(node, dict) else enumerate(node) \
                if isinstance(node, list) else ()
            for k, v in items:
                slots.append((node, k))
                if isinstance(v, (dict, list)):
                    todo.append(v)
        if not slots:
            return random_json(rng)
        node, key = rng.choice(slots)
        op = rng.randrange(4)
        old = node[key]
        if op == 0 or not isinstance(node, dict) and op == 1:
            node[key] = random_json(rng)
        elif op == 1:
            del node[key]
        elif op == 2 and isinstance(node, dict):
            node[rng.choice(["bogus", "pass", "shard", "offset"])] = random_json(rng)
        elif isinstance(old, int) and not isinstance(old, bool):
            node[key] = old + rng.choice([-1, 1, -2, 2, 1000, -1000, *INTERESTING[:5]])
        else:
            node[key] = random_json(rng)
    return value


class Finding(AssertionError):
    """An input broke the property (the message says how)."""


def check_only_own_errors(exn: BaseException) -> None:
    """Pass if ``exn`` is an rlbuffers error not caused by running out of memory or
    recursion; raise :class:`Finding` otherwise."""
    if not isinstance(exn, RLBuffersError):
        raise Finding(f"a {type(exn).__name__} escaped: {exn!r:.300}") from exn
    cur: BaseException | None = exn
    while cur is not None:
        if isinstance(cur, (MemoryError, RecursionError)):
            raise Finding(f"{type(exn).__name__} caused by {type(cur).__name__}: "
                          f"{exn!s:.300}") from exn
        cur = cur.__cause__ or cur.__context__


def files_under(root: Path) -> set[str]:
    """Every path under ``root`` (relative), to check a target wrote nowhere else."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# -- the runner of python -m tools.fuzz.NAME ------------------------------------------------------
def _worker(target: str, start: int, seed: int, workdir: str, address_space: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    import importlib

    mod = importlib.import_module(target)
    fuzz = mod.Fuzz(Path(workdir))
    out = sys.stdout
    i = start
    while True:
        rng = random.Random(seed * 1_000_003 + i)
        data = fuzz.generate(rng)
        Path(workdir, "current.bin").write_bytes(data)
        try:
            fuzz.check(data)
            out.write(f"ok {i}\n")
        except Finding as f:  # saved here: the parent reads it after this worker moved on
            Path(workdir, f"finding-{i}.bin").write_bytes(data)
            out.write("finding " + json.dumps({"index": i, "what": str(f)}) + "\n")
        out.flush()
        i += 1


def run(target: str, description: str, argv: list[str] | None = None) -> int:
    """``python -m tools.fuzz.NAME [--minutes M] [--seed S] [--hang-seconds H]
    [--address-space BYTES] [--out DIR]``: fuzz ``target`` (a module with a ``Fuzz`` class:
    ``Fuzz(workdir)``, ``.generate(rng) -> bytes``, ``.check(data)`` raising
    :class:`Finding`); prints inputs tried and findings, saves each finding's input in
    ``--out``. Exit status 1 if anything was found."""
    p = argparse.ArgumentParser(prog=f"python -m {target}", description=description)
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hang-seconds", type=float, default=30.0)
    p.add_argument("--address-space", type=int, default=4 * 2**30,
                   help="RLIMIT_AS of the worker in bytes (default 4 GiB)")
    p.add_argument("--out", default=None, help="where finding inputs go (default: a temp dir)")
    if argv is None and "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        _worker(target, int(sys.argv[i + 1]), int(sys.argv[i + 2]), sys.argv[i + 3],
                int(sys.argv[i + 4]))
        return 0
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="rlbuffers-fuzz-"))
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + 60 * args.minutes
    tally = {"tried": 0, "next": 0}
    findings: list[str] = []
    while time.monotonic() < deadline:
        work = Path(tempfile.mkdtemp(prefix="w", dir=out))
        proc = subprocess.Popen([sys.executable, "-m", target, "--worker", str(tally["next"]),
                                 str(args.seed), str(work), str(args.address_space)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "OPENBLAS_NUM_THREADS": "1",
                                     "RAYON_NUM_THREADS": "1"})
        cause = _watch(proc, deadline, args.hang_seconds, work, out, tally, findings)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if cause is not None:
            findings.append(f"{cause} ({_save(work, out, tally['next'])})")
            tally["tried"] += 1
            tally["next"] += 1
    print(f"{target}: {tally['tried']:,} inputs tried in {args.minutes:g} min, "
          f"{len(findings)} findings")
    for f in findings:
        print("  " + f)
    return 1 if findings else 0


def _save(work: Path, out: Path, index: int) -> Path:
    """Keep the input of finding ``index`` (the worker's own copy, else its current input:
    a worker that died or hung was on it)."""
    saved = out / f"finding-{index}.bin"
    for src in (work / f"finding-{index}.bin", work / "current.bin"):
        if src.exists():
            saved.write_bytes(src.read_bytes())
            break
    return saved


def _watch(proc: subprocess.Popen[str], deadline: float, hang_seconds: float, work: Path,
           out: Path, tally: dict[str, int], findings: list[str]) -> str | None:
    """Follow one worker until the deadline; None, or why it stopped (death, hang)."""
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], hang_seconds)
        if not ready:
            return f"no progress for {hang_seconds} s (hang) at input {tally['next']}"
        line = proc.stdout.readline()
        if not line:
            return f"worker died (status {proc.wait()}) at input {tally['next']}"
        tally["tried"] += 1
        if line.startswith("finding "):
            f = json.loads(line[len("finding "):])
            findings.append(f"input {f['index']}: {f['what']} ({_save(work, out, f['index'])})")
            tally["next"] = f["index"] + 1
        else:
            tally["next"] = int(line.split()[1]) + 1
    return None


def alarm(seconds: int) -> Callable[[], None]:
    """Raise :class:`Finding` (a hang) if the caller runs ``seconds`` past this call; returns
    the function that cancels it (main thread only)."""
    def ring(signum: int, frame: Any) -> None:
        raise Finding(f"no result after {seconds} s (hang)")

    signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    return lambda: signal.alarm(0)

