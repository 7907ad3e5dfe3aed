"""Write ``docs/results/learning.json``: every learning figure of the seed systems, one row each,
computed from the runs' eval files (never edited by hand; ``tests/test_learning_results.py``
fails when the committed file differs from what this script writes).

    python -m tools.learning_results                 # rewrite docs/results/learning.json
    python -m tools.learning_results --check         # exit 1 if it is not up to date

Input: ``docs/results/evals/index.json``, a list of entries, one per eval file (the files lie
beside it, copied from the run directories so that a clean clone regenerates the output)::

    {"file": "crsp_eval_36d.json",   # file name in docs/results/evals/
     "kind": "crsp",                 # reader: erl | grpo | grpo_compare | guidance | crsp
                                     # | figures
     "system": "crsp",               # erl | grpo | crsp | guidance
     "run": "36d",                   # the run's name, as the docs say it
     "seed": 0,                      # the run's --seed (null: not recorded)
     "group": "...",                 # optional: entries of one setting over seeds; their rows of
                                     # one metric also get a row over seeds (seed null)
     "agent_frozen": false,          # guidance entries: the agent's weights fixed (--freeze-agent)
     "before_file": "...",           # optional, crsp: the same run's earlier checkpoints,
                                     # evaluated apart on the same held-out problems and critic
                                     # attempts (``--attempts-from`` this file's last step)
     "before_step": "warmup",        # optional, crsp: the file's checkpoints from this one on
                                     # (its first: the whole file; ``from_step``)
     "note": "..."}                  # optional: every row of the file gets it as run_note

Readers (one per ``kind``, each turns a file into figures; see the functions below):
``erl`` (``run_dir/eval.jsonl`` of ``python -m trainers.erl``: deterministic returns),
``grpo`` (``eval.json`` of ``python -m trainers.grpo``: held-out accuracy), ``grpo_compare``
(``python -m trainers.grpo.compare``'s JSON: two runs paired on the same problems), ``guidance``
(``eval.json`` of ``python -m trainers.guidance``: the hint's paired effect), ``crsp`` (the JSON
of ``python -m trainers.crsp.evaluate``: solver, critic, proposer), ``figures`` (a file in the
generic format below and nothing else). **Any** eval file may also carry a top-level
``"learning_figures"`` list in the generic format: those figures are added to its rows, so a
new metric (e.g. ``proposer_solvable_rate``, ``critic_balanced_accuracy_raw`` of a new critic)
needs an index entry and no change here. A generic figure::

    {"metric": "proposer_solvable_rate", "before": M, "after": M,
     "overlap": 0, "before_at": 0, "after_at": 44, "note": "...", ...}   # other keys copied

where a measurement ``M`` is one of
``{"k": 12, "n": 400}`` (a proportion: Wilson 95% interval),
``{"values": [...]}`` (a mean: Student-t 95% interval over the values),
``{"n": 200, "first": 80, "fixes": 11, "breaks": 23}`` (paired proportions, e.g. turn 1 and
turn 2 on the same problems: the difference ``(fixes - breaks) / n`` with Newcombe's hybrid
score interval and the exact McNemar p; ``first``: items right in the first measurement), or
``{"value": 0.65, "ci95": [lo, hi]}`` (a figure whose interval the eval file computed, e.g.
an AUC). ``before`` may be null.

Output rows: ``system``, ``metric``, ``seed``, ``run``, ``source`` (eval file),
``before``, ``before_ci95``, ``after``, ``ci95``, ``n`` (after's sample size: problems,
episodes, seeds), ``before_n``, ``overlap`` (held-out items shared with training; null where
there is no such notion), ``interval`` (wilson | t | newcombe_paired | reported),
``before_at`` / ``after_at`` (step, iteration or generation), ``apart`` (the two intervals do
not overlap), ``agent_frozen`` on guidance rows, and per kind ``k`` / ``before_k``,
``fixes`` / ``breaks`` / ``mcnemar_p``, ``seeds``, ``difference`` and ``difference_ci95``
(rows over seeds: the mean per-seed after - before, paired t interval), ``curve`` (ERL: every
evaluation's ``[generation, env_steps, mean return]``; over seeds: the mean of the seeds'
means, when they share the generations), ``note`` (the figure's), ``run_note`` (the index
entry's), ``before_source`` (the entry's ``before_file``), and any other key of the figure
(``role`` ...). Intervals use z = 1.959964 (the trainers' files use 1.96: their bounds differ
in the 6th decimal).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from trainers import statistics

REPO = Path(__file__).resolve().parents[1]
EVALS = REPO / "docs" / "results" / "evals"
OUT = REPO / "docs" / "results" / "learning.json"
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
SYSTEMS = ("erl", "grpo", "crsp", "guidance")


# --- statistics ------------------------------------------------------------------------------

def wilson(k: int, n: int, z: float = Z95) -> list[float]:
    """Wilson score 95% interval of the proportion ``k / n`` (:func:`trainers.statistics.wilson`),
    as a list. Raises ValueError unless 0 <= k <= n and n > 0."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"k, n: expected 0 <= k <= n, n > 0, got {k}, {n}")
    return list(statistics.wilson(k, n, z))


