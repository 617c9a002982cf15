"""Shared set-up of the verl integration tests: a tiny random Hugging Face model folder."""

from __future__ import annotations

import torch

VOCAB = 250


def make_hf_model(path: str) -> None:
    """A tiny random Qwen2 folder shaped like configs/tiny_cpu_tp2.yaml."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
