"""CRSP's update with the shared base sharded by FSDP2 over 2 CPU ranks (gloo): the per-role
losses, reference and behaviour log-probs and the full adapter gradients equal the 1-rank
run's (tiny random Llama, roles uneven across ranks so padding rows are exercised)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers", "datasketch")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from rlbuffers.memory import AdaptiveMicroBatch  # noqa: E402
from tests.test_crsp import random_adapters, small_config, synthetic_batches  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.crsp import fsdp, roles, update  # noqa: E402
from trainers.crsp.roles import ROLES  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def run_roles(model, tok, cfg, sharded):
    """Losses, flat log-probs and each role's gradients (taken when that role is done)."""
    batches = synthetic_batches(len(tok))
    amb = AdaptiveMicroBatch(model, max_micro_batch=1)
    grads = {}

    def keep(role):
        full = fsdp.gather_grads(model)
        grads.update({n: g for n, g in full.items() if f".{role}." in n})

    fn = fsdp.sharded_grads if sharded else update.optimised_grads
    res = fn(model, batches, cfg.packing(cfg.pack_tokens), cfg.policy_loss(), tok.pad_token_id,
             amb, keep)
    out = {f"grad/{n}": g for n, g in grads.items()}
    for role, r in res.items():
        out[f"loss/{role}"] = np.array(r["loss"])
        out[f"ref/{role}"] = r["ref"].numpy()
        out[f"behaviour/{role}"] = r["behaviour"].numpy()
    return out


def worker(rank, world, init_file, tiny_dir, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    finished = False
    try:
        cfg = small_config(tiny_dir)
        model, tok, _ = roles.make_model(cfg)
        random_adapters(model)
        fsdp.shard_base(model)
        out = run_roles(model, tok, cfg, sharded=True)
        if rank == 0:
            np.savez(out_path, **out)
        finished = True
    finally:
        fsdp.close_distributed(finished)


def test_two_cpu_ranks_equal_one(tmp_path):
    tiny_dir = make_tiny_lm_dir(tmp_path / "tiny")
    cfg = small_config(tiny_dir)
    model, tok, _ = roles.make_model(cfg)
    random_adapters(model)
    want = run_roles(model, tok, cfg, sharded=False)
    out = tmp_path / "sharded.npz"
    mp.spawn(worker, args=(2, str(tmp_path / "init"), tiny_dir, str(out)), nprocs=2)
    got = dict(np.load(out))
    assert set(got) == set(want)
    assert {k.split("/")[0] for k in got} == {"grad", "loss", "ref", "behaviour"}
    assert sum(k.startswith("grad/") for k in got) > 0
    for role in ROLES:
        assert any(k.startswith("grad/") and f".{role}." in k for k in got)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_torchrun_two_ranks_train_as_one_rank(tmp_path):
    """``torchrun --nproc-per-node 2 -m trainers.crsp``: rank 0 generates on the all-gathered
    base, both ranks update their share of the rows of the sharded base. Step 1's rollout
    (rewards, utterances) equals the 1-rank run's exactly, its losses and the adapters after
    the update to fp32 tolerance; rank 0 owns the run directory (buffer, checkpoints,
    metrics), and ``--resume`` continues the 2-rank run."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.numpy import load_file

    from rlbuffers import ReplayBuffer
    from tests.test_crsp import ARGS

    tiny_dir = make_tiny_lm_dir(tmp_path / "tiny")
    base = [*ARGS, "--model", str(tiny_dir), "--steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "trainers.crsp", *base, "--run-dir",
                    str(tmp_path / "one")], check=True, env=env, capture_output=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "trainers.crsp"]
    run = subprocess.run([*torchrun, *base, "--run-dir", str(tmp_path / "two")], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]

    def rows(name):
        text = (tmp_path / name / "metrics.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines()]

    one, two = rows("one"), rows("two")
    assert [r["step"] for r in two] == [1, 2]  # one line per step: only rank 0 writes
    assert [r["ranks"] for r in one + two] == [1, 1, 2, 2]
    for key in ("utterances", "seed_accuracy", *[f"{r}_reward" for r in ROLES]):
        assert two[0][key] == one[0][key], key
    for role in ROLES:
        np.testing.assert_allclose(two[0][f"{role}_loss"], one[0][f"{role}_loss"],
                                   rtol=1e-4, atol=1e-6)
    a1 = load_file(str(tmp_path / "one" / "ckpt" / "step-1" / "adapters.safetensors"))
    a2 = load_file(str(tmp_path / "two" / "ckpt" / "step-1" / "adapters.safetensors"))
    assert set(a1) == set(a2) and a1
    for k in a1:
        np.testing.assert_allclose(a2[k], a1[k], rtol=1e-4, atol=1e-6, err_msg=k)
    run = subprocess.run([*torchrun, "--run-dir", str(tmp_path / "two"), "--resume",
                          "--steps", "3"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in rows("two")] == [1, 2, 3]
    buf = ReplayBuffer.open(tmp_path / "two" / "buffer", mode="r")
    assert buf.metadata["trainer_step"] == 3
    assert len(buf) == sum(r["utterances"] for r in rows("two"))
    buf.close()
