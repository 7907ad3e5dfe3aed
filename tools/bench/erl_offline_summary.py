"""The offline-to-online comparison of docs/erl.md ("Offline data"): for each arm (a run
directory prefix, e.g. ``runs/issue47/online`` for ``runs/issue47/online_seed1`` ...), the
learner's return per seed (mean of the last ``--last`` generations: one exploration episode
each, noisy) and the best actor's fitness at the last generation, then the mean over seeds with
a 95% Student-t interval.

    python -m tools.bench.erl_offline_summary runs/issue47/online runs/issue47/offline
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

#: two-sided 95% Student-t quantiles by degrees of freedom
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def interval(xs: list[float]) -> str:
    """``mean +- half-width`` (95% t interval; one value: just it)."""
    m = statistics.mean(xs)
    if len(xs) < 2:
        return f"{m:.0f}"
    return f"{m:.0f} +- {T975[len(xs) - 1] * statistics.stdev(xs) / len(xs) ** 0.5:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("arms", nargs="+", help="run directory prefixes (before _seedN)")
    ap.add_argument("--last", type=int, default=3, help="generations averaged (default 3)")
    args = ap.parse_args()
    for arm in args.arms:
        prefix = Path(arm)
        learner, best = [], []
        for run in sorted(prefix.parent.glob(prefix.name + "_seed*")):
            if not (run / "metrics.jsonl").is_file():
                continue
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            learner.append(statistics.mean(r["learner_return"] for r in rows[-args.last:]))
            best.append(rows[-1]["best_fitness"])
            print(f"{run.name}: generations {rows[-1]['generation']}, env steps "
                  f"{rows[-1]['env_steps']:,}, learner (last {args.last}) {learner[-1]:.0f}, "
                  f"last learner {rows[-1]['learner_return']:.0f}, best {best[-1]:.0f}")
        if learner:
            print(f"{arm}: {len(learner)} seeds: learner {interval(learner)}, best fitness "
                  f"{interval(best)}")


if __name__ == "__main__":
    main()
