"""CRSP's multi-dimensional rewards, each computed with bounded memory.

Roles (Cognition via Rewarded Self-Play): a *proposer* writes a new problem with its answer
from a seed problem, a *solver* answers problems, a *critic* judges a solution. Per role:

- solver: correctness on seed problems (reasoning-gym's verifier); on proposed problems, half
  agreement with the proposer's answer and half the critic's verdicts on that attempt (the
  fraction saying correct);
- critic: agreement of its verdict with the outcome (the verifier on seed problems, the
  proposer's answer on proposed ones), class-balanced (:func:`balanced_verdict_reward`:
  +-1 weighted by the inverse frequency of the attempt's class, so a verdict that ignores the
  attempt, e.g. always the majority one, earns 0 in expectation and a perfect critic 1);
- proposer (``--proposer-reward learnability``, the default): :func:`learnability`, ``1 -
  |2p - 1|`` of the solver's success rate ``p`` on a proposal whose stated answer the
  verifier confirms (``trainers.crsp.verify``), 0 for any other (a made-up answer earns
  nothing); ``band`` (runs before issue 49): solvability in a band (the solver's success
  rate against the proposal's own stated answer is neither 0 nor 1); plus *creativity*, the
  novelty of the problem against a bounded sketch of earlier ones and against its own seed
  example (MinHash signatures, Broder 1997, via ``datasketch``, in a
  ring of fixed size);
- every role: a format term (``trainers.crsp.formats.format_score``, partial credit, weight
  ``--format-weight``, no decay) and a length term, ``-|tokens - target| / target`` clipped
  to [-1, 0], with each role's target within its own completion limit.

Intrinsic terms (creativity, length) are weighted by ``alpha(step) = alpha0 * decay**step``
(one cached schedule per run, read once per role each step). Advantages are group-relative
(``trainers.llm.policy_loss.group_advantages``: each role samples several completions per
prompt); a role with one completion per prompt is normalised with running mean / std (Chan
et al. 1979 parallel moments: ``rlbuffers.memory.RunningMeanStd``) instead. The critic's
groups are centred but scaled by the running std of its rewards, not each group's own std
(which would cancel the class weights: every group holds one attempt, so one class).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlbuffers.memory.stats import RunningMeanStd, cached_schedule

PROBLEM_RE = re.compile(r"<problem>(.*?)</problem>", re.S)
VERDICT_RE = re.compile(r"<verdict>\s*(correct|incorrect)\s*</verdict>", re.S | re.I)


def parse_proposal(text: str) -> tuple[str, str] | None:
    """``(problem, answer)`` from a proposer completion: the last ``<problem>`` and the last
    ``<answer>`` holding a number; None when either is missing."""
    from trainers.llm.tasks import ANSWER_RE, NUMBER_RE

    problems, answers = PROBLEM_RE.findall(text), ANSWER_RE.findall(text)
    if not problems or not answers or not problems[-1].strip():
        return None
    numbers = NUMBER_RE.findall(answers[-1])
    return (problems[-1].strip(), numbers[0].replace(",", "")) if numbers else None


def parse_verdict(text: str) -> bool | None:
    """The critic's verdict: True (correct), False (incorrect), None (no verdict tag)."""
    found = VERDICT_RE.findall(text)
    return found[-1].lower() == "correct" if found else None


def solvability(success: np.ndarray) -> np.ndarray:
    """1.0 where the solver's success rate (float[N] in [0, 1]) is strictly inside (0, 1)."""
    s = np.asarray(success, np.float64)
    return ((s > 0) & (s < 1)).astype(np.float32)


