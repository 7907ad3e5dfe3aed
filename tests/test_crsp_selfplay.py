"""CRSP's learning signal per role (issue 36) on the tiny random Llama: the well-formed path end
to end with a scripted sampler (a proposal parsed, solved and critiqued, every reward part
non-trivial, group advantages summing to 0 per group), the importance ratio against the stored
behaviour log-probs on a reused batch (clipping changes the gradient), the seed-length filter,
the alpha schedule's cache hits and the per-role length targets."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers", "datasketch")

from rlbuffers.cache import ByteLRUCache  # noqa: E402
from rlbuffers.memory import AdaptiveMicroBatch, RunningMeanStd  # noqa: E402
from rlbuffers.stream.token_store import TokenStore, TokenStoreWriter  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.crsp import config as config_module  # noqa: E402
from trainers.crsp import roles, rollout, train, update  # noqa: E402
from trainers.crsp.config import Config, check_config, group_size  # noqa: E402
from trainers.crsp.rewards import NoveltySketch, alpha_schedule  # noqa: E402
from trainers.crsp.roles import ROLES  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_lm_dir(tmp_path_factory.mktemp("tiny"))


def config(tiny_dir, **kw):
    return Config(model=str(tiny_dir), lora_rank=4, max_prompt_tokens=40, proposer_tokens=64,
                  solver_tokens=16, critic_tokens=30, pack_tokens=112, chunk_tokens=7,
                  memory_budget="none", beta=0.1, proposer_length_target=30,
                  solver_length_target=6, critic_length_target=20, **kw)


#: What the scripted sampler writes, by the end of the prompt (proposer: after <problem>;
#: critic reason: after </verdict>; solver otherwise), cycling through the list per sample.
SCRIPT = {
    "proposer": ["Ann has 2 cats and 3 dogs. How many pets?</problem><answer>5</answer> extra",
                 "Bo has 4 and 4. How many?</problem><answer>8</answer>",
                 "What is 2 + 3?</problem><answer>5</answer>",  # the seed itself: no novelty
                 "no closing tag at all"],
    "solver": ["2 + 3 = 5 <answer>5</answer> and more", "<answer>4</answer>", "it is 8",
               "<answer>8</answer>"],
    "critic": [" Right.", " The sum is wrong, it should be something else entirely ok"],
}


def scripted_generate(tok):
    """A stand-in for ``trainers.llm.generation.generate``: completions from SCRIPT."""
    calls = {"n": 0}

    def generate(model, tok_, prompts, sampling, *, n_per_prompt, max_new, greedy=False):
        out = []
        for p in prompts:
            head = tok.decode(p[-12:])
            role = "proposer" if head.endswith("problem>") else \
                "critic" if head.endswith("verdict>") else "solver"
            for _ in range(n_per_prompt):
                text = SCRIPT[role][calls["n"] % len(SCRIPT[role])]
                calls["n"] += 1
                ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"], np.int64)
                out.append((ids[:max_new], len(ids) > max_new))
        return out

    return generate


def test_well_formed_path_end_to_end(tiny_dir, monkeypatch):
    # The rewards before issue 49 (--proposer-reward band, --critic-batch first): every
    # well-formed proposal attempted, scored against its own stated answer.
    cfg = config(tiny_dir, seeds_per_step=1, proposer_samples=4, solver_samples=4,
                 critiques_per_problem=2, critic_samples=4, proposer_reward="band",
                 critic_batch="first")
    model, tok, _ = roles.make_model(cfg)
    monkeypatch.setattr(rollout, "generate", scripted_generate(tok))
    prompts = roles.Prompts(tok, cfg.max_prompt_tokens, ByteLRUCache(1 << 20))
    seeds = [{"question": "What is 2 + 3?", "answer": "5"}]
    torch.manual_seed(0)
    alpha = alpha_schedule(cfg.alpha0, cfg.alpha_decay)
    batches, metrics = rollout.rollout(
        cfg, model, tok, prompts, seeds, lambda a, e: float(a == e["answer"]),
        NoveltySketch(8, 16), {r: RunningMeanStd() for r in ROLES}, alpha, step=0)
    # Three of four proposals are well formed; each is solved (4 attempts) and critiqued.
    assert metrics["proposals_valid"] == 0.75
    assert len(batches["solver"].prompts) == 1 + 3
    assert len(batches["critic"].prompts) == 2 * 4 and len(batches["critic"].completions) == 32
    text = [tok.decode(c) for c in batches["proposer"].completions]
    assert text[0].endswith("</answer>") and "extra" not in text[0]  # cut at the closing tag
    assert batches["solver"].completions[0].size < len(tok(SCRIPT["solver"][0])["input_ids"])
    for c in batches["critic"].completions:  # verdict first, then the reason
        assert tok.decode(c).split("</verdict>")[0] in ("correct", "incorrect")
    # Every reward part of every role takes more than one value (a signal), and the group
    # advantages sum to 0 in every group.
    for role in ROLES:
        b = batches[role]
        for name, values in b.parts.items():
            assert len(set(values)) > 1, (role, name, values)
        sums = b.advantage.reshape(-1, group_size(cfg, role)).sum(1)
        np.testing.assert_allclose(sums, 0.0, atol=1e-5)
        assert np.abs(b.advantage).max() > 0
    creativity = batches["proposer"].parts["creativity"]
    assert creativity[2] == 0.0 and creativity[3] == 0.0  # the seed copied; malformed
    assert creativity[0] > 0.5
    assert batches["proposer"].parts["format"] == [1.0, 1.0, 1.0, 0.0]
    assert 0 < metrics["critic_seed_majority"] <= 1
    # The critic's verdict reward is +-1 weighted by its attempt's class, from the class
    # frequency of the step's judged attempts (add-one smoothed; --critic-class-weights
    # step); the verdict distribution is in the metrics.
    rate = metrics["critic_class_rate"]
    judged = 32 // cfg.critic_samples
    correct = round(metrics["critic_truth_correct"] * judged)
    assert rate == pytest.approx((correct + 1) / (judged + 2))
    counts = [metrics[k] for k in ("critic_tp", "critic_fn", "critic_tn", "critic_fp")]
    assert sum(counts) == 32 and metrics["critic_tp"] + metrics["critic_fp"] == round(
        32 * metrics["critic_says_correct"])
    ba = metrics["critic_balanced_accuracy"]  # None when the step judged one class only
    assert ba is None or 0 <= ba <= 1
    assert set(np.round(np.abs(batches["critic"].parts["extrinsic"]), 5)) <= {
        round(0.5 / rate, 5), round(0.5 / (1 - rate), 5)}
    for role in ROLES:
        assert 0 <= metrics[f"{role}_flat_groups"] <= 1
    # The cached schedule: one value per step, read by every role and the metrics row.
    assert alpha.cache_info().misses == 1 and alpha.cache_info().hits == 3


def synthetic(vocab, seed=0):
    rng = np.random.default_rng(seed)
    b = rollout.RoleBatch()
    for _ in range(3):
        b.add(rng.integers(3, vocab, 10), [(rng.integers(3, vocab, 6), False) for _ in range(4)])
    b.advantage = rng.normal(size=12).astype(np.float32)
    return b


@pytest.mark.parametrize("eps", [1e-3])
def test_ratio_against_stored_behaviour_clips_on_a_reused_batch(tiny_dir, eps):
    """Two passes over one batch with an SGD step between: pass 1 is on-policy (ratio 1, the
    same gradient whatever epsilon); in pass 2 the ratio against the stored behaviour
    log-probs moves away from 1, a small epsilon clips tokens and the gradient changes."""
    grads = {}
    for name, e in (("wide", 10.0), ("narrow", eps)):
        cfg = config(tiny_dir, epsilon=e, num_iterations=2)
        model, tok, _ = roles.make_model(cfg)
        with torch.no_grad():
            for n, p in sorted(model.named_parameters()):
                if "lora_B" in n:
                    p.fill_(0.05)
        roles.activate(model, "solver")
        params = roles.role_parameters(model, "solver")
        opt = torch.optim.SGD(params, lr=5.0)
        seen = []

        def between(model=model, opt=opt, params=params, seen=seen):
            seen.append([p.grad.clone() for p in params])
            opt.step()
            opt.zero_grad(set_to_none=True)

        packing = cfg.packing(cfg.pack_tokens)
        batch = update.role_tensors(synthetic(len(tok)), packing, tok.pad_token_id)
        res = update.role_gradients(model, AdaptiveMicroBatch(model, max_micro_batch=1), batch,
                                    packing, cfg.policy_loss(), 12 * 6, 2, between)
        seen.append([p.grad.clone() for p in params])
        grads[name] = (seen, res)
    (wide, wres), (narrow, nres) = grads["wide"], grads["narrow"]
    for a, b in zip(wide[0], narrow[0], strict=True):  # pass 1: ratio 1, equal
        torch.testing.assert_close(a, b)
    assert wres["clip_fractions"][0] == nres["clip_fractions"][0] == 0.0
    assert wres["clip_fractions"][1] == 0.0 < nres["clip_fractions"][1]
    assert any(not torch.allclose(a, b) for a, b in zip(wide[1], narrow[1], strict=True))
    assert nres["behaviour"].shape == (72,) and len(nres["losses"]) == 2
    assert nres["losses"][1] != nres["losses"][0]  # the ratio moved away from 1


def test_seed_length_filter(tmp_path):
    """Seed prompts longer than --max-prompt-tokens never enter the order (they would not pack
    with a completion); too few usable ones is a clear error."""
    with TokenStoreWriter(tmp_path / "s", dtype="uint16") as w:
        w.extend([np.arange(n) for n in (5, 50, 7, 60, 3)])
    store = TokenStore(tmp_path / "s")
    usable = train.usable_seeds(store, 10, 2)
    assert usable == [0, 2, 4]
    drawn = list(itertools.islice(train.seed_stream(usable, 0, 0), 30))
    assert set(drawn) == {0, 2, 4}
    with pytest.raises(ValueError, match="--max-prompt-tokens: only 3 of 5 seed prompts fit "
                                         "in 10 tokens, need 4"):
        train.usable_seeds(store, 10, 4)


def test_length_targets_within_each_cap():
    with pytest.raises(ValueError, match=r"--critic-length-target: expected in \[1, "
                                         r"--critic-tokens=32\], got 64"):
        check_config(Config(critic_length_target=64))
    with pytest.raises(ValueError, match="--num-iterations: expected >= 1 \\(> 1 only with"):
        check_config(Config(num_iterations=2, memory_opt=False))
    with pytest.raises(ValueError, match="--train-dtype: expected 'float32', 'bfloat16'"):
        check_config(Config(train_dtype="int8"))
    check_config(Config())


def test_held_out_evaluation_of_a_run(tiny_dir, tmp_path, capsys, monkeypatch):
    """``python -m trainers.crsp.evaluate``: held-out problems share no content key with the
    training seeds nor with the run's proposals (read from its buffer), the solver and critic
    figures of the initial and the last checkpoint (the critic also on a class-balanced set),
    the proposer's windows from the metrics."""
    import json

    from tests.test_crsp import ARGS
    from trainers.crsp import evaluate
    from trainers.llm import evaluation

    run = tmp_path / "run"
    train.main([*ARGS, "--model", str(tiny_dir), "--steps", "2", "--run-dir", str(run)])
    cfg = Config(**{k: v for k, v in json.loads((run / "config.json").read_text()).items()
                    if k in Config.__dataclass_fields__})
    _, tok, _ = roles.make_model(cfg)
    # The proposals of the run are read from its buffer (2 seeds x 2 proposals x 2 steps);
    # a proposal that is well formed is kept out of the held-out set like a training seed.
    monkeypatch.setattr(evaluate, "proposal_parts", lambda text: ("What is 7 + 8?", "15"))
    written = evaluate.proposals(run, tok)
    assert written == [{"question": "What is 7 + 8?"}]  # 8 proposals, one distinct question
    problems, report = evaluate.evaluation_set(cfg, run, tok, 12, 5)
    assert report["overlap"] == 0 and report["proposals"] == 1 and len(problems) == 12
    # metrics.jsonl keeps every step's questions: what the buffer overwrote is still excluded
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [q for r in rows for q in r["proposed_questions"]]
    lost = tmp_path / "lost"
    lost.mkdir()
    (lost / "metrics.jsonl").write_text("\n".join(json.dumps(
        {"step": i, "proposed_questions": [f"What is {i} + 1?", "What is 7 + 8?"]})
        for i in (1, 2)))
    assert evaluate.proposals(lost, tok) == [{"question": q} for q in (
        "What is 1 + 1?", "What is 7 + 8?", "What is 2 + 1?")]
    assert all(isinstance(q, str) and q for q in logged)
    keys = evaluation.training_keys(written + [dict(p) for p in evaluation.task_problems(
        cfg.task, cfg.train_size, cfg.seed, cfg.task_config)])
    assert evaluation.overlap(problems, keys) == 0
    evaluate.main(["--run-dir", str(run), "--steps", "0,2", "--eval-size", "12",
                   "--window", "1", "--critic-attempts", "3", "--calibration-size", "5"])
    out = json.loads(capsys.readouterr().out)
    assert out == json.loads((run / "eval.json").read_text())
    assert out["overlap"] == 0 and out["held_out"]["size"] == 12
    assert [c["step"] for c in out["checkpoints"]] == [0, 2]
    pool = out["critic_attempts"]  # one pool of attempts, by the last checkpoint's solver
    assert pool["from_step"] == 2 and pool["correct"]["n"] == 36
    for c in out["checkpoints"]:
        assert c["solver_accuracy"]["n"] == 12
        # The reported critic figure: its own verdict (margin > 0), first in the checkpoint
        # (after the solver), None when the attempts hold one class only.
        assert list(c)[:4] == ["step", "solver_accuracy", "critic_balanced_accuracy_raw",
                               "critic_balanced_accuracy_raw_balanced_set"]
        raw = c["critic_balanced_accuracy_raw"]
        if raw is not None:
            assert raw["ci95"][0] <= raw["value"] <= raw["ci95"][1] and raw["n"] == 12
        first = c["critic_first_attempts"]
        assert first["accuracy"]["n"] == 12 and first["majority_rate"]["rate"] >= 0.5
        lo, hi = first["accuracy"]["wilson95"]
        assert 0 <= lo <= first["accuracy"]["rate"] <= hi <= 1
        bal = c["critic_balanced_set"]  # as many correct attempts as incorrect ones
        assert 2 * bal["attempts_correct"]["k"] == bal["attempts_correct"]["n"]
        assert bal["attempts_correct"]["n"] == pool["balanced_set"]
        if pool["balanced_set"]:  # the verdict margin's AUC on the balanced set
            assert 0 <= bal["auc"]["ci95"][0] <= bal["auc"]["auc"] <= bal["auc"]["ci95"][1] <= 1
        # The calibrated verdicts: the same attempts, a threshold fitted on 5 training seeds'
        # 15 attempts (never a held-out problem); the threshold-free AUC is unchanged.
        assert c["calibration"]["n"] == 15 and np.isfinite(c["calibration"]["tau"])
        cal = c["critic_balanced_set_calibrated"]
        assert cal["attempts_correct"] == bal["attempts_correct"]
        assert cal.get("auc") == bal.get("auc")
        assert c["critic_first_attempts_calibrated"]["accuracy"]["n"] == 12
    assert out["calibration_set"]["training_seeds"] == 5
    assert out["calibration_set"]["correct"]["n"] == 15
    assert out["proposer"]["first"]["steps"] == [1, 1] and out["proposer"]["last"]["n"] == 4
    assert out["proposer"]["verified_last"]["n"] == 4  # counted from the metrics rows
    for c in out["checkpoints"]:  # the proposer on held-out problems, one proposal each
        prop = c["proposer"]
        assert prop["n"] == 12 and prop["well_formed"]["n"] == 12
        assert prop["solvable"]["k"] <= prop["verified"]["k"] <= prop["well_formed"]["k"]
    assert out["proposer"]["solvable_last"]["k"] <= out["proposer"]["verified_last"]["k"]
    says, labels = np.array([True, False, False, False]), np.array([True, True, False, False])
    assert evaluate.balanced_accuracy(says, labels) == 0.75


