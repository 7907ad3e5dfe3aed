"""Issue 49, guidance: ``--freeze-agent`` (the agent's weights unchanged bit for bit, no
gradient, no optimizer), the improvement reward (values, buffer rewards, every group in the
guidance step), the "keep your answer" hint, and the paired statistics of every held-out
evaluation (Newcombe's interval against a naive reference, the exact McNemar p against a
binomial enumeration and SciPy)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers")

from tests.test_guidance import args, fake_score, make_tiny_bert, rows  # noqa: E402
from tests.test_guidance_signal import naive_group  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.config import parse_config  # noqa: E402
from trainers.guidance import advantages as gadv  # noqa: E402
from trainers.guidance import evaluation as geval  # noqa: E402
from trainers.guidance import rollout as grollout  # noqa: E402
from trainers.guidance import train  # noqa: E402
from trainers.guidance.config import Config  # noqa: E402
from trainers.guidance.data import episode_rows  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return make_tiny_lm_dir(d / "lm"), make_tiny_bert(d / "bert")


def config(tiny, run_dir, *extra):
    return parse_config(Config, args(tiny, run_dir, *extra), prog="guidance", description="",
                        resumable=set())


# ----- the frozen agent -----------------------------------------------------------------------

@pytest.mark.parametrize("layout", [[], ["--naive-init"]])
def test_frozen_agent_is_unchanged_bit_for_bit_and_has_no_gradient_nor_optimizer(
        tiny, tmp_path, monkeypatch, layout):
    monkeypatch.setattr(train, "score", fake_score)
    cfg = config(tiny, tmp_path / "f", "--freeze-agent", "--iterations", "3",
                 "--memory-budget", str(2**30), *layout)
    L = train.build(cfg)
    try:
        agent = L.policies.models["agent"]
        guidance_names = {n for n, _ in L.policies.models["guidance"].named_parameters()
                          if ".guidance." in n}
        before = {n: p.detach().clone() for n, p in agent.named_parameters()
                  if n not in guidance_names}
        g_before = [p.detach().clone() for p in L.policies.adapter_params("guidance")]
        assert set(L.opts) == {"guidance", "critic"} and set(L.ambs) == {"guidance"}
        got = [train.iterate(L) for _ in range(3)]
        after = dict(agent.named_parameters())
        assert len(before) > 10 and any(".agent." in n for n in before)
        for n, p in before.items():
            assert torch.equal(after[n].detach(), p), n
            assert after[n].grad is None, n
            assert not (".agent." in n and after[n].requires_grad), n
        # the guidance adapter does train, with its own optimizer state
        assert any(not torch.equal(a, b) for a, b in
                   zip(L.policies.adapter_params("guidance"), g_before, strict=True))
        assert L.opts["guidance"].state
        assert all(r["agent_frozen"] is True and "actor_loss" not in r
                   and "seconds_actor" not in r for r in got)
        assert any(r["grad_norm_guidance"] > 0 for r in got)
    finally:
        L.close()


def test_frozen_run_checkpoints_the_initial_agent_and_resumes(tiny, tmp_path, monkeypatch):
    """The agent adapter of every checkpoint equals the seeded initial adapter exactly; the
    AdamW states hold no agent; a resume continues to the same rows."""
    from safetensors.torch import load_file

    monkeypatch.setattr(train, "score", fake_score)
    run = tmp_path / "r"
    train.main(args(tiny, run, "--freeze-agent", "--iterations", "2"))
    train.main(["--run-dir", str(run), "--resume", "--iterations", "3"])
    straight = tmp_path / "s"
    train.main(args(tiny, straight, "--freeze-agent", "--iterations", "3"))
    policies, _, _ = grollout.make_policies(config(tiny, tmp_path / "x"), naive=False)
    want = policies.adapter_state("agent")
    for it in (2, 3):
        ckpt = run / "ckpt" / f"iteration-{it}"
        got = load_file(str(ckpt / "agent.safetensors"))
        assert set(got) == set(want)
        for k, v in want.items():
            assert torch.equal(got[k], torch.from_numpy(v)), k
        opts = torch.load(ckpt / "optimizers.pt", weights_only=True)
        assert set(opts) == {"guidance", "critic"}
    a, b = rows(run), rows(straight)
    assert [r["iteration"] for r in a] == [1, 2, 3]
    for x, y in zip(a, b, strict=True):
        for k in ("guidance_loss", "critic_loss", "value_loss", "turn2_accuracy", "kl_guidance"):
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-7), (x["iteration"], k)


# ----- the improvement reward -----------------------------------------------------------------

def test_improvement_reward_values():
    c1 = np.array([1, 1, 0, 0], np.float32)
    c2 = np.array([[1, 0], [0, 0], [1, 0], [0, 0]], np.float32)
    np.testing.assert_array_equal(gadv.revision_rewards(c1, c2, "improvement"),
                                  [[0, -1], [-1, -1], [1, 0], [0, 0]])  # break -1, fix +1
    np.testing.assert_array_equal(gadv.revision_rewards(c1, c2, "turn2"), c2)
    np.testing.assert_array_equal(gadv.guidance_groups(c1, "improvement"), [0, 1, 2, 3])
    np.testing.assert_array_equal(gadv.guidance_groups(c1, "turn2"), [2, 3])
    pick, group, a_hint, _ = gadv.role_utterances(c1, c2, "none", "improvement")
    assert pick["guidance"] == [(i, u) for i in range(4) for u in (1, 3)]
    # a right answer's group: the hint that keeps it is ahead of the one that breaks it
    np.testing.assert_allclose(group["guidance"], [0.5, -0.5, 0, 0, 0.5, -0.5, 0, 0])
    out = gadv.outcomes(c1, c2, a_hint, "improvement")
    assert (out["fixes"], out["breaks"], out["guidance_groups"]) == (1, 3, 4)
    assert out["guidance_signal_groups"] == 2
    assert out["improvement_mean"] == pytest.approx(-2 / 8)
    # the buffer: a revision's reward is its improvement, its correctness its score
    ep = {"observations": [np.zeros(2, np.int32)] * 5, "actions": [np.ones(1, np.int32)] * 5,
          "truncated": [False] * 5}
    scores = np.concatenate([c1[:, None], c2], 1)
    for mode, want in (("improvement", [0, -1, -1, -1, 1, 0, 0, 0]), ("turn2", c2.ravel())):
        r = episode_rows([ep] * 4, scores, 0, 1, mode)
        np.testing.assert_array_equal(r["reward"][r["turn"] == 2], want)
        np.testing.assert_array_equal(r["reward"][r["turn"] == 0], c1)
        np.testing.assert_array_equal(r["reward"][r["turn"] == 1], 0)
        np.testing.assert_array_equal(r["correctness"][r["turn"] == 2], c2.ravel())


def test_improvement_run_trains_guidance_on_every_group(tiny, tmp_path, monkeypatch):
    """End to end with a scripted score: with --hint-reward improvement the guidance batch
    holds the hints of every problem (right turn-1 answers too) with the naive group
    advantages of the improvement, and the buffer's revision rewards are improvements."""
    def scripted(problems, index, text, **_):  # even problems: always right; odd: by text
        return float(index % 2 == 0 or sum(map(ord, text)) % 2 == 0)

    seen = {}
    real_step = train.policy_step

    def recording_step(policies, role, opt, amb, batch, cfg):
        seen[role] = {k: v.clone() for k, v in batch.items()}
        return real_step(policies, role, opt, amb, batch, cfg)

    monkeypatch.setattr(train, "score", scripted)
    monkeypatch.setattr(train, "policy_step", recording_step)
    E, K = 4, 3
    L = train.build(config(tiny, tmp_path / "i", "--iterations", "1", "--hints-per-answer",
                           str(K), "--episodes-per-iteration", str(E), "--freeze-agent"))
    try:
        row = train.iterate(L)
        b = L.buf[np.arange(len(L.buf))]
    finally:
        L.close()
    assert set(seen) == {"guidance"}  # frozen agent: no actor batch at all
    c1 = b["correctness"][b["turn"] == 0]
    c2 = b["correctness"][b["turn"] == 2].reshape(E, K)
    np.testing.assert_array_equal(b["reward"][b["turn"] == 2], (c2 - c1[:, None]).ravel())
    assert len(seen["guidance"]["advantage"]) == E * K and row["guidance_groups"] == E
    want = [a for i in range(E) for a in naive_group(list(c2[i] - c1[i]), "group")]
    np.testing.assert_allclose(seen["guidance"]["advantage"].numpy(), want, atol=1e-6)