def learnability(success: np.ndarray, verified: np.ndarray) -> np.ndarray:
    """The proposer's learnability reward (float32[N]): ``1 - |2p - 1|`` for a proposal whose
    stated answer the verifier confirmed (``verified``: bool[N]), ``p`` (``success``: float[N]
    in [0, 1]) the fraction of the solver's attempts that reach that answer; 0 for an
    unverified one. 1 at p = 1/2, 0 for a proposal the solver always or never solves.

    This is R-Zero's uncertainty reward for its Challenger, ``1 - 2 |p_hat - 1/2|`` (Huang
    et al. 2025, "R-Zero: Self-Evolving Reasoning LLM from Zero Data", arXiv 2508.05004,
    Sec. 3.2), with the answer supplied by a verifier as in Absolute Zero's proposer reward
    (Zhao et al. 2025, arXiv 2505.03335, Sec. 3.1, Eq. 4: 0 for a task solved always or
    never, ``1 - r_solve`` otherwise; its Sec. 3.3 validates a proposed task by running it):
    R-Zero scores against the solver's own majority vote, which would pay a proposal whose
    stated answer is made up.

    Raises:
        ValueError: the shapes differ or a rate lies outside [0, 1].
    """
    p, ok = np.asarray(success, np.float64), np.asarray(verified, bool)
    if p.shape != ok.shape or p.ndim != 1:
        raise ValueError(f"success / verified: expected float[N] and bool[N], got {p.shape} "
                         f"and {ok.shape}")
    if ((p < 0) | (p > 1)).any():
        raise ValueError(f"success: expected rates in [0, 1], got {p[(p < 0) | (p > 1)][:3]}")
    return np.where(ok, 1.0 - np.abs(2.0 * p - 1.0), 0.0).astype(np.float32)


def gated(reward: np.ndarray, earns: np.ndarray | None) -> np.ndarray:
    """``reward`` (float[N]) as float32 where ``earns`` (bool[N]) holds, exactly 0 elsewhere
    (``earns`` None: every completion earns). ``--proposer-gate solvable`` passes the
    proposals that are solvable (verified, the solver right at least once), so a made-up,
    unverifiable, malformed or never-solved proposal gets no format, length or creativity
    reward either: Absolute Zero's proposer reward is 0 for a task the solver never solves
    (Zhao et al. 2025, arXiv 2505.03335, Sec. 3.1, Eq. 4), and an invalid proposal gets no
    reward beyond its format penalty (Sec. 3.3).

    Raises:
        ValueError: the shapes differ.
    """
    r = np.asarray(reward, np.float32)
    if earns is None:
        return r
    keep = np.asarray(earns, bool)
    if keep.shape != r.shape:
        raise ValueError(f"earns: expected bool{list(r.shape)} like the rewards, got "
                         f"{list(keep.shape)}")
    return np.where(keep, r, np.float32(0.0))


def length_reward(lengths: Sequence[int], target: int, mini_batch: int = 1024) -> np.ndarray:
    """``-|n - target| / target`` clipped to [-1, 0] per completion (float32[N]).

    One vectorised pass over the N integers; ``mini_batch`` bounds the temporary for a
    caller with millions of lengths. A CRSP step passes one role's completions (tens), so
    there it is a single batch."""
    if target < 1:
        raise ValueError(f"target: expected >= 1 token, got {target}")
    n = np.asarray(lengths, np.int64)
    out = np.empty(len(n), np.float32)
    for i in range(0, len(n), mini_batch):
        part = n[i:i + mini_batch]
        np.clip(-np.abs(part - target) / target, -1.0, 0.0, out=out[i:i + mini_batch],
                casting="unsafe")
    return out


def alpha_schedule(alpha0: float, decay: float) -> Any:
    """``step -> alpha0 * decay**step``, each value computed once (cached)."""
    if not 0 < decay <= 1:
        raise ValueError(f"decay: expected in (0, 1], got {decay}")
    return cached_schedule(lambda step: alpha0 * decay ** step)


