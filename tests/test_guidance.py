"""Guidance trainer (trainers/guidance/) on a tiny random Llama and a tiny random BERT critic:
shared and --naive-init layouts give the same losses, a run killed between checkpoint and commit
(and one stopped and resumed) equals the uninterrupted run, the critic's TD loss and the
token-level actor loss equal naive references (values and gradients), every utterance is in the
buffer and `rlbuffers inspect` reads it."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers")

from rlbuffers import ReplayBuffer  # noqa: E402
from rlbuffers.memory import AdaptiveMicroBatch  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.config import parse_config  # noqa: E402
from trainers.guidance import critic as gcritic  # noqa: E402
from trainers.guidance import policy as gpolicy  # noqa: E402
from trainers.guidance import rollout as grollout  # noqa: E402
from trainers.guidance import train  # noqa: E402
from trainers.guidance.config import Config  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

def make_tiny_bert(d: Path) -> Path:
    """A 2-layer BERT encoder (hidden 32) with a character WordPiece vocabulary."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    d.mkdir(parents=True, exist_ok=True)
    chars = [chr(c) for c in range(33, 127) if not chr(c).isupper()]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars)]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(d / "vocab.txt")).save_pretrained(d)
    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, vocab_size=len(vocab),
                         max_position_embeddings=128)).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return make_tiny_lm_dir(d / "lm"), make_tiny_bert(d / "bert")


def fake_score(problems, index, text, partial_credit=False):
    """Deterministic rewards that vary (the tiny model never answers right)."""
    return float(sum(map(ord, text)) % 3 == 0)


def args(tiny, run_dir, *extra):
    lm, bert = tiny
    return ["--model", str(lm), "--critic-model", str(bert), "--run-dir", str(run_dir),
            "--task", "basic_arithmetic", "--train-size", "40", "--episodes-per-iteration", "3",
            "--episodes-per-job", "2", "--max-answer-tokens", "8", "--max-hint-tokens", "6",
            "--memory-budget", "none", "--train-threads", "1", "--lora-rank", "4",
            "--critic-batch", "4", "--critic-hidden", "16", "--critic-max-tokens", "64",
            "--actor-lr", "1e-2", "--guidance-lr", "1e-2", "--critic-lr", "1e-3",
            "--eval-size", "0", "--device", "cpu", *extra]


def rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


KEYS = ["iteration", "reward_mean", "turn1_accuracy", "turn2_accuracy", "hint_uptake",
        "critic_loss", "td_target_mean", "q_mean", "q_agent_mean", "v_guidance_mean",
        "advantage_agent_mean", "actor_loss", "guidance_loss", "kl_agent", "kl_guidance",
        "grad_norm_agent", "grad_norm_guidance", "value_loss", "answer_tokens_mean",
        "hint_tokens_mean"]


def same(got, want, n):
    assert len(got) == len(want[:n]) == n
    for g, w in zip(got, want, strict=False):
        for k in KEYS:
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), (g["iteration"], k)


@pytest.fixture(scope="module")
def reference_run(tiny, tmp_path_factory):
    """An uninterrupted 3-iteration run (shared layout)."""
    run = tmp_path_factory.mktemp("runs") / "a"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "score", fake_score)
        torch.set_num_threads(1)
        train.main(args(tiny, run, "--iterations", "3"))
    return run


# ----- end to end ----------------------------------------------------------------------------

def test_naive_layout_gives_the_same_losses(tiny, reference_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train, "score", fake_score)
    train.main(args(tiny, tmp_path / "naive", "--iterations", "2", "--naive-init"))
    out = capsys.readouterr().err  # the placement plan, logged at INFO
    assert "guidance_copy" in out and "reference_copy" in out and "target_critic" in out
    want = rows(reference_run)
    same(rows(tmp_path / "naive"), want, 2)
    assert all(w["grad_norm_agent"] > 0 for w in want)
    # the guidance model trains only on wrong turn-1 answers' hints (issue 34): a step wherever
    # a group of them has a signal, none in an iteration whose turn-1 answers were all right
    assert all(w["grad_norm_guidance"] > 0 for w in want if w["guidance_signal_groups"])
    assert all(w["grad_norm_guidance"] == 0 for w in want if not w["guidance_groups"])
    assert sum(w["grad_norm_guidance"] > 0 for w in want) >= 2
    assert len({w["actor_loss"] for w in want}) == 3  # the adapters really change
    assert any(w["kl_agent"] > 0 for w in want)


