"""tools/learning_results.py (issue 49 item 6): docs/results/learning.json is what the script
writes from the committed eval files, byte for byte (a hand edit fails here); its intervals
against naive references; a row per eval file; the generic input format."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tools import learning_results as lr

REPO = lr.REPO


def naive_wilson(k: int, n: int, z: float = lr.Z95) -> list[float]:
    """The score interval by its definition: every p whose z-test does not reject k / n,
    found on a fine grid refined by bisection."""
    phat = k / n

    def inside(p: float) -> bool:
        return abs(phat - p) <= z * math.sqrt(p * (1 - p) / n) + 1e-15

    def edge(lo: float, hi: float) -> float:  # inside(lo) != inside(hi)
        for _ in range(100):
            mid = (lo + hi) / 2
            if inside(mid) == inside(lo):
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    low = 0.0 if inside(0.0) else edge(0.0, phat if phat > 0 else 1e-12)
    high = 1.0 if inside(1.0) else edge(phat if phat < 1 else 1 - 1e-12, 1.0)
    return [low, high]


@pytest.mark.parametrize("k,n", [(0, 10), (1, 10), (5, 10), (10, 10), (9, 200), (226, 400),
                                 (260, 508), (3, 7), (1599, 1600)])
def test_wilson_matches_the_naive_score_interval(k, n):
    assert lr.wilson(k, n) == pytest.approx(naive_wilson(k, n), abs=1e-9)


def test_newcombe_matches_the_guidance_trainers_per_item_version():
    from trainers.guidance.evaluation import paired_difference

    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(5, 300))
        first = rng.random(n) < rng.random()
        second = np.where(rng.random(n) < 0.7, first, rng.random(n) < rng.random())
        fixes, breaks = int((~first & second).sum()), int((first & ~second).sum())
        diff, ci = lr.newcombe_paired(n, int(first.sum()), fixes, breaks)
        want = paired_difference(first, second, z=lr.Z95)
        assert diff == pytest.approx(want[0], abs=1e-12)
        assert ci == pytest.approx(list(want[1:]), abs=1e-12)
    with pytest.raises(ValueError):
        lr.newcombe_paired(10, 2, 1, 3)  # more breaks than items right first


def test_mcnemar_and_t_against_references():
    def brute(b: int, c: int) -> float:  # sum of the outcomes no more likely than the observed
        m = b + c
        probs = [math.comb(m, i) / 2 ** m for i in range(m + 1)]
        return min(1.0, sum(p for p in probs if p <= probs[b] * (1 + 1e-12)))

    for b, c in [(11, 23), (0, 0), (0, 5), (7, 7), (30, 12)]:
        assert lr.mcnemar_exact(b, c) == pytest.approx(brute(b, c), rel=1e-12)
    assert lr.mcnemar_exact(11, 23) == pytest.approx(0.0576, abs=1e-4)  # issue 49's 0.058
    table = {1: 12.706204736, 2: 4.302652730, 4: 2.776445105, 9: 2.262157163, 30: 2.042272456}
    for df, q in table.items():
        assert lr.t_quantile(df) == pytest.approx(q, abs=1e-8)
    mean, ci = lr.t_interval([1.0, 2.0, 6.0])
    assert mean == 3.0 and ci == pytest.approx([3 - 4.302652730 * math.sqrt(7 / 3),
                                                3 + 4.302652730 * math.sqrt(7 / 3)])


def test_learning_json_is_what_the_script_writes_from_the_committed_evals():
    assert lr.OUT.read_bytes() == lr.render(lr.build()), \
        "docs/results/learning.json differs: regenerate it with python -m tools.learning_results"
    check = subprocess.run([sys.executable, "-m", "tools.learning_results", "--check"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_row_per_eval_file_and_every_row_well_formed():
    index = json.loads((lr.EVALS / "index.json").read_text())
    files = sorted(p.name for p in lr.EVALS.iterdir() if p.name != "index.json")
    read = [e["file"] for e in index] + [e["before_file"] for e in index if "before_file" in e]
    assert sorted(set(read)) == files  # every copied file is read (one may give two entries:
    # the whole file and, with before_step, its later checkpoints)
    rows = json.loads(lr.OUT.read_text())
    for e in index:
        mine = [r for r in rows if r.get("source") == e["file"] and r["run"] == e["run"]]
        assert mine, e["file"]
        assert all(r["system"] == e["system"] for r in mine)
    for r in rows:
        assert r["system"] in lr.SYSTEMS
        for key in ("metric", "seed", "run", "before", "before_ci95", "after", "ci95", "n",
                    "overlap"):
            assert key in r, (key, r)
        lo, hi = r["ci95"]
        assert lo <= r["after"] <= hi
        if r["system"] == "guidance":
            assert "agent_frozen" in r
        if r["interval"] == "wilson":
            assert r["after"] == r["k"] / r["n"]
            assert r["ci95"] == lr.wilson(r["k"], r["n"])


def write_index(d, entries):
    (d / "index.json").write_text(json.dumps(entries))


def test_the_generic_format_and_every_reader(tmp_path):
    figures = {"learning_figures": [
        {"metric": "proposer_solvable_rate", "before": {"k": 2, "n": 80},
         "after": {"k": 30, "n": 80}, "overlap": 0, "role": "proposer"},
        {"metric": "hint_effect", "before": None,
         "after": {"n": 200, "first": 80, "fixes": 11, "breaks": 23}, "overlap": 0},
        {"metric": "critic_auc", "before": {"value": 0.5, "ci95": [0.4, 0.6], "n": 10},
         "after": {"values": [1.0, 2.0, 3.0]}}]}
    (tmp_path / "new.json").write_text(json.dumps(figures))
    guidance = {"before": {"turn1": {"accuracy": 0.4, "n": 200, "overlap": 0},
                           "turn2": {"accuracy": 0.175, "n": 200}, "fixes": 11, "breaks": 56},
                "after": {"turn1": {"accuracy": 0.4, "n": 200, "overlap": 0},
                          "turn2": {"accuracy": 0.34, "n": 200}, "fixes": 11, "breaks": 23,
                          "iteration": 30, "agent_frozen": True}}
    (tmp_path / "g.json").write_text(json.dumps(guidance))
    grpo = {"before": {"task": {"accuracy": 0.11, "n": 200, "overlap": 0}},
            "after": {"task": {"accuracy": 0.575, "n": 200, "overlap": 0}, "step": 70}}
    (tmp_path / "grpo.json").write_text(json.dumps(grpo))
    for s, shift in ((1, 0.0), (2, 100.0)):
        lines = [{"generation": g, "env_steps": 6000 * g, "td3_updates": 0, "n": 2,
                  "mean": 0.0, "std": 0.0, "returns": [g * 10.0 + shift, g * 10.0 + shift + 1]}
                 for g in (0, 2, 4)]
        (tmp_path / f"erl{s}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    shutil.copy(lr.EVALS / "crsp_eval_36e.json", tmp_path / "crsp.json")
    write_index(tmp_path, [
        {"file": "new.json", "kind": "figures", "system": "crsp", "run": "r", "seed": 5},
        {"file": "g.json", "kind": "guidance", "system": "guidance", "run": "g", "seed": 0},
        {"file": "grpo.json", "kind": "grpo", "system": "grpo", "run": "e34", "seed": 0},
        {"file": "erl1.jsonl", "kind": "erl", "system": "erl", "run": "a", "seed": 1, "group": "G"},
        {"file": "erl2.jsonl", "kind": "erl", "system": "erl", "run": "b", "seed": 2, "group": "G"},
        {"file": "crsp.json", "kind": "crsp", "system": "crsp", "run": "c", "seed": 0}])
    rows = lr.build(tmp_path)
    by = {(r["run"], r["metric"]): r for r in rows}
    solv = by["r", "proposer_solvable_rate"]
    assert solv["after"] == 30 / 80 and solv["ci95"] == lr.wilson(30, 80) and solv["apart"]
    assert solv["role"] == "proposer" and solv["seed"] == 5 and solv["before_k"] == 2
    hint = by["r", "hint_effect"]
    assert hint["before"] is None and hint["after"] == pytest.approx(-12 / 200)
    assert hint["mcnemar_p"] == pytest.approx(lr.mcnemar_exact(11, 23))
    assert by["r", "critic_auc"]["interval"] == "t"
    g = by["g", "hint_effect"]
    assert g["agent_frozen"] is True and g["after_at"] == 30
    assert (g["fixes"], g["breaks"], g["before_breaks"]) == (11, 23, 56)
    assert g["ci95"] == lr.newcombe_paired(200, 80, 11, 23)[1]
    assert by["g", "turn2_accuracy"]["k"] == 68
    assert by["e34", "heldout_accuracy"]["k"] == 115 and by["e34", "heldout_accuracy"]["apart"]
    erl = by["a", "deterministic_return"]
    assert (erl["before"], erl["after"], erl["after_at"], erl["n"]) == (0.5, 40.5, 4, 2)
    pooled = by["G", "deterministic_return"]
    assert pooled["seed"] is None and pooled["seeds"] == [1, 2] and pooled["n"] == 2
    assert pooled["after"] == 90.5 and pooled["ci95"] == lr.t_interval([40.5, 140.5])[1]
    assert pooled["difference"] == 40.0 and pooled["difference_ci95"] == [40.0, 40.0]
    assert erl["curve"] == [[0, 0, 0.0], [2, 12000, 0.0], [4, 24000, 0.0]]  # the files' means
    assert pooled["curve"] == [[0, 0, 0.0], [2, 12000, 0.0], [4, 24000, 0.0]]
    crsp = {r["metric"] for r in rows if r["run"] == "c"}
    assert {"heldout_accuracy", "critic_balanced_accuracy_raw",
            "critic_balanced_accuracy_calibrated", "proposer_well_formed_rate"} <= crsp
    write_index(tmp_path, [{"file": "g.json", "kind": "guidance", "system": "other", "run": "g"}])
    with pytest.raises(ValueError, match="system"):
        lr.build(tmp_path)


def test_check_mode_reports_a_stale_file(tmp_path):
    out = tmp_path / "learning.json"
    out.write_bytes(lr.OUT.read_bytes().replace(b"0.", b"0.9", 1))
    assert lr.main(["--check", "--out", str(out)]) == 1
    assert lr.main(["--out", str(out)]) == 0
    assert out.read_bytes() == lr.OUT.read_bytes()


def test_crsp_files_of_issue_49_give_the_raw_critic_and_the_held_out_proposer(tmp_path):
    """An evaluation written by issue 49's ``trainers.crsp.evaluate`` (its figures made by the
    same functions): the raw critic row is the file's first-attempt balanced accuracy with the
    file's MOVER interval, and the held-out proposer's solvable and verified rates are rows
    with Wilson intervals from the checkpoints' counts."""
    from trainers.crsp.figures import balanced_accuracy_ci, proportion

    rng = np.random.default_rng(0)
    labels = rng.random(400) < 0.3
    says = [rng.random(400) < 0.5, np.where(rng.random(400) < 0.8, labels, ~labels)]

    def checkpoint(step, verdicts, solvable, verified):
        ba = balanced_accuracy_ci(verdicts, labels)
        return {"step": step, "solver_accuracy": proportion(40 + step, 400),
                "critic_balanced_accuracy_raw": ba,
                "critic_balanced_accuracy_raw_balanced_set": None,
                "critic_balanced_set": {"accuracy": proportion(100, 200)},
                "proposer": {"n": 200, "attempts": 4, "well_formed": proportion(150, 200),
                             "verified": proportion(verified, 200),
                             "solvable": proportion(solvable, 200),
                             "learnable": proportion(3, 200)}}

    d = {"overlap": 0, "proposer": {"first": proportion(5, 20) | {"steps": [1, 5]},
                                    "last": proportion(15, 20) | {"steps": [36, 40]}},
         "checkpoints": [checkpoint(0, says[0], 4, 10), checkpoint(40, says[1], 60, 90)]}
    (tmp_path / "c49.json").write_text(json.dumps(d))
    write_index(tmp_path, [{"file": "c49.json", "kind": "crsp", "system": "crsp",
                            "run": "i49", "seed": 1}])
    by = {r["metric"]: r for r in lr.build(tmp_path)}
    raw = by["critic_balanced_accuracy_raw"]
    want = d["checkpoints"][1]["critic_balanced_accuracy_raw"]
    assert (raw["after"], raw["ci95"], raw["n"]) == (want["value"], want["ci95"], 400)
    assert raw["interval"] == "reported" and raw["overlap"] == 0 and raw["after_at"] == 40
    tpr, tnr = (says[1] & labels).sum() / labels.sum(), (~says[1] & ~labels).sum() / (~labels).sum()
    assert raw["after"] == pytest.approx((tpr + tnr) / 2) and raw["ci95"][0] > 0.5
    assert "critic_balanced_accuracy_raw_balanced_set" not in by  # None: no row
    solv = by["proposer_solvable_rate"]
    assert (solv["before_k"], solv["k"], solv["n"]) == (4, 60, 200)
    assert solv["ci95"] == lr.wilson(60, 200) and solv["apart"] and solv["attempts"] == 4
    assert by["proposer_verified_rate"]["k"] == 90
    assert by["proposer_well_formed_rate"]["overlap"] is None