def newcombe_paired(n: int, first: int, fixes: int, breaks: int,
                    z: float = Z95) -> tuple[float, list[float]]:
    """Difference of paired proportions, second minus first, ``(fixes - breaks) / n``, and its
    95% interval by Newcombe's method 10 (:func:`trainers.statistics.newcombe_paired`).
    ``first``: items right in the first measurement; ``fixes``: wrong then right;
    ``breaks``: right then wrong. Raises ValueError when they make no 2x2 table of n items."""
    both = first - breaks
    neither = n - both - fixes - breaks
    if min(both, neither, fixes, breaks) < 0:
        raise ValueError(f"n={n}, first={first}, fixes={fixes}, breaks={breaks}: not a 2x2 table")
    diff, lo, hi = statistics.newcombe_paired(both, breaks, fixes, neither, z)
    return diff, [lo, hi]


def mcnemar_exact(fixes: int, breaks: int) -> float:
    """Two-sided exact McNemar p (:func:`trainers.statistics.mcnemar_exact`)."""
    return statistics.mcnemar_exact(breaks, fixes)


def t_quantile(df: int, q: float = 0.975) -> float:
    """Quantile of Student's t with ``df`` degrees of freedom (bisection on its CDF)."""
    if df < 1:
        raise ValueError(f"df: expected >= 1, got {df}")
    lo, hi = 0.0, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        if _t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _t_cdf(x: float, df: int) -> float:
    """P(T <= x), x >= 0: 1 - I_{df/(df+x^2)}(df/2, 1/2) / 2 (regularized incomplete beta)."""
    return 1 - 0.5 * _betainc(df / 2, 0.5, df / (df + x * x))


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) (continued fraction, Numerical Recipes 6.4)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log(1 - x))
    if x > (a + 1) / (a + b + 2):
        return 1 - _betainc(b, a, 1 - x)
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > 1e-300 else 1e-300)
    h = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + num * d
            d = 1 / (d if abs(d) > 1e-300 else 1e-300)
            c = 1 + num / c if abs(1 + num / c) > 1e-300 else 1e-300
            h *= d * c
    return front * h / a


def t_interval(values: list[float]) -> tuple[float, list[float]]:
    """Mean of ``values`` and its 95% Student-t interval (one value: the interval is the
    value)."""
    n = len(values)
    if n == 0:
        raise ValueError("values: expected at least one")
    mean = sum(values) / n
    if n == 1:
        return mean, [mean, mean]
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(n - 1) * sd / math.sqrt(n)
    return mean, [mean - half, mean + half]


# --- measurements -> row fields --------------------------------------------------------------

def measure(m: dict[str, Any]) -> dict[str, Any]:
    """A measurement (see the module docstring) as ``value``, ``ci95``, ``n``, ``interval``
    and its counts."""
    if "fixes" in m:
        diff, ci = newcombe_paired(m["n"], m["first"], m["fixes"], m["breaks"])
        return {"value": diff, "ci95": ci, "n": m["n"], "interval": "newcombe_paired",
                "extra": {"fixes": m["fixes"], "breaks": m["breaks"],
                          "mcnemar_p": mcnemar_exact(m["fixes"], m["breaks"])}}
    if "k" in m:
        return {"value": m["k"] / m["n"], "ci95": wilson(m["k"], m["n"]), "n": m["n"],
                "interval": "wilson", "extra": {"k": m["k"]}}
    if "values" in m:
        mean, ci = t_interval([float(v) for v in m["values"]])
        return {"value": mean, "ci95": ci, "n": len(m["values"]), "interval": "t", "extra": {}}
    if "value" in m:
        return {"value": m["value"], "ci95": list(m["ci95"]), "n": m.get("n"),
                "interval": "reported", "extra": {}}
    raise ValueError(f"a measurement: expected k/n, values, paired counts or value/ci95, got "
                     f"{sorted(m)}")