# ----- the keep hint --------------------------------------------------------------------------

def test_keep_hint_is_the_last_candidate_and_offered_in_the_prompt(tiny, tmp_path):
    cfg = config(tiny, tmp_path / "k")
    policies, tok, _ = grollout.make_policies(cfg, naive=False)
    keep = np.append(tok.encode(grollout.KEEP_HINT, add_special_tokens=False), tok.eos_token_id)
    qs = ["What is 2 + 3?", "What is 7 + 1?"]
    kw = {"max_answer_tokens": 4, "max_hint_tokens": 3}
    torch.manual_seed(0)
    out = grollout.play(policies, tok, qs, cfg.utterance_sampling(), hints=3,
                        keep_hint="candidate", **kw)
    for i in range(2):
        assert len(out["actions"][i]) == 7
        np.testing.assert_array_equal(out["actions"][i][5], keep)  # the 3rd hint
        assert out["texts"][i][5] == grollout.KEEP_HINT and out["truncated"][i][5] is False
        assert grollout.KEEP_HINT in tok.decode(out["observations"][i][6])  # its revision
        offer = tok.decode(out["observations"][i][1])
        assert grollout.KEEP_OFFER.strip() in offer
    # greedy evaluation (one hint): the model's own hint, the offer still in the prompt
    ev = grollout.play(policies, tok, qs, cfg.utterance_sampling(), hints=1, greedy=True,
                       keep_hint="candidate", **kw)
    assert grollout.KEEP_OFFER.strip() in tok.decode(ev["observations"][0][1])
    off = grollout.play(policies, tok, qs, cfg.utterance_sampling(), hints=2, greedy=True,
                        keep_hint="off", **kw)
    assert "Keep it" not in tok.decode(off["observations"][0][1])


