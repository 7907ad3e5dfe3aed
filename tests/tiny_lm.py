"""A tiny random causal LM directory (model + tokenizer + chat template) for the LLM trainers'
tests: seconds to build, no download."""

from __future__ import annotations

from pathlib import Path

import torch

from trainers.llm.tasks import task_problems

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_lm_dir(d: Path) -> Path:
    """Write a 2-layer Llama (hidden 32) and a byte-level BPE tokenizer (vocab ~400) with a
    chat template, trained on reasoning-gym problems, into ``d``: everything a --model
    directory needs. Returns ``d``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    texts = [p["question"] + " <answer>" + str(p["answer"]) + "</answer>"
             for p in task_problems("basic_arithmetic", 200, 0)]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", chat_template=CHAT)
    tok.save_pretrained(d)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, max_position_embeddings=1024)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d