def test_killed_between_checkpoint_and_commit_resumes_exactly(tiny, reference_run, tmp_path,
                                                              monkeypatch):
    monkeypatch.setattr(train, "score", fake_score)
    real_save = ReplayBuffer.save

    def crash_at_3(self, *a, **kw):  # iteration 3's checkpoint is written, not committed
        if kw.get("metadata", {}).get("trainer_iteration") == 3:
            raise KeyboardInterrupt
        return real_save(self, *a, **kw)

    monkeypatch.setattr(ReplayBuffer, "save", crash_at_3)
    with pytest.raises(SystemExit, match="iteration 2 is the last complete one"):
        train.main(args(tiny, tmp_path / "b", "--iterations", "3"))
    monkeypatch.setattr(ReplayBuffer, "save", real_save)
    assert (tmp_path / "b" / "ckpt" / "iteration-3").is_dir()
    train.main(["--run-dir", str(tmp_path / "b"), "--resume"])
    same(rows(tmp_path / "b"), rows(reference_run), 3)
    assert not (tmp_path / "b" / "ckpt" / "iteration-1").exists()  # keep 2


def test_stopped_run_resumes_exactly_with_two_workers(tiny, reference_run, tmp_path,
                                                      monkeypatch):
    """Stop after 2 iterations, resume to 3 on 2 in-process worker slots (the jobs are seeded
    one by one, so the episodes do not depend on the workers)."""
    monkeypatch.setattr(train, "score", fake_score)
    train.main(args(tiny, tmp_path / "c", "--iterations", "2"))
    train.main(["--run-dir", str(tmp_path / "c"), "--resume", "--iterations", "3",
                   "--workers", "2", "--rollout-backend", "inprocess"])
    same(rows(tmp_path / "c"), rows(reference_run), 3)


def test_gradient_checkpointing_all_gives_the_same_iteration(tiny, reference_run, tmp_path,
                                                           monkeypatch):
    monkeypatch.setattr(train, "score", fake_score)
    train.main(args(tiny, tmp_path / "gc", "--iterations", "1", "--gradient-checkpointing", "all"))
    got = rows(tmp_path / "gc")
    assert got[0]["checkpointed_layers_policy"] == [0, 1]
    assert rows(reference_run)[0]["checkpointed_layers_policy"] == []
    same(got, rows(reference_run), 1)


def test_buffer_holds_every_utterance_and_inspect_reads_it(reference_run):
    buf = ReplayBuffer.open(reference_run / "buffer", mode="r")
    # per problem (3 an iteration): turn 1, then K = 4 (hint, revision) pairs (issue 34)
    assert len(buf) == 3 * 3 * 9 and buf.metadata["trainer_iteration"] == 3
    b = buf[np.arange(len(buf))]
    buf.close()
    np.testing.assert_array_equal(b["turn"], np.tile([0, 1, 2, 1, 2, 1, 2, 1, 2], 9))
    np.testing.assert_array_equal(b["hint"], np.tile([-1, 0, 0, 1, 1, 2, 2, 3, 3], 9))
    np.testing.assert_array_equal(b["episode"], np.repeat(np.arange(9), 9))
    np.testing.assert_array_equal(b["iteration"], np.repeat([1, 2, 3], 27))
    np.testing.assert_array_equal(b["done"], b["turn"] == 2)
    assert (b["reward"][b["turn"] == 1] == 0).all()
    # turn 1 is rewarded directly with its correctness (issue 34), turn 2 with its improvement
    # over turn 1 (issue 49's default --hint-reward improvement)
    t0, t2 = b["turn"] == 0, b["turn"] == 2
    np.testing.assert_array_equal(b["reward"][t0], b["correctness"][t0])
    np.testing.assert_array_equal(b["reward"][t2], b["correctness"][t2]
                                  - np.repeat(b["correctness"][t0], 4))
    assert len(set(b["reward"][t2].tolist())) > 1  # rewards that vary
    for i in range(len(b["turn"])):  # next observation = the next utterance's observation
        assert len(b["action_ids"][i]) > 0
        if b["turn"][i] < 2:
            np.testing.assert_array_equal(b["next_observation_ids"][i],
                                          b["observation_ids"][i + 1])
        else:
            assert len(b["next_observation_ids"][i]) == 0
    for i in np.flatnonzero(b["turn"] == 1):  # the K hints of an answer read one prompt
        first = i - 1 - 2 * b["hint"][i]  # its turn 1
        assert b["turn"][first] == 0 and b["episode"][first] == b["episode"][i]
        np.testing.assert_array_equal(b["observation_ids"][i], b["next_observation_ids"][first])
    r = rows(reference_run)
    assert [x["buffer_utterances"] for x in r] == [27, 54, 81]
    assert (reference_run / "curve.png").stat().st_size > 0
    out = subprocess.run([sys.executable, "-m", "rlbuffers.cli", "inspect",
                          str(reference_run / "buffer"), "--json"], capture_output=True,
                         text=True, check=True).stdout
    info = json.loads(out)
    assert info["size"] == 81 and info["episodes"] == 36, info  # K = 4 episodes per problem