def test_balanced_set_takes_each_problems_first_attempt_of_each_class():
    from trainers.crsp import evaluate

    labels = np.array([[False, True, True], [False, False, False], [True, False, False],
                       [True, True, True]])
    pick = evaluate.balanced_set(labels)
    # correct firsts: (0, 1), (2, 0), (3, 0); incorrect firsts: (0, 0), (1, 0), (2, 1)
    assert pick.tolist() == [[0, 1], [2, 0], [3, 0], [0, 0], [1, 0], [2, 1]]
    assert labels[pick[:, 0], pick[:, 1]].tolist() == [True] * 3 + [False] * 3
    assert evaluate.balanced_set(np.zeros((3, 2), bool)).shape == (0, 2)


def test_warmup_resumes_exactly_mid_epoch(tiny_dir, tmp_path):
    """The format warm-up reads its examples through rlbuffers.stream (aligned token stores,
    a resumable IndexSource, shared-prefix packing): 2 + 2 steps with the stream state
    round-tripped through JSON and a rebuilt optimizer equal 4 uninterrupted steps (the
    epoch is 6 examples, so the break falls mid-epoch), and the loss falls."""
    import copy
    import json

    from trainers.crsp import warmup
    from trainers.llm.tasks import task_problems

    cfg = config(tiny_dir)
    problems = task_problems("basic_arithmetic", 8, 0)
    model, tok, _ = roles.make_model(cfg)
    prompts = roles.Prompts(tok, cfg.max_prompt_tokens, ByteLRUCache(1 << 20))
    examples = warmup.proposer_examples(problems, 6)
    assert examples[0][1].endswith(f"</problem><answer>{problems[1]['answer']}</answer>")
    warmup.write_examples(tmp_path / "proposer", "proposer", examples, prompts, tok)
    critic = warmup.critic_examples(problems, [f"<answer>{problems[0]['answer']}</answer>",
                                               "<answer>x</answer>"],
                                    lambda a, e: float(a == str(e["answer"])))
    assert [t.split("</verdict>")[0] for _, t in critic] == ["correct", "incorrect"]
    packing = cfg.packing(cfg.pack_tokens)

    def run(model, opt, steps, state):
        return warmup.sft_steps(model, "proposer", opt, tmp_path / "proposer", packing,
                                tok.pad_token_id, 2, steps, seed=3, state=state)

    def adapters(m):
        return {n: p.detach().clone() for n, p in m.named_parameters() if ".proposer." in n}

    whole_model, _, _ = roles.make_model(cfg)
    opt = torch.optim.AdamW(roles.role_parameters(whole_model, "proposer"), lr=1e-2)
    whole_state, losses = run(whole_model, opt, 4, None)
    assert whole_state == {"kind": "index", "pass": 1, "position": 2}  # 8 examples read of 6
    opt = torch.optim.AdamW(roles.role_parameters(model, "proposer"), lr=1e-2)
    state, first = run(model, opt, 2, None)
    assert state["position"] == 4  # mid-epoch
    saved = copy.deepcopy(opt.state_dict())
    opt = torch.optim.AdamW(roles.role_parameters(model, "proposer"), lr=1e-2)
    opt.load_state_dict(saved)
    state, second = run(model, opt, 2, json.loads(json.dumps(state)))
    assert state == whole_state and first + second == pytest.approx(losses, rel=1e-5)
    got, want = adapters(model), adapters(whole_model)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)
    assert losses[-1] < losses[0]