# ----- paired statistics ----------------------------------------------------------------------

def wilson_by_bisection(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson interval as the set of p whose score statistic |k/n - p| / sqrt(p(1-p)/n)
    is at most z, its ends found by bisection (no closed form)."""
    ph = k / n

    def inside(p: float) -> bool:
        return abs(ph - p) <= z * math.sqrt(p * (1 - p) / n)

    def edge(lo: float, hi: float) -> float:  # lo outside, hi inside (or the reverse)
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if inside(mid) != inside(hi) else (lo, mid)
        return (lo + hi) / 2

    return (0.0 if k == 0 else edge(0.0, ph)), (1.0 if k == n else edge(1.0, ph))


def naive_newcombe(first: np.ndarray, second: np.ndarray) -> tuple[float, float, float]:
    """Newcombe (1998, paired, method 10) written from the paper's formula with the Wilson
    limits by bisection and phi as the Pearson correlation of the two 0/1 vectors."""
    n = len(first)
    p1, p2 = first.mean(), second.mean()
    l1, u1 = wilson_by_bisection(int(first.sum()), n)
    l2, u2 = wilson_by_bisection(int(second.sum()), n)
    phi = 0.0 if first.std() == 0 or second.std() == 0 else float(
        np.corrcoef(first.astype(float), second.astype(float))[0, 1])
    d = p2 - p1
    delta = math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    eps = math.sqrt(max(0.0, (u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2))
    return d, max(-1.0, d - delta), min(1.0, d + eps)


def test_newcombe_interval_equals_a_naive_reference():
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        probs = rng.dirichlet(np.ones(4))
        kind = rng.choice(4, size=n, p=probs)
        first, second = np.isin(kind, [0, 1]), np.isin(kind, [0, 2])
        got = geval.paired_difference(first, second)
        assert got == pytest.approx(naive_newcombe(first, second), abs=1e-6)
    # the audited figure: 200 problems, 23 breaks and 11 fixes, effect -6.0 pt
    first = np.array([1] * 104 + [1] * 23 + [0] * 11 + [0] * 62, bool)
    second = np.array([1] * 104 + [0] * 23 + [1] * 11 + [0] * 62, bool)
    d, lo, hi = geval.paired_difference(first, second)
    assert d == pytest.approx(-0.06) and lo < d < hi < 0


def test_exact_mcnemar_p_equals_a_binomial_enumeration_and_scipy():
    def naive(b: int, c: int) -> float:  # two-sided: outcomes no more likely than the observed
        n = b + c
        pmf = [math.comb(n, i) / 2**n for i in range(n + 1)]
        return min(1.0, sum(p for p in pmf if p <= pmf[b] * (1 + 1e-12)))

    for b in range(0, 30):
        for c in range(0, 30):
            assert geval.mcnemar_exact(b, c) == pytest.approx(naive(b, c), rel=1e-12)
    assert geval.mcnemar_exact(23, 11) == pytest.approx(0.0576, abs=5e-5)  # issue 49's figure
    assert geval.mcnemar_exact(0, 0) == 1.0
    scipy_stats = pytest.importorskip("scipy.stats")
    for b, c in ((23, 11), (51, 6), (2, 2), (0, 7)):
        assert geval.mcnemar_exact(b, c) == pytest.approx(
            scipy_stats.binomtest(c, b + c, 0.5).pvalue, rel=1e-12)
    with pytest.raises(ValueError, match="breaks, fixes: expected counts >= 0"):
        geval.mcnemar_exact(-1, 2)


def test_every_evaluation_reports_newcombe_mcnemar_fixes_and_breaks(tiny, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setattr(train, "score", fake_score)
    run = tmp_path / "e"
    train.main(args(tiny, run, "--iterations", "2", "--eval-size", "4", "--eval-every", "1",
                    "--freeze-agent"))
    evals = json.loads((run / "eval.json").read_text())
    assert set(evals) == {"before", "after", "every"} and set(evals["every"]) == {"1", "2"}
    for e in [evals["before"], evals["after"], *evals["every"].values()]:
        h = e["hint_effect"]
        assert set(h) == {"turn2_minus_turn1", "ci95", "mcnemar_p", "n"} and h["n"] == 4
        assert h["mcnemar_p"] == geval.mcnemar_exact(e["breaks"], e["fixes"])
        assert e["agent_frozen"] is True and e["hint_reward"] == "improvement"
    for r in rows(run):
        e = evals["every"][str(r["iteration"])]
        assert r["eval_mcnemar_p"] == e["hint_effect"]["mcnemar_p"]
        assert [r["eval_hint_effect_ci95_lo"], r["eval_hint_effect_ci95_hi"]] == \
            e["hint_effect"]["ci95"]
        assert (r["eval_fixes"], r["eval_breaks"], r["eval_n"]) == (e["fixes"], e["breaks"], 4)
        assert r["eval_turn2_accuracy"] - r["eval_turn1_accuracy"] == pytest.approx(
            r["eval_hint_effect"])