# ----- losses against naive references -------------------------------------------------------

def cfg_for(tiny, **kw):
    lm, bert = tiny
    return Config(model=str(lm), critic_model=str(bert), lora_rank=4, critic_hidden=16,
                           critic_max_tokens=64, chunk_tokens=3, max_grad_norm=0.0, **kw)


def test_td_and_value_losses_equal_a_naive_per_item_critic(tiny):
    cfg = cfg_for(tiny, gamma=0.9)
    critic, target, ctok = gcritic.make_critic(cfg)
    with torch.no_grad():  # a target that differs from the critic
        for p in target.parameters():
            p.add_(0.05 * torch.randn_like(p))
    texts = ["what is 2 + 3?", "2 + 3 = 5 so <answer>5</answer>", "add them", "", "7 - 1",
             "it is 6"]
    obs, act, nxt = texts[:4], texts[2:], texts[1:5]
    reward = np.array([0.0, 1.0, 0.0, 0.5], np.float32)
    done = np.array([False, True, False, True])
    enc = lambda xs: dict(ctok(xs, padding=True, return_tensors="pt"))  # noqa: E731
    b = {"obs": enc(obs), "act": enc(act), "next_obs": enc(nxt), "reward": reward, "done": done}
    loss, _ = gcritic.td_loss(critic, target, b, cfg.gamma)
    critic.zero_grad()
    loss.backward()
    got = {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None}

    def one(model, text):  # the CLS..SEP tokens of one text, mean-pooled
        ids = ctok(text, return_tensors="pt")
        return model.encoder(**ids).last_hidden_state.mean(1)

    critic.zero_grad()
    terms1, terms2 = [], []
    for i in range(4):
        s, a = one(critic, obs[i]), one(critic, act[i])
        x = torch.cat([s, a], -1)
        with torch.no_grad():
            s2 = one(target, nxt[i])
            y1 = reward[i] + 0.9 * (1 - float(done[i])) * target.v1(s2)
            y2 = reward[i] + 0.9 * (1 - float(done[i])) * target.v2(s2)
        terms1.append((critic.q1(x) - y1) ** 2)
        terms2.append((critic.q2(x) - y2) ** 2)
    naive = torch.stack(terms1).mean() + torch.stack(terms2).mean()
    naive.backward()
    assert float(loss.detach()) == pytest.approx(float(naive.detach()), rel=1e-5)
    for n, p in critic.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)

    v = gcritic.value_loss(critic, target, b)
    with torch.no_grad():
        want = 0.0
        for i in range(4):
            s, a, ts, ta = one(critic, obs[i]), one(critic, act[i]), one(target, obs[i]), \
                one(target, act[i])
            tq = torch.cat([ts, ta], -1)
            want += float((critic.v1(s) - target.q1(tq)) ** 2 + (critic.v2(s) - target.q2(tq)) ** 2)
    assert float(v.detach()) == pytest.approx(want / 4, rel=1e-5)