class NoveltySketch:
    """Bounded, streaming sketch of earlier problems for the creativity reward: the MinHash
    signatures (``num_perm`` 32-bit hash values each, word 3-shingles) of the newest
    ``capacity`` problems in a ring. Memory: ``capacity * num_perm * 4`` bytes (1,024 x 64:
    256 KiB), whatever the number of problems seen.

    ``novelty(texts)`` is ``1 - max estimated Jaccard similarity`` to the sketch (1.0 against
    an empty sketch); ``add(texts)`` inserts them (the oldest drop out).
    """

    def __init__(self, capacity: int = 1024, num_perm: int = 64, seed: int = 1) -> None:
        if capacity < 1 or num_perm < 1:
            raise ValueError(f"capacity and num_perm: expected >= 1, got {capacity}, {num_perm}")
        self.capacity, self.num_perm, self.seed = capacity, num_perm, seed
        self.signatures = np.zeros((capacity, num_perm), np.uint32)
        self.count = 0  # problems added so far (the ring holds min(count, capacity))

    def signature(self, text: str) -> np.ndarray:
        from datasketch import MinHash

        words = text.lower().split()
        shingles = {" ".join(words[i:i + 3]) for i in range(max(1, len(words) - 2))}
        m = MinHash(num_perm=self.num_perm, seed=self.seed)
        m.update_batch([s.encode() for s in shingles])
        return np.asarray(m.hashvalues, np.uint32)

    def novelty(self, texts: Sequence[str], examples: Sequence[str] | None = None
                ) -> np.ndarray:
        """float32[N]: 1 - the largest estimated Jaccard similarity of each text to the
        sketch and, with ``examples`` (one per text: the seed problem it was written
        from), to its own example, so copying the example scores no creativity."""
        held = self.signatures[:min(self.count, self.capacity)]
        out = np.ones(len(texts), np.float32)
        for i, t in enumerate(texts):
            sig = self.signature(t)
            rows = held if examples is None else np.vstack([held, self.signature(examples[i])])
            if len(rows):
                out[i] = 1.0 - float((rows == sig).mean(axis=1).max())
        return out

    def add(self, texts: Sequence[str]) -> None:
        for t in texts:
            self.signatures[self.count % self.capacity] = self.signature(t)
            self.count += 1

    def state_dict(self) -> dict[str, Any]:
        """Plain data (the signatures as a nested list of ints)."""
        return {"capacity": self.capacity, "num_perm": self.num_perm, "seed": self.seed,
                "count": self.count, "signatures": self.signatures.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__init__(state["capacity"], state["num_perm"], state["seed"])  # type: ignore[misc]
        self.count = int(state["count"])
        self.signatures[:] = np.asarray(state["signatures"], np.uint32)


#: Key in the trainer's running statistics of the critic's ground truth (1: the judged
#: attempt was correct); its mean is the class frequency the verdict reward balances.
TRUTH = "critic_truth"


#: Key in the trainer's statistics of the decayed class counts (:class:`ClassWindow`).
WINDOW = "critic_truth_window"

#: Key in the trainer's statistics of the earlier attempts that top up a balanced critic
#: batch (``trainers.crsp.judging.Reservoir``; only with ``--critic-batch balanced``).
RESERVOIR = "critic_reservoir"

#: ``--critic-class-weights`` choices: the class frequency from the step's judged attempts,
#: from a decayed window of the latest judged attempts, or from every attempt so far.
CLASS_WEIGHTS = ("step", "window", "running")


def class_rate(truth: RunningMeanStd) -> float:
    """Frequency of correct attempts among all judged so far, add-one smoothed (Laplace's
    rule of succession: ``(correct + 1) / (judged + 2)``, in (0, 1) even before both classes
    have been seen)."""
    return float((truth.mean * truth.count + 1.0) / (truth.count + 2.0))


def step_class_rate(truth: np.ndarray) -> float:
    """Frequency of correct attempts among one step's judged attempts (``truth``: bool[M]),
    add-one smoothed as :func:`class_rate`: ``(correct + 1) / (M + 2)``. Weights from it
    make each update's verdict term class-balanced (scikit-learn's ``class_weight=
    "balanced"`` computed on the update's batch): with ``k`` of ``M`` correct, the two
    classes' summed weights ``k / (2 rate)`` and ``(M - k) / (2 (1 - rate))`` are equal
    up to the smoothing, whatever the solver's success rate was before. A running rate
    lags: in the 50-step issue-36 run it read 0.30 while 50-80% of the judged attempts were
    correct, so "correct" kept a 2.3x weight and the critic overshot to it."""
    y = np.asarray(truth, bool)
    if y.ndim != 1:
        raise ValueError(f"truth: expected bool[M], got shape {y.shape}")
    return float((y.sum() + 1.0) / (len(y) + 2.0))


class ClassWindow:
    """Class frequency of the latest judged attempts, over an exponential window of about
    ``window`` attempts (``--critic-class-window``), add-one smoothed.

    Each step's ``M`` judged attempts (``truth``: bool[M]) decay the counts kept so far by
    ``(1 - 1 / window) ** M`` and then add theirs: an attempt judged ``n`` attempts ago
    weighs ``(1 - 1 / window) ** n`` (attempts of one step count as equally recent), so the
    effective number of attempts approaches ``window``. ``rate = (correct + 1) / (judged +
    2)`` as :func:`class_rate` (Laplace's rule of succession on the decayed counts).

    Why: the class weights must balance over many steps, not one. In the 44-step issue-36
    run 26 of 44 steps judged attempts of one class only (94% of all were incorrect); a
    per-step rate (:func:`step_class_rate`) balances only steps holding both classes, so
    the one-class steps pushed "incorrect" unopposed and the verdict said "correct" on 3-4%
    of held-out attempts while its margin's AUC rose to 0.65. A running rate over the whole
    run (:func:`class_rate`) lags a solver that improves (0.30 read while 50-80% were
    correct in the 50-step run). The window follows the recent frequency across steps.

    Raises:
        ValueError: ``window`` below 1, or ``truth`` not bool[M].
    """

    def __init__(self, window: float = 256.0) -> None:
        if not window >= 1.0:
            raise ValueError(f"window: expected >= 1 judged attempts, got {window}")
        self.window, self.judged, self.correct = float(window), 0.0, 0.0

    def update(self, truth: np.ndarray) -> None:
        y = np.asarray(truth, bool)
        if y.ndim != 1:
            raise ValueError(f"truth: expected bool[M], got shape {y.shape}")
        decay = (1.0 - 1.0 / self.window) ** len(y)
        self.judged = self.judged * decay + len(y)
        self.correct = self.correct * decay + float(y.sum())

    @property
    def rate(self) -> float:
        """The smoothed frequency of correct attempts in the window, in (0, 1)."""
        return (self.correct + 1.0) / (self.judged + 2.0)

    def state_dict(self) -> dict[str, float]:
        return {"window": self.window, "judged": self.judged, "correct": self.correct}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.judged, self.correct = float(state["judged"]), float(state["correct"])


def balanced_verdict_reward(verdicts: np.ndarray, truth: np.ndarray, rate: float
                            ) -> np.ndarray:
    """The critic's class-balanced verdict reward (float32[N * K], row by row).

    ``verdicts``: bool[N, K] (K verdicts per judged attempt, True: "correct"); ``truth``:
    bool[N] (the attempt was correct); ``rate``: the frequency of correct attempts, in (0, 1)
    (:func:`class_rate`). A verdict earns ``+w_y`` when it agrees with its attempt's class
    ``y`` and ``-w_y`` when not, ``w_y = 1 / (2 * freq(y))``: inverse class-frequency
    weights (``n / (classes * n_y)``, King & Zeng 2001, "Logistic Regression in Rare Events
    Data", Sec. 4, weighting; scikit-learn's ``class_weight="balanced"``). The mean over a
    batch whose class frequency is ``rate`` is then ``TPR + TNR - 1 = 2 * BA - 1`` in
    [-1, 1] (balanced accuracy ``BA``: Brodersen et al. 2010, ICPR; ``TPR + TNR - 1`` is
    Youden's J, Youden 1950, "Index for rating diagnostic tests"): 0 for any verdict drawn
    without looking at the attempt (always the majority verdict included), 1 for a perfect
    critic. One verdict's reward is ``+-w_y`` (above 1 for the rarer class).

    Raises:
        ValueError: ``rate`` outside (0, 1), or ``truth`` not one label per row.
    """
    if not 0.0 < rate < 1.0:
        raise ValueError(f"rate: expected a class frequency in (0, 1), got {rate}")
    v, y = np.asarray(verdicts, bool), np.asarray(truth, bool)
    if v.ndim != 2 or y.shape != (len(v),):
        raise ValueError(f"truth: expected bool[{len(v)}] for verdicts {v.shape}, got "
                         f"{y.shape}")
    weight = np.where(y, 0.5 / rate, 0.5 / (1.0 - rate))[:, None]
    return (np.where(v == y[:, None], 1.0, -1.0) * weight).astype(np.float32).reshape(-1)


def balanced_accuracy(says: np.ndarray, labels: np.ndarray) -> float:
    """Mean of the recall on correct and on incorrect attempts (bool[N] each; 0.5: no better
    than a constant verdict; a class with no attempt is left out; 0.0 for N = 0)."""
    says, labels = np.asarray(says, bool), np.asarray(labels, bool)
    recalls = [float((says[labels == c] == c).mean()) for c in (True, False)
               if (labels == c).any()]
    return float(np.mean(recalls)) if recalls else 0.0


#: Metrics keys of the critic's confusion counts per step (verdicts, True: "correct").
CONFUSION = ("critic_tp", "critic_fn", "critic_tn", "critic_fp")


def confusion(says: np.ndarray, labels: np.ndarray) -> dict[str, int]:
    """Counts of verdicts ``says`` (bool[N]) against ``labels`` (bool[N]): true positive
    (says correct, is correct), false negative, true negative, false positive."""
    says, labels = np.asarray(says, bool), np.asarray(labels, bool)
    cells = (says & labels, ~says & labels, ~says & ~labels, says & ~labels)
    return {k: int(c.sum()) for k, c in zip(CONFUSION, cells, strict=True)}


def rolling_balanced_accuracy(rows: Sequence[dict[str, Any]], window: int
                              ) -> list[float | None]:
    """Per row, the critic's balanced accuracy over the confusion counts of that row and the
    ``window - 1`` before it (None while either class has no verdict in the window, or for
    rows without counts): a step judges a few attempts, often of one class only."""
    out: list[float | None] = []
    for i in range(len(rows)):
        got = [r for r in rows[max(0, i - window + 1):i + 1] if CONFUSION[0] in r]
        tp, fn, tn, fp = (sum(r[k] for r in got) for k in CONFUSION)
        ok = CONFUSION[0] in rows[i] and tp + fn > 0 and tn + fp > 0
        out.append((tp / (tp + fn) + tn / (tn + fp)) / 2 if ok else None)
    return out


def advantages(stats: dict[str, RunningMeanStd], role: str, rewards: np.ndarray, group: int,
               scale: str = "group") -> tuple[np.ndarray, float]:
    """``role``'s advantages (float32[N], groups of ``group`` contiguous completions) and the
    fraction of groups whose rewards were all equal: group-relative (``group_advantages``;
    they sum to 0 in every group) when ``group`` >= 2, else running normalisation
    (:func:`normalise`; fraction 0). Either way ``stats[role]`` is updated with the rewards.

    ``scale``: ``"group"`` divides by each group's std (GRPO, Shao et al. 2024, Sec. 4.1.2);
    ``"running"`` divides every group by the role's running reward std instead (one scale
    per step, as PPO implementations' reward scaling, Engstrom et al. 2020, "Implementation
    Matters in Deep Policy Gradients", Sec. 3), which keeps reward weights that differ
    between groups (the critic's class weights) in the advantages."""
    from trainers.llm.policy_loss import group_advantages

    if scale not in ("group", "running"):
        raise ValueError(f"scale: expected 'group' or 'running', got {scale!r}")
    if group >= 2:  # the running statistics still follow the role's rewards (logged)
        stats[role].update(np.asarray(rewards, np.float64))
        adv, flat = group_advantages(np.asarray(rewards, np.float32), group, scale)
        if scale == "running":  # group_advantages only centres for this scale
            adv = (adv / max(float(stats[role].std), 1e-6)).astype(np.float32)
        return adv, flat
    return normalise(stats, role, rewards), 0.0


def normalise(stats: dict[str, RunningMeanStd], role: str, rewards: np.ndarray) -> np.ndarray:
    """Advantages of one role's rewards: update its running statistics with this batch, then
    ``(r - mean) / std`` (float32[N])."""
    stats[role].update(np.asarray(rewards, np.float64))
    return np.asarray(stats[role].normalize(np.asarray(rewards, np.float64)), np.float32)