def test_a_new_run_warms_up_the_proposer_and_the_critic_first(tiny_dir, tmp_path):
    from tests.test_crsp import ARGS, rows

    run = tmp_path / "run"
    train.main([*ARGS, "--model", str(tiny_dir), "--steps", "1", "--run-dir", str(run),
                "--warmup-steps", "3", "--warmup-batch", "2"])
    (row,) = rows(run)
    for role in ("proposer", "critic"):
        assert row[f"warmup_{role}_loss_last"] < row[f"warmup_{role}_loss_first"]
        assert len(TokenStore(run / "warmup" / role / "targets")) == 6
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tiny_dir).eos_token_id
    assert int(TokenStore(run / "warmup" / "critic" / "targets")[0][-1]) == eos  # it stops
    # The adapters right after the warm-up, before step 1: the proposer's and the critic's
    # trained (lora_B left its zero init), the solver's untouched; step 1 moved them on.
    import json

    from safetensors.torch import load_file

    from trainers.config import ConfigError
    from trainers.crsp import evaluate

    warm = load_file(run / "warmup" / "adapters.safetensors")
    step1 = load_file(run / "ckpt" / "step-1" / "adapters.safetensors")
    assert warm.keys() == step1.keys()
    for role, trained in (("proposer", True), ("critic", True), ("solver", False)):
        b = [v for k, v in warm.items() if "lora_B" in k and f".{role}." in k]
        assert b and any(bool(v.abs().sum() > 0) for v in b) == trained, role
    assert any(not torch.equal(warm[k], step1[k]) for k in warm)
    # the evaluation reads it as the checkpoint "warmup", between 0 and step 1
    evaluate.main(["--run-dir", str(run), "--steps", "0,warmup,1", "--eval-size", "6",
                   "--critic-attempts", "2", "--calibration-size", "0",
                   "--proposer-eval-size", "0", "--out", str(tmp_path / "eval.json")])
    out = json.loads((tmp_path / "eval.json").read_text())
    assert [c["step"] for c in out["checkpoints"]] == [0, "warmup", 1]
    with pytest.raises(ConfigError, match="--steps: expected comma-separated step numbers"):
        evaluate.main(["--run-dir", str(run), "--steps", "0,warm"])
    (run / "warmup" / "adapters.safetensors").unlink()  # a run without a warm-up
    with pytest.raises(ConfigError, match="--steps: expected steps whose checkpoint the run "
                                          "keeps .* got warmup"):
        evaluate.main(["--run-dir", str(run), "--steps", "warmup,1"])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 3), st.booleans()), min_size=2, max_size=40)
       .filter(lambda r: 0 < sum(y for _, y in r) < len(r)))