def test_actor_loss_and_gradients_equal_a_naive_full_logits_loss(tiny):
    cfg = cfg_for(tiny, beta=0.1)
    policies, tok, _ = grollout.make_policies(cfg, naive=False)
    g = np.random.default_rng(0)
    with torch.no_grad():  # adapters away from their zero init: policy != reference
        for role in ("agent", "guidance"):
            for p in policies.adapter_params(role):
                p.add_(0.1 * torch.randn_like(p))
    vocab = len(tok)
    obs = [g.integers(3, vocab, n) for n in (5, 9, 3, 7)]
    acts = [g.integers(3, vocab, n) for n in (4, 1, 6, 3)]
    adv = g.normal(size=4).astype(np.float32)
    batch = gpolicy.utterance_batch(obs, acts, tok.pad_token_id, adv)
    gpolicy.utterance_reference_logprobs(policies, batch, 3, chunk_tokens=cfg.chunk_tokens,
                                         temperature=cfg.temperature)

    def naive_logprobs(model):
        out = []
        for o, a in zip(obs, acts, strict=True):
            ids = torch.from_numpy(np.concatenate([o, a]))[None]
            logits = model(input_ids=ids).logits[0, len(o) - 1:-1]
            out.append(torch.log_softmax(logits.float(), -1).gather(
                1, torch.from_numpy(a)[:, None]).squeeze(1))
        return out

    with torch.no_grad(), policies.models["agent"].disable_adapter():
        ref = naive_logprobs(policies.models["agent"])
    torch.testing.assert_close(batch["ref"][batch["target"]], torch.cat(ref), rtol=1e-5,
                               atol=1e-6)
    model = policies.use("agent")
    model.zero_grad()
    terms = []
    for lp, r, a in zip(naive_logprobs(model), ref, adv, strict=True):
        d = r - lp
        terms.append((-a * lp + 0.1 * (torch.exp(d) - d - 1)).mean())
    naive = torch.stack(terms).mean()
    naive.backward()
    params = policies.adapter_params("agent")
    want = [p.grad.clone() for p in params]

    opt = torch.optim.SGD(params, lr=0.0)  # the step is a no-op: gradients kept
    opt.zero_grad = lambda set_to_none=True: None
    amb = AdaptiveMicroBatch(model, max_micro_batch=3)  # micro-batches of 3 and 1 rows
    out = gpolicy.policy_step(policies, "agent", opt, amb, batch, cfg)
    assert out["loss"] == pytest.approx(float(naive.detach()), rel=1e-5)
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-7)
    assert all(p.grad is None for p in policies.adapter_params("guidance"))


@pytest.mark.parametrize("flag, value, match", [
    ("--lora-rank", "0", "--lora-rank: expected >= 1, got 0"),
    ("--gamma", "2", "--gamma: expected in \\[0, 1\\]"),
    ("--rollout-backend", "mpi", "--rollout-backend: expected '', 'inprocess' or 'ray'"),
    ("--epsilon", "0.3", "--epsilon: expected 0.2 \\(no ratio clipping in guidance's loss\\)"),
    ("--lr", "0.1", "--lr: expected 0.0001 \\(guidance uses --actor-lr, --guidance-lr"),
    ("--device", "tpu", "--device: expected 'auto', 'cpu', 'cuda' or 'cuda:N'"),
])
def test_bad_settings_are_named(tmp_path, flag, value, match):
    with pytest.raises(ValueError, match=match):
        train.main(["--run-dir", str(tmp_path / "x"), flag, value])