def make_row(entry: dict[str, Any], fig: dict[str, Any]) -> dict[str, Any]:
    """One output row from an index entry and a generic figure."""
    after = measure(fig["after"])
    before = measure(fig["before"]) if fig.get("before") is not None else None
    row: dict[str, Any] = {
        "system": entry["system"], "metric": fig["metric"], "seed": entry.get("seed"),
        "run": entry["run"], "source": entry["file"],
        "before": before["value"] if before else None,
        "before_ci95": before["ci95"] if before else None,
        "after": after["value"], "ci95": after["ci95"], "n": after["n"],
        "before_n": before["n"] if before else None, "overlap": fig.get("overlap"),
        "interval": after["interval"], "before_at": fig.get("before_at"),
        "after_at": fig.get("after_at"),
        "apart": (before["ci95"][1] < after["ci95"][0] or after["ci95"][1] < before["ci95"][0])
        if before else None}
    row.update(after["extra"])
    if before:
        row.update({f"before_{k}": v for k, v in before["extra"].items()})
    if entry["system"] == "guidance":
        row["agent_frozen"] = fig.get("agent_frozen", entry.get("agent_frozen"))
    skip = {"metric", "before", "after", "overlap", "before_at", "after_at", "agent_frozen"}
    row.update({k: v for k, v in fig.items() if k not in skip})
    if entry.get("before_file"):
        row["before_source"] = entry["before_file"]
    if entry.get("note"):
        row["run_note"] = entry["note"]
    return row


# --- readers: one eval file -> generic figures -----------------------------------------------

def kn(d: dict[str, Any]) -> dict[str, int]:
    """``{"k", "n"}`` of a ``{"k", "n", "rate", "wilson95"}`` count of the LLM trainers."""
    return {"k": int(d["k"]), "n": int(d["n"])}


def _reported(d: dict[str, Any] | None) -> dict[str, Any] | None:
    """A ``{"value", "ci95", "n"}`` figure the eval file computed (None stays None: a class
    missing)."""
    return None if d is None else {"value": d["value"], "ci95": d["ci95"], "n": d["n"]}