def test_a_crsp_file_of_one_checkpoint_gives_afters_only(tmp_path):
    """``--steps 40`` alone: the held-out figures are rows with ``before`` null (not the same
    checkpoint as before and after), the training windows' well-formed rate keeps both."""
    from trainers.crsp.figures import proportion

    one = {"step": 40, "solver_accuracy": proportion(200, 400),
           "critic_balanced_accuracy_raw": {"value": 0.6, "ci95": [0.55, 0.65], "n": 400},
           "critic_balanced_set": {"accuracy": proportion(120, 200)},
           "proposer": {"n": 200, "attempts": 4, "solvable": proportion(9, 200),
                        "verified": proportion(10, 200)}}
    d = {"overlap": 0, "checkpoints": [one],
         "proposer": {"first": proportion(5, 20) | {"steps": [1, 5]},
                      "last": proportion(15, 20) | {"steps": [36, 40]}}}
    (tmp_path / "one.json").write_text(json.dumps(d))
    write_index(tmp_path, [{"file": "one.json", "kind": "crsp", "system": "crsp", "run": "s1",
                            "seed": 1}])
    by = {r["metric"]: r for r in lr.build(tmp_path)}
    for m in ("heldout_accuracy", "critic_balanced_accuracy_raw", "proposer_solvable_rate"):
        assert by[m]["before"] is None and by[m]["before_at"] is None and by[m]["apart"] is None
    assert by["critic_balanced_accuracy_raw"]["after"] == 0.6 and by["heldout_accuracy"]["k"] == 200
    assert by["proposer_well_formed_rate"]["before"] == 0.25