def test_value_step_samples_fresh_actions_from_the_current_policy(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "score", fake_score)
    cfg = parse_config(Config, args(tiny, tmp_path / "v", "--iterations", "1"),
                       prog="guidance", description="", resumable=set())
    run = train.build(cfg)
    try:
        run.trainer["iteration"] = train.iterate(run)["iteration"]
        calls = []

        def fake_generate(model, tok, prompts, cfg, *, n_per_prompt, max_new):
            role = model.active_adapter
            calls.append((role, max_new, [p.tolist() for p in prompts]))
            return [(np.array([ord("a") if role == "agent" else ord("b")] * 3), False)
                    for _ in prompts]

        monkeypatch.setattr(gcritic, "generate", fake_generate)
        rng = torch.get_rng_state()
        state = run.buf.rng.bit_generator.state  # a fresh dict: restoring redraws the same
        b = gcritic.value_batch(run.buf, run.policies, run.tok, run.ctok, cfg, 2)
        assert torch.equal(torch.get_rng_state(), rng)  # the learner's RNG is untouched
        run.buf.rng.bit_generator.state = state
        s = run.buf.sample(cfg.critic_batch)  # the same draw as value_batch's
        turns = s["turn"].tolist()
        assert {c[0] for c in calls} == {"agent", "guidance"} & {
            "agent" if t != 1 else "guidance" for t in turns}
        for role, max_new, prompts in calls:
            want = [s["observation_ids"][i].tolist() for i, t in enumerate(turns)
                    if (t == 1) == (role == "guidance")]
            assert prompts == want
            assert max_new == (cfg.max_hint_tokens if role == "guidance" else
                               cfg.max_answer_tokens)
        acts = [np.array([ord("b" if t == 1 else "a")] * 3) for t in turns]
        want_act = gcritic.critic_inputs(run.ctok, run.tok, acts, cfg.critic_max_tokens,
                                         keep_end=False)
        torch.testing.assert_close(b["act"]["input_ids"], want_act["input_ids"])
        cfg2 = dataclasses.replace(cfg, value_action="buffer")
        run.buf.rng.bit_generator.state = state
        b2 = gcritic.value_batch(run.buf, run.policies, run.tok, run.ctok, cfg2, 2)
        stored = gcritic.critic_inputs(run.ctok, run.tok, s["action_ids"], cfg.critic_max_tokens,
                                       keep_end=False)
        torch.testing.assert_close(b2["act"]["input_ids"], stored["input_ids"])
    finally:
        run.close()


def test_held_out_evaluation_before_and_after(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train, "score", fake_score)
    train.main(args(tiny, tmp_path / "e", "--iterations", "1", "--eval-size", "4"))
    evals = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert set(evals) == {"before", "after"}
    for e in evals.values():
        assert e["turn1"]["n"] == e["turn2"]["n"] == 4
        for turn in ("turn1", "turn2"):
            lo, hi = e[turn]["ci95"]
            assert lo <= e[turn]["accuracy"] <= hi and e[turn]["accuracy"] in (0, .25, .5, .75, 1)
        assert 0 <= e["hint_uptake"] <= 1 and 0 <= e["turn2_breaks"] <= 1
    out = capsys.readouterr().err  # logged at INFO
    assert "held-out before" in out and "held-out after" in out


# ----- logging, device and placement -----------------------------------------------------------

@pytest.fixture(autouse=True)
def _drop_log_handlers():
    """``main`` points the root logger at the stderr of its test (``set_log_level``): drop that
    handler afterwards, so a later test's records never go to a closed capture stream."""
    yield
    root = logging.getLogger()
    for h in [h for h in root.handlers if type(h) is logging.StreamHandler]:
        root.removeHandler(h)


def test_a_default_run_logs_its_memory_plan_and_per_phase_peaks(tiny, tmp_path, monkeypatch,
                                                                capsys):
    monkeypatch.setattr(train, "score", fake_score)
    train.main(args(tiny, tmp_path / "log", "--iterations", "1", "--memory-budget",
                    str(2**30)))
    err = capsys.readouterr().err
    for line in ("memory capacity: RAM", "placement plan", "policy", "target_critic",
                 "cpu: ", "shared layout", "memory budget of a policy step: 1,024 MiB",
                 "micro-batch plan agent:", "micro-batch plan guidance:",
                 "gradient checkpointing of policy: off"):
        assert line in err, line
    phase_line = next(x for x in err.splitlines() if "iteration 1: " in x)
    for name in ("generate", "buffer", "reference", "critic", "actor", "guidance", "value",
                 "target"):
        assert f"{name} " in phase_line and "MiB" in phase_line, name
    row = rows(tmp_path / "log")[0]
    assert row["memory_budget_bytes"] == 2**30
    assert row["placement"] == {"policy": "cpu", "critic": "cpu", "target_critic": "cpu"}
    assert row["placement_budgets"]["cpu"] > 0
    # items: 3 turn-1 answers + 3 * K = 4 revisions; 3 * 4 hints (issue 34's K hints)
    assert 1 <= row["micro_batch_planned_agent"] <= 15
    assert 1 <= row["micro_batch_planned_guidance"] <= 12
    assert row["peak_rss_bytes"] == max(v for k, v in row.items()
                                        if k.startswith("peak_rss_") and k != "peak_rss_bytes")
    assert (tmp_path / "log" / "ckpt" / "iteration-1").is_dir()
    train.main(args(tiny, tmp_path / "quiet", "--iterations", "1", "--quiet"))
    err = capsys.readouterr().err
    assert "placement plan" not in err and "iteration 1: " not in err