def test_auc_is_the_pairwise_ranking_probability(rows):
    """The critic's AUC against a naive loop over every (correct, incorrect) pair, ties half;
    its Hanley-McNeil interval holds it."""
    from trainers.crsp import evaluate

    scores = np.array([float(s) for s, _ in rows])
    labels = np.array([y for _, y in rows])
    pairs = [(a, b) for a, b in itertools.product(scores[labels], scores[~labels])]
    want = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) / len(pairs)
    got = evaluate.auc(scores, labels)
    assert got["auc"] == pytest.approx(want)
    assert got["n_correct"] + got["n_incorrect"] == len(rows)
    assert got["ci95"][0] <= got["auc"] <= got["ci95"][1]
    assert evaluate.auc(-scores, labels)["auc"] == pytest.approx(1 - want)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-4, 4), st.booleans()), min_size=1, max_size=40))
def test_youden_threshold_is_the_best_cut_of_a_brute_force_search(rows):
    """The calibrated threshold against a naive search over every candidate threshold (each
    margin, and below the smallest): its balanced accuracy is the best any threshold reaches,
    and ``margin > tau`` reproduces it."""
    from trainers.crsp import evaluate

    margin = np.array([float(m) for m, _ in rows])
    labels = np.array([y for _, y in rows])
    got = evaluate.youden_threshold(margin, labels)
    if labels.all() or not labels.any():
        assert got == {"tau": 0.0, "balanced_accuracy": None, "n": len(rows)}
        return
    candidates = [margin.min() - 1.0, *margin]
    best = max(naive_balanced_accuracy(margin > t, labels) for t in candidates)
    assert got["balanced_accuracy"] == pytest.approx(best)
    assert naive_balanced_accuracy(margin > got["tau"], labels) == pytest.approx(best)