def test_wilson_ends_are_exact_at_zero_and_at_n():
    """At k = 0 (k = n) the interval's low (high) end is exactly 0 (1): the formula's
    rounding put it at +1.7e-18 above an observed rate of 0 for k = 0, n = 200."""
    for n in (1, 7, 200, 400, 1600):
        assert lr.wilson(0, n)[0] == 0.0 and lr.wilson(n, n)[1] == 1.0
        assert lr.wilson(0, n)[1] == pytest.approx(naive_wilson(0, n)[1], abs=1e-9)


def test_a_crsp_before_file_is_merged_only_on_the_same_problems_and_attempts(tmp_path):
    """``before_file``: step 0 evaluated in a second call (``--steps 0 --attempts-from 40``)
    gives the rows' ``before`` exactly as one file of both checkpoints would; a file of other
    held-out problems, other critic attempts or a later step is refused by name."""
    from trainers.crsp.figures import proportion

    def checkpoint(step, solved, raw, solvable):
        return {"step": step, "solver_accuracy": proportion(solved, 400),
                "critic_balanced_accuracy_raw": {"value": raw, "ci95": [raw - 0.05, raw + 0.05],
                                                 "n": 400},
                "critic_balanced_set": {"accuracy": proportion(100, 200)},
                "proposer": {"n": 200, "attempts": 4, "solvable": proportion(solvable, 200),
                             "verified": proportion(solvable + 2, 200)}}

    common = {"overlap": 0, "held_out": {"n": 400, "overlap": 0, "seed": 1000004},
              "critic_attempts": {"from_step": 40, "per_problem": 4,
                                  "correct": proportion(500, 1600)},
              "proposer": {"first": proportion(5, 20) | {"steps": [1, 5]},
                           "last": proportion(15, 20) | {"steps": [36, 40]}}}
    early, late = checkpoint(0, 25, 0.5, 0), checkpoint(40, 204, 0.57, 34)
    for name, cps in (("both.json", [early, late]), ("s0.json", [early]), ("s40.json", [late])):
        (tmp_path / name).write_text(json.dumps({**common, "checkpoints": cps}))
    entry = {"kind": "crsp", "system": "crsp", "run": "s1", "seed": 1}
    write_index(tmp_path, [{"file": "both.json", **entry},
                           {"file": "s40.json", "before_file": "s0.json", **entry}])
    rows = lr.build(tmp_path)
    one = [r for r in rows if r["source"] == "both.json"]
    two = [r for r in rows if r["source"] == "s40.json"]
    assert [r["metric"] for r in one] == [r["metric"] for r in two] and len(one) >= 4
    for a, b in zip(one, two, strict=True):
        assert {k: v for k, v in a.items() if k != "source"} == \
            {k: v for k, v in b.items() if k not in ("source", "before_source")}
        assert b["before_source"] == "s0.json"
    by = {r["metric"]: r for r in two}
    assert (by["proposer_solvable_rate"]["before_k"], by["proposer_solvable_rate"]["k"]) == (0, 34)
    assert by["proposer_solvable_rate"]["apart"] and by["heldout_accuracy"]["before_at"] == 0
    for key, bad in (("held_out", {"n": 400, "overlap": 0, "seed": 7}),
                     ("critic_attempts", {**common["critic_attempts"], "from_step": 0})):
        (tmp_path / "bad.json").write_text(json.dumps({**common, key: bad,
                                                       "checkpoints": [early]}))
        write_index(tmp_path, [{"file": "s40.json", "before_file": "bad.json", **entry}])
        with pytest.raises(ValueError, match=f"before_file.*{key}"):
            lr.build(tmp_path)
    write_index(tmp_path, [{"file": "s0.json", "before_file": "s40.json", **entry}])
    with pytest.raises(ValueError, match="before_file: expected checkpoints before step 0"):
        lr.build(tmp_path)
    warm = {**early, "step": "warmup"}  # --steps warmup: after the format warm-up, before 1
    (tmp_path / "sw.json").write_text(json.dumps({**common, "checkpoints": [warm]}))
    write_index(tmp_path, [{"file": "s40.json", "before_file": "sw.json", **entry}])
    by = {r["metric"]: r for r in lr.build(tmp_path)}
    assert by["heldout_accuracy"]["before_at"] == "warmup"
    assert by["heldout_accuracy"]["after_at"] == 40
    write_index(tmp_path, [{"file": "sw.json", "before_file": "s0.json", **entry}])
    assert lr.build(tmp_path)  # 0 before warmup
    # The last checkpoint calibrated (--calibration-size 100), the before file not (0): the
    # calibrated row has an after alone, the other rows keep their before.
    calibrated = {**late, "calibration": {"tau": -0.5, "balanced_accuracy": 0.6, "n": 400},
                  "critic_balanced_set_calibrated": {"accuracy": proportion(115, 200)}}
    (tmp_path / "s40c.json").write_text(json.dumps({**common, "checkpoints": [calibrated]}))
    write_index(tmp_path, [{"file": "s40c.json", "before_file": "s0.json", **entry}])
    by = {r["metric"]: r for r in lr.build(tmp_path)}
    cal = by["critic_balanced_accuracy_calibrated"]
    assert (cal["before"], cal["before_at"], cal["k"], cal["threshold"]) == (None, None, 115, -0.5)
    assert by["heldout_accuracy"]["before_k"] == 25 and by["heldout_accuracy"]["before_at"] == 0
    write_index(tmp_path, [{"file": "s40.json", "before_file": "s0.json", **entry,
                            "kind": "figures"}])
    with pytest.raises(ValueError, match="before_file: expected only on kind 'crsp'"):
        lr.build(tmp_path)


