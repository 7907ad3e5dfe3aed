"""Packing is exact: a Llama-architecture causal LM gives the same per-token logits for
sequences packed into rows (block-diagonal mask + restarting position_ids, and the
position_ids-only path transformers detects) as for each sequence run alone."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlbuffers.stream import collate, pack_bfd


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def packed():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 101, size=n) for n in (5, 9, 3, 7, 6, 12, 1)]
    bins = pack_bfd([len(s) for s in seqs], 20)
    rows = [[seqs[i] for i in b] for b in bins]
    return seqs, bins, rows


def alone_logits(model, seq: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(seq).long()[None]).logits[0]


def check_rows(model, seqs, bins, logits: torch.Tensor) -> int:
    compared = 0
    for r, b in enumerate(bins):
        offset = 0
        for i in b:
            n = len(seqs[i])
            torch.testing.assert_close(logits[r, offset:offset + n], alone_logits(model, seqs[i]),
                                       rtol=1e-5, atol=1e-5)
            offset += n
            compared += n
    return compared


def test_block_causal_mask_path_matches_unpacked(model, packed):
    seqs, bins, rows = packed
    assert any(len(b) > 1 for b in bins)
    batch = collate(rows, pad_token_id=0, max_length=20, attention="block_causal")
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(batch["input_ids"]),
                       position_ids=torch.from_numpy(batch["position_ids"]),
                       attention_mask=torch.from_numpy(batch["attention_mask"])).logits
    assert check_rows(model, seqs, bins, logits) == sum(len(s) for s in seqs)


def test_position_ids_path_matches_unpacked(model, packed):
    seqs, bins, rows = packed
    batch = collate(rows, pad_token_id=0, max_length=20)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(batch["input_ids"]),
                       position_ids=torch.from_numpy(batch["position_ids"]),
                       use_cache=False).logits  # transformers skips packing detection with a cache
    assert check_rows(model, seqs, bins, logits) == sum(len(s) for s in seqs)


def test_without_packing_information_logits_differ(model, packed):
    """Control: the same rows without the mask / restarting positions do not match, so the
    two tests above check something."""
    seqs, bins, rows = packed
    batch = collate(rows, pad_token_id=0, max_length=20)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(batch["input_ids"])).logits
    with pytest.raises(AssertionError):
        check_rows(model, seqs, bins, logits)