def naive_balanced_accuracy(says, labels):
    pairs = list(zip(says, labels, strict=True))
    tpr = sum(s and y for s, y in pairs) / sum(y for _, y in pairs)
    tnr = sum(not s and not y for s, y in pairs) / sum(not y for _, y in pairs)
    return (tpr + tnr) / 2


def test_youden_threshold_refuses_mismatched_shapes():
    from trainers.crsp import evaluate

    with pytest.raises(ValueError, match=r"margin / labels: expected float\[n\] and bool\[n\]"):
        evaluate.youden_threshold(np.zeros(3), np.zeros(2, bool))


# The proposer's reference after the format warm-up (--proposer-reference warmup, default):
# its adapter as the warm-up left it, swapped in for the reference pass and out bit for bit.

def lora(model, role):
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if f".{role}." in n and "lora_" in n}


def test_swapped_adapters_hold_the_reference_inside_and_come_back_bit_for_bit(tiny_dir):
    cfg = Config(model=str(tiny_dir), lora_rank=4, memory_budget="none")
    model, _, _ = roles.make_model(cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    reference = {n: torch.randn(v.shape, generator=gen) for n, v in lora(model, "proposer").items()}
    assert reference
    with update.adapters_swapped(model, reference):
        now = dict(model.named_parameters())
        for n, v in reference.items():
            assert torch.equal(now[n].detach(), v)
        for n in before.keys() - reference.keys():  # the other roles and the base untouched
            assert torch.equal(now[n].detach(), before[n])
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    with pytest.raises(RuntimeError, match="inside"), update.adapters_swapped(model, reference):
        raise RuntimeError("inside")
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    with update.adapters_swapped(model, None), update.adapters_swapped(model, {}):
        pass
    with pytest.raises(KeyError, match="no parameter 'nope'"), update.adapters_swapped(
            model, {"nope": torch.zeros(1)}):
        pass


def test_the_proposer_kl_is_taken_against_its_warmed_up_adapter(tiny_dir, tmp_path):
    from tests.test_crsp import ARGS, rows

    base = [*ARGS, "--model", str(tiny_dir), "--warmup-steps", "3", "--warmup-batch", "2",
            "--beta", "0.04"]
    train.main([*base, "--run-dir", str(tmp_path / "w"), "--steps", "2"])
    train.main([*base, "--run-dir", str(tmp_path / "b"), "--steps", "2",
                "--proposer-reference", "base"])
    warm, old = rows(tmp_path / "w"), rows(tmp_path / "b")
    # Step 1: the proposer is exactly its warmed-up adapter (nothing stepped since), so its
    # KL to the warm-up is 0 (up to the two passes' batching), while the base is far away.
    assert abs(warm[0]["proposer_kl"]) < 1e-5
    assert old[0]["proposer_kl"] > 1e-3
    # The solver and the critic keep the base reference: the same KL either way at step 1.
    for role in ("solver", "critic"):
        assert warm[0][f"{role}_kl"] == old[0][f"{role}_kl"]
    # A resumed run reads the same reference back from DIR/warmup/adapters.safetensors.
    train.main([*base, "--run-dir", str(tmp_path / "r"), "--steps", "1"])
    train.main(["--run-dir", str(tmp_path / "r"), "--resume", "--steps", "2"])
    keys = ["proposer_kl", "proposer_loss", "solver_kl", "critic_kl"]
    assert [[r[k] for k in keys] for r in rows(tmp_path / "r")] == \
        [[r[k] for k in keys] for r in warm]


def test_the_setting_is_checked_and_older_runs_keep_the_base():
    check_config(Config(proposer_reference="warmup", memory_opt=False))  # no warm-up: base
    check_config(Config(proposer_reference="base", memory_opt=False, warmup_steps=2))
    with pytest.raises(ValueError, match="--proposer-reference: expected one of warmup, base "
                                         r"\('warmup' with --warmup-steps needs the "
                                         "memory-optimised update"):
        check_config(Config(proposer_reference="warmup", memory_opt=False, warmup_steps=2))
    with pytest.raises(ValueError, match="--proposer-reference: expected one of warmup, base"):
        check_config(Config(proposer_reference="sft"))
    cfg = Config()
    assert "--proposer-reference base" in config_module.legacy_settings(cfg, {"steps": 3})
    assert cfg.proposer_reference == "base"