def test_a_crsp_before_step_reads_a_file_from_that_checkpoint_on(tmp_path):
    """``before_step``: a file of steps 0, warmup and 40 gives, from "warmup", the rows one
    file of warmup and 40 would (what self-play added after the format warm-up); from 0, the
    rows of the whole file; a step the file lacks, or its last, is refused by name."""
    from trainers.crsp.figures import proportion

    def checkpoint(step, solved, solvable):
        return {"step": step, "solver_accuracy": proportion(solved, 200),
                "critic_balanced_accuracy_raw": {"value": 0.5, "ci95": [0.45, 0.55], "n": 200},
                "critic_balanced_set": {"accuracy": proportion(50, 100)},
                "proposer": {"n": 200, "attempts": 4, "solvable": proportion(solvable, 200),
                             "verified": proportion(solvable + 2, 200)}}

    common = {"overlap": 0, "proposer": {"first": proportion(5, 20) | {"steps": [1, 5]},
                                         "last": proportion(15, 20) | {"steps": [36, 40]}}}
    c0, cw, c40 = checkpoint(0, 12, 0), checkpoint("warmup", 12, 29), checkpoint(40, 90, 41)
    for name, cps in (("all.json", [c0, cw, c40]), ("w40.json", [cw, c40])):
        (tmp_path / name).write_text(json.dumps({**common, "checkpoints": cps}))
    entry = {"kind": "crsp", "system": "crsp", "run": "r", "seed": 3}
    write_index(tmp_path, [{"file": "all.json", **entry, "before_step": "warmup"},
                           {"file": "w40.json", **entry},
                           {"file": "all.json", **entry, "before_step": 0},
                           {"file": "all.json", **entry}])
    rows = lr.build(tmp_path)
    n = len(rows) // 4
    strip = lambda r: {k: v for k, v in r.items() if k != "source"}  # noqa: E731
    assert [strip(r) for r in rows[:n]] == [strip(r) for r in rows[n:2 * n]]
    assert [strip(r) for r in rows[2 * n:3 * n]] == [strip(r) for r in rows[3 * n:]]
    by = {r["metric"]: r for r in rows[:n]}
    assert (by["proposer_solvable_rate"]["before_at"], by["proposer_solvable_rate"]["before_k"],
            by["proposer_solvable_rate"]["k"]) == ("warmup", 29, 41)
    assert rows[2 * n]["before_at"] == 0
    for bad in (1, 40):
        write_index(tmp_path, [{"file": "all.json", **entry, "before_step": bad}])
        with pytest.raises(ValueError, match=r"all.json: before_step: expected one of the "
                                             r"checkpoints before the last, \[0, 'warmup'\], "
                                             f"got {bad}"):
            lr.build(tmp_path)
    write_index(tmp_path, [{"file": "all.json", **entry, "before_step": 0, "kind": "figures"}])
    with pytest.raises(ValueError, match="before_step: expected only on kind 'crsp'"):
        lr.build(tmp_path)
    # Two seeds, each file read whole and from "warmup": the rows over seeds keep the two
    # groups apart (a group is keyed by file and run, not by file alone).
    c40b = checkpoint(40, 100, 61)
    (tmp_path / "b.json").write_text(json.dumps({**common, "checkpoints": [c0, cw, c40b]}))
    entries = [{"file": f, **entry, "seed": seed, "run": f"r{seed}{tag}", "group": f"g{tag}",
                **({"before_step": "warmup"} if tag else {})}
               for f, seed in (("all.json", 3), ("b.json", 4)) for tag in ("", " warm")]
    write_index(tmp_path, entries)
    over = {(r["run"], r["metric"]): r for r in lr.build(tmp_path) if r["seed"] is None}
    whole, warm = over["g", "proposer_solvable_rate"], over["g warm", "proposer_solvable_rate"]
    assert (whole["before_at"], whole["before"], whole["after"]) == (0, 0.0, (41 + 61) / 400)
    assert (warm["before_at"], warm["before"], warm["after"]) == ("warmup", 29 / 200,
                                                                 (41 + 61) / 400)