def read_erl(path: Path) -> list[dict[str, Any]]:
    """``eval.jsonl`` of ``python -m trainers.erl`` (``trainers/erl/evaluate.py``): the
    learner's deterministic return, first evaluation (generation 0, untrained) against the
    last; t intervals over the evaluation's episodes."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    first, last = rows[0], rows[-1]
    return [{"metric": "deterministic_return", "before": {"values": first["returns"]},
             "after": {"values": last["returns"]}, "overlap": None,
             "before_at": first["generation"], "after_at": last["generation"],
             "env_steps": last["env_steps"],
             "curve": [[r["generation"], r["env_steps"], r["mean"]] for r in rows]}]


def read_grpo(path: Path) -> list[dict[str, Any]]:
    """``eval.json`` of ``python -m trainers.grpo``: greedy accuracy on the held-out task
    problems (and ASDiv, when evaluated), before against after."""
    d = json.loads(path.read_text())
    out = []
    for part, metric in (("task", "heldout_accuracy"), ("asdiv", "asdiv_accuracy")):
        if part not in d["before"] or part not in d["after"]:
            continue
        b, a = d["before"][part], d["after"][part]
        out.append({"metric": metric, "overlap": a.get("overlap"), "before_at": 0,
                    "after_at": d["after"].get("step"),
                    "before": {"k": round(b["accuracy"] * b["n"]), "n": b["n"]},
                    "after": {"k": round(a["accuracy"] * a["n"]), "n": a["n"]}})
    return out


def read_grpo_compare(path: Path) -> list[dict[str, Any]]:
    """The JSON of ``python -m trainers.grpo.compare``: two runs' checkpoints on the same
    held-out problems, the second's accuracy minus the first's (``heldout_accuracy_paired``:
    Newcombe's interval, exact McNemar p; ``first`` = the first run's right answers)."""
    d = json.loads(path.read_text())
    return [{"metric": "heldout_accuracy_paired", "overlap": d["held_out"].get("overlap"),
             "before_at": None, "after_at": d["step"], "before": None,
             "after": {"n": d["n"], "first": d["both"] + d["breaks"], "fixes": d["fixes"],
                       "breaks": d["breaks"]},
             "accuracy": d["accuracy"],
             "note": f"second run minus first: {d['runs'][1]} - {d['runs'][0]}"}]


def read_guidance(path: Path) -> list[dict[str, Any]]:
    """``eval.json`` of ``python -m trainers.guidance``: the hint's effect (turn-2 minus
    turn-1 accuracy on the same held-out problems, paired), and turn-2 accuracy."""
    d = json.loads(path.read_text())

    def paired(e: dict[str, Any]) -> dict[str, int]:
        n = e["turn1"]["n"]
        return {"n": n, "first": round(e["turn1"]["accuracy"] * n), "fixes": e["fixes"],
                "breaks": e["breaks"]}

    def turn2(e: dict[str, Any]) -> dict[str, int]:
        t = e["turn2"]
        return {"k": round(t["accuracy"] * t["n"]), "n": t["n"]}

    common = {"overlap": d["after"]["turn1"].get("overlap"), "before_at": 0,
              "after_at": d["after"].get("iteration")}
    figs = [{"metric": "hint_effect", "before": paired(d["before"]),
             "after": paired(d["after"]), **common},
            {"metric": "turn2_accuracy", "before": turn2(d["before"]),
             "after": turn2(d["after"]), **common}]
    frozen = d["after"].get("agent_frozen", d.get("agent_frozen"))  # per evaluation, or file
    if frozen is not None:
        for f in figs:
            f["agent_frozen"] = frozen
    return figs


def merged_crsp(before: Path, path: Path) -> dict[str, Any]:
    """``path``'s CRSP evaluation with the checkpoints of ``before`` (the same run's earlier
    checkpoints, evaluated in a second call) put first: allowed only when both files judged
    the same held-out problems (``held_out``) with the same critic attempts
    (``critic_attempts``: ``--attempts-from`` the later file's step, the same counts).

    Raises:
        ValueError: the two files differ in ``held_out`` or ``critic_attempts``, or
            ``before``'s last step is not below ``path``'s first (``"warmup"``, the adapters
            after CRSP's format warm-up, lies between 0 and 1).
    """
    b, d = json.loads(before.read_text()), json.loads(path.read_text())
    for key in ("held_out", "critic_attempts"):
        if b.get(key) != d.get(key):
            raise ValueError(f"{before.name}: before_file: expected the {key!r} of {path.name} "
                             f"(the same held-out problems and critic attempts), got "
                             f"{b.get(key)!r} against {d.get(key)!r}")
    order = lambda step: 0.5 if step == "warmup" else step  # noqa: E731 - after 0, before 1
    if order(b["checkpoints"][-1]["step"]) >= order(d["checkpoints"][0]["step"]):
        raise ValueError(f"{before.name}: before_file: expected checkpoints before step "
                         f"{d['checkpoints'][0]['step']} of {path.name}, got step "
                         f"{b['checkpoints'][-1]['step']}")
    return {**d, "checkpoints": b["checkpoints"] + d["checkpoints"]}


def from_step(path: Path, step: int | str) -> dict[str, Any]:
    """``path``'s CRSP evaluation with its checkpoints from ``step`` on (an index entry's
    ``before_step``: e.g. ``"warmup"`` in a file of steps 0, warmup and 40 gives the rows of
    what self-play added after the format warm-up; the file's own first step gives the rows
    of the whole file).

    Raises:
        ValueError: the file has no checkpoint ``step``, or it is the file's last.
    """
    d = json.loads(path.read_text())
    steps = [c["step"] for c in d["checkpoints"]]
    if step not in steps[:-1]:
        raise ValueError(f"{path.name}: before_step: expected one of the checkpoints before "
                         f"the last, {steps[:-1]}, got {step!r}")
    return {**d, "checkpoints": d["checkpoints"][steps.index(step):]}


def read_crsp(path: Path | dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON of ``python -m trainers.crsp.evaluate``: the solver's held-out accuracy; the
    critic's raw verdict (``margin > 0``) as balanced accuracy: in files of issue 49 on, the
    file's ``critic_balanced_accuracy_raw`` (first attempts of distinct held-out problems,
    MOVER interval of the Wilson recalls, ``interval: reported``) and its balanced-set twin,
    in older files the accuracy on the balanced set (one right and one wrong attempt per
    problem, so its accuracy is the balanced accuracy; the pairs share a problem, so the
    Wilson interval is somewhat narrow); the same at the threshold calibrated on training
    seeds when the file has it (secondary); the critic's AUC (interval from the file); the
    held-out proposer's solvable and verified rates when the checkpoints have them
    (``proposer_solvable_rate``: proposals whose verified answer the solver reaches at least
    once); and the proposer's well-formed rate (training proposals of the first and last
    steps: not held out). Checkpoints: the first against the last; a file of one checkpoint
    gives its held-out figures as ``after`` with ``before`` null. ``path`` may be the
    evaluation itself (:func:`merged_crsp`'s)."""
    d = path if isinstance(path, dict) else json.loads(path.read_text())
    first, last = d["checkpoints"][0], d["checkpoints"][-1]
    at = {"before_at": first["step"], "after_at": last["step"], "overlap": d.get("overlap")}
    figs = [{"metric": "heldout_accuracy", "role": "solver", **at,
             "before": kn(first["solver_accuracy"]), "after": kn(last["solver_accuracy"])}]
    if "critic_balanced_accuracy_raw" in last:  # issue 49's evaluation
        for key, note in (("critic_balanced_accuracy_raw",
                           "first attempt of each held-out problem; margin > 0"),
                          ("critic_balanced_accuracy_raw_balanced_set",
                           "balanced set (a problem gives one attempt of each class)")):
            ends = [c.get(key) for c in (first, last)]
            if ends[1] is not None:  # None: a class missing among the attempts
                figs.append({"metric": key, "role": "critic", **at, "note": note,
                             "before": _reported(ends[0]), "after": _reported(ends[1])})
    else:
        figs.append({"metric": "critic_balanced_accuracy_raw", "role": "critic", **at,
                     "before": kn(first["critic_balanced_set"]["accuracy"]),
                     "after": kn(last["critic_balanced_set"]["accuracy"])})
    cal = [c.get("critic_balanced_set_calibrated") for c in (first, last)]
    if cal[1]:  # cal[0] None: a before_file evaluated with --calibration-size 0 (after alone)
        figs.append({"metric": "critic_balanced_accuracy_calibrated", "role": "critic", **at,
                     "before": kn(cal[0]["accuracy"]) if cal[0] else None,
                     "before_at": at["before_at"] if cal[0] else None,
                     "after": kn(cal[1]["accuracy"]),
                     "threshold": last["calibration"]["tau"],
                     "note": "threshold chosen afterwards on training seeds' attempts"})
    auc = [c["critic_balanced_set"].get("auc") for c in (first, last)]
    if all(auc):
        figs.append({"metric": "critic_auc_balanced", "role": "critic", **at,
                     "before": {"value": auc[0]["auc"], "ci95": auc[0]["ci95"],
                                "n": auc[0]["n_correct"] + auc[0]["n_incorrect"]},
                     "after": {"value": auc[1]["auc"], "ci95": auc[1]["ci95"],
                               "n": auc[1]["n_correct"] + auc[1]["n_incorrect"]}})
    if "proposer" in first and "proposer" in last:  # held-out proposals (issue 49)
        for key in ("solvable", "verified"):
            figs.append({"metric": f"proposer_{key}_rate", "role": "proposer", **at,
                         "before": kn(first["proposer"][key]),
                         "after": kn(last["proposer"][key]),
                         "attempts": last["proposer"]["attempts"]})
    if len(d["checkpoints"]) == 1:  # one checkpoint evaluated: an after without a before
        for f in figs:
            f.update(before=None, before_at=None)
    p = d["proposer"]
    figs.append({"metric": "proposer_well_formed_rate", "role": "proposer", "overlap": None,
                 "before_at": p["first"]["steps"], "after_at": p["last"]["steps"],
                 "before": kn(p["first"]), "after": kn(p["last"]),
                 "note": "proposals of training steps (not held out)"})
    return figs


def read_figures(path: Path) -> list[dict[str, Any]]:
    """A file holding only ``{"learning_figures": [...]}`` (read by :func:`read`)."""
    return []


#: kind -> reader. EXTENSION POINT: a new eval file format gets one reader here (a function
#: returning generic figures); new metrics of a known format need none (``learning_figures``).
READERS = {"erl": read_erl, "grpo": read_grpo, "grpo_compare": read_grpo_compare,
           "guidance": read_guidance, "crsp": read_crsp, "figures": read_figures}


def read(entry: dict[str, Any], evals: Path) -> list[dict[str, Any]]:
    """The rows of one index entry: its reader's figures, then the file's
    ``learning_figures``."""
    if entry.get("system") not in SYSTEMS:
        raise ValueError(f"{entry.get('file')}: system: expected one of {SYSTEMS}, got "
                         f"{entry.get('system')!r}")
    path = evals / entry["file"]
    for key in ("before_file", "before_step"):
        if key in entry and entry["kind"] != "crsp":
            raise ValueError(f"{entry['file']}: {key}: expected only on kind 'crsp', got "
                             f"kind {entry['kind']!r}")
    if entry.get("before_file"):
        figs = read_crsp(merged_crsp(evals / entry["before_file"], path))
    elif "before_step" in entry:
        figs = read_crsp(from_step(path, entry["before_step"]))
    else:
        figs = READERS[entry["kind"]](path)
    if path.suffix == ".json":
        figs += json.loads(path.read_text()).get("learning_figures", [])
    return [make_row(entry, f) for f in figs]


def over_seeds(rows: list[dict[str, Any]], index: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each ``group`` of index entries and metric, a row over its seeds: mean of the
    per-seed ``before`` and ``after`` values with Student-t 95% intervals over seeds, and the
    mean of the per-seed differences (after - before) with its paired t interval."""
    # by file and run: one file may give two entries (the whole file, and from a before_step)
    groups = {(e["file"], e["run"]): e["group"] for e in index if e.get("group")}
    out: list[dict[str, Any]] = []
    keys = sorted({(groups[r["source"], r["run"]], r["system"], r["metric"]) for r in rows
                   if (r["source"], r["run"]) in groups})
    for group, system, metric in keys:
        mine = [r for r in rows if groups.get((r["source"], r["run"])) == group
                and r["metric"] == metric]
        if len(mine) < 2:
            continue
        entry = {"system": system, "run": group, "seed": None, "file": "",
                 "note": f"mean over seeds {[r['seed'] for r in mine]} of the per-seed rows"}
        fig = {"metric": metric, "overlap": mine[0]["overlap"],
               "before_at": mine[0]["before_at"], "after_at": mine[0]["after_at"],
               "before": {"values": [r["before"] for r in mine]}
               if all(r["before"] is not None for r in mine) else None,
               "after": {"values": [r["after"] for r in mine]},
               "seeds": [r["seed"] for r in mine],
               "sources": [r["source"] for r in mine]}
        curves = [r.get("curve") for r in mine]
        if all(curves) and len({tuple(p[0] for p in c) for c in curves}) == 1:
            fig["curve"] = [[pts[0][0], pts[0][1], sum(p[2] for p in pts) / len(pts)]
                            for pts in zip(*curves, strict=True)]
        row = make_row(entry, fig)
        row.pop("source")
        if fig["before"] is not None:  # paired over seeds: each seed's after - before
            diff, ci = t_interval([r["after"] - r["before"] for r in mine])
            row.update({"difference": diff, "difference_ci95": ci})
        out.append(row)
    return out


def build(evals: Path = EVALS) -> list[dict[str, Any]]:
    """Every row: the index's entries in order, then the rows over seeds."""
    index = json.loads((evals / "index.json").read_text())
    rows = [row for entry in index for row in read(entry, evals)]
    return rows + over_seeds(rows, index)


def render(rows: list[dict[str, Any]]) -> bytes:
    """The output file's bytes: one row per line inside a JSON list (stable, diff-friendly)."""
    return ("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n").encode()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.learning_results",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--evals", type=Path, default=EVALS, help="directory of index.json")
    ap.add_argument("--out", type=Path, default=OUT, help="the file to write")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if --out differs from what would be written")
    args = ap.parse_args(argv)
    rows = build(args.evals)
    data = render(rows)
    if args.check:
        same = args.out.exists() and args.out.read_bytes() == data
        fix = "differs: run python -m tools.learning_results"
        print(f"{args.out}: {'up to date' if same else fix}")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    print(f"{args.out}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