def layout_modules(tiny, naive):
    cfg = cfg_for(tiny)
    policies, _, _ = grollout.make_policies(cfg, naive=naive)
    critic, target, _ = gcritic.make_critic(cfg)
    return policies, critic, target


@pytest.mark.parametrize("naive", [False, True])
def test_trained_models_go_to_the_accelerator_and_the_target_critic_where_there_is_room(
        tiny, naive):
    """The roles the trainer passes, and with made-up budgets (a 'cuda:0' that holds the
    trained models and little more) where each model goes."""
    from rlbuffers.memory.errors import MemoryBudgetError
    from rlbuffers.memory.placement import ModelSpec, plan_placement
    from trainers.guidance.placement import check_trained_on, placed_models

    policies, critic, target = layout_modules(tiny, naive)
    modules, roles = placed_models(policies, critic, target)
    want = {"policy": "trained", "critic": "trained", "target_critic": "periodic"}
    if naive:
        want |= {"guidance_copy": "trained", "reference_copy": "frozen"}
    assert roles == want
    assert modules["target_critic"] is target and modules["critic"] is critic
    specs = {n: ModelSpec.from_module(m, roles[n]) for n, m in modules.items()}
    trained = sum(s.bytes for s in specs.values() if s.role == "trained")
    frozen = sum(s.bytes for s in specs.values() if s.role == "frozen")
    short = trained + frozen + specs["target_critic"].bytes // 2  # no room for the target
    plan = plan_placement(specs, {"cuda:0": short, "cpu": 2**40})
    assert plan.device["target_critic"] == "cpu"
    assert all(plan.device[n] == "cuda:0" for n, r in roles.items() if r != "periodic")
    check_trained_on(plan, roles, torch.device("cuda", 0))
    plan = plan_placement(specs, {"cuda:0": 2**40, "cpu": 2**40})  # room for all
    assert set(plan.device.values()) == {"cuda:0"}
    plan = plan_placement(specs, {"cuda:0": specs["critic"].bytes, "cpu": 2**40})
    assert plan.device["policy"] == "cpu" and plan.device["critic"] == "cuda:0"
    with pytest.raises(MemoryBudgetError, match="'policy': 'cpu'"):
        check_trained_on(plan, roles, torch.device("cuda", 0))


def test_place_on_the_cpu_device_and_a_budget_too_small(tiny):
    from rlbuffers.memory.errors import MemoryBudgetError
    from trainers.guidance.placement import place

    policies, critic, target = layout_modules(tiny, True)
    plan = place(policies, critic, target, torch.device("cpu"), 2**40)
    assert set(plan.device.values()) == {"cpu"} and set(plan.device) == {
        "policy", "guidance_copy", "reference_copy", "critic", "target_critic"}
    with pytest.raises(MemoryBudgetError, match="fit on no device"):
        place(policies, critic, target, torch.device("cpu"), 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_iteration_on_cuda_and_resume(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "score", fake_score)
    cfg = parse_config(Config, args(tiny, tmp_path / "cuda", "--iterations", "1", "--device",
                                    "cuda"), prog="guidance", description="", resumable=set())
    run = train.build(cfg)
    try:
        assert run.device == torch.device("cuda", 0)
        for model in (run.policies.models["agent"], run.critic):
            assert {p.device.type for p in model.parameters()} == {"cuda"}
        row = train.iterate(run)
        run.trainer["iteration"] = 1
        run.run.commit(1, row, **train.checkpoint_files(run))
        assert {p.device.type for p in run.policies.adapter_params("agent")} == {"cuda"}
        assert all(s["exp_avg"].device.type == "cuda"
                   for s in run.opts["agent"].state.values())
    finally:
        run.close()
    assert row["placement"]["policy"] == row["placement"]["critic"] == "cuda:0"
    assert row["cuda_peak_actor_bytes"] > 0 and row["cuda_peak_critic_bytes"] > 0
    assert np.isfinite(row["actor_loss"]) and row["grad_norm_agent"] > 0
    train.main(["--run-dir", str(tmp_path / "cuda"), "--resume", "--iterations", "2"])
    assert [r["iteration"] for r in rows(tmp_path / "cuda")] == [1, 2]