def test_a_grpo_comparison_gives_the_paired_difference_of_its_two_runs(tmp_path):
    """``python -m trainers.grpo.compare``'s JSON (the fields it writes): one row, the second
    run's accuracy minus the first's on the same problems, with Newcombe's interval and the
    exact McNemar p from the 2x2 table."""
    rng = np.random.default_rng(7)
    a, b = rng.random(200) < 0.4, rng.random(200) < 0.45
    table = {"both": int((a & b).sum()), "breaks": int((a & ~b).sum()),
             "fixes": int((~a & b).sum()), "neither": int((~a & ~b).sum())}
    d = {"runs": ["/r/sync", "/r/async"], "step": 70, "n": 200,
         "held_out": {"overlap": 0, "size": 200}, "accuracy": [a.mean(), b.mean()], **table}
    (tmp_path / "cmp.json").write_text(json.dumps(d))
    write_index(tmp_path, [{"file": "cmp.json", "kind": "grpo_compare", "system": "grpo",
                            "run": "s1 async - sync", "seed": 1}])
    (row,) = lr.build(tmp_path)
    assert row["metric"] == "heldout_accuracy_paired" and row["before"] is None
    assert row["after"] == pytest.approx(b.mean() - a.mean(), abs=1e-12)
    assert (row["fixes"], row["breaks"], row["n"]) == (table["fixes"], table["breaks"], 200)
    assert row["ci95"] == lr.newcombe_paired(200, int(a.sum()), table["fixes"], table["breaks"])[1]
    assert row["mcnemar_p"] == lr.mcnemar_exact(table["fixes"], table["breaks"])
    assert row["interval"] == "newcombe_paired" and row["overlap"] == 0 and row["after_at"] == 70
    assert "/r/async - /r/sync" in row["note"]
