"""Fuzz the restricted unpickler through ``convert_sb3``: mutated SB3-like pickles (protocols
2, 4, 5, gzip) and the hostile pickles of issue 32. Property: only rlbuffers errors escape
(none caused by MemoryError or RecursionError), nothing is written outside the output
directory, a failed conversion leaves no output, the load stays within its memory budget.

``python -m tools.fuzz.fuzz_pickle --minutes 10``"""

from __future__ import annotations

import gzip
import random
import shutil
from pathlib import Path

from tools.fuzz.common import Finding, check_only_own_errors, files_under, mutate_bytes, run

BUDGET = 64 * 2**20


def seeds() -> list[bytes]:
    """Valid pickles of every protocol SB3 and older tools write, and the hostile ones."""
    from tests import hostile_inputs as h

    valid = [h.valid_sb3_pickle(6, protocol) for protocol in (2, 4, 5)]
    return [*valid, gzip.compress(valid[2]), *h.hostile_pickles().values()]


class Fuzz:
    def __init__(self, workdir: Path) -> None:
        self.work = Path(workdir)
        self.seeds = seeds()

    def generate(self, rng: random.Random) -> bytes:
        return mutate_bytes(rng.choice(self.seeds), rng)

    def check(self, data: bytes) -> None:
        from rlbuffers.integrations.sb3.convert import convert_sb3

        case = self.work / "case"
        shutil.rmtree(case, ignore_errors=True)
        case.mkdir()
        (case / "in.pkl").write_bytes(data)
        ok = False
        try:
            convert_sb3(case / "in.pkl", case / "out", memory_budget=BUDGET).close()
            ok = True
        except Finding:
            raise
        except BaseException as exn:  # noqa: BLE001 - the property is about what escapes
            check_only_own_errors(exn)
        stray = {p for p in files_under(case) if p != "in.pkl" and p.split("/")[0] != "out"}
        if stray:
            raise Finding(f"wrote outside the output directory: {sorted(stray)[:5]}")
        if not ok and (case / "out").exists():
            raise Finding("a failed conversion left an output directory")


if __name__ == "__main__":
    raise SystemExit(run("tools.fuzz.fuzz_pickle", __doc__ or ""))
