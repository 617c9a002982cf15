"""Tiny random Llama / Qwen2 / Qwen3 and Qwen3-MoE / Mixtral / Qwen2-MoE checkpoints built with
``transformers`` (no downloads).

Odd sizes on purpose: vocab 250 (padded by Megatron), 4 query heads in 2 groups, ffn 88; Qwen2 ties
its embeddings (so the tied path, incl. the last pipeline stage's copy, is exercised). The MoE
models have 4 experts of width 24, top-2: Qwen3-MoE 3 layers with a dense first one (ffn 88) and
renormalised top-k weights, Qwen2-MoE a gated shared expert of width 40 and plain softmax weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "qwen2", "qwen3")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
VOCAB = 250

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)

_MOE = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=16,
                          norm_topk_prob=True, mlp_only_layers=[0], rope_theta=1e4),
        "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                          shared_expert_intermediate_size=40, rope_theta=1e4),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24, rope_theta=1e4)}


def hf_config(family: str, num_layers: int = 2, **overrides: Any):
    """A transformers config object of the tiny model (``overrides``: other config fields)."""
    import transformers

    common = _COMMON | {"num_hidden_layers": num_layers} | overrides

    if family == "llama":
        return transformers.LlamaConfig(**common, rope_theta=5000.0, architectures=["LlamaForCausalLM"])
    if family == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=20000.0, tie_word_embeddings=True,
                                        architectures=["Qwen2ForCausalLM"])
    if family in _MOE:
        cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
               "mixtral": transformers.MixtralConfig}[family]
        arch = {"qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe", "mixtral": "Mixtral"}[family]
        return cls(**(common | _MOE[family] | overrides), architectures=[f"{arch}ForCausalLM"])
    return transformers.Qwen3Config(**common, head_dim=16, rope_theta=1e6,
                                    architectures=["Qwen3ForCausalLM"])


def hf_config_dict(family: str) -> dict[str, Any]:
    """``config.json`` content of the tiny model, as ``save_pretrained`` writes it."""
    return hf_config(family).to_dict()


def save_tiny_model(family: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                    max_shard_size: str | None = None, num_layers: int = 2,
                    **overrides: Any) -> torch.nn.Module:
    """Random model of ``family`` in ``dtype`` saved (safetensors, sharded when ``max_shard_size`` is
    given, e.g. ``"100KB"``) to ``path``; returns it in eval mode.

    Weights are drawn with std 0.2 (not HF's 0.02, which would make every logit ~0 and hide layout
    errors) and norm weights around 1, so every tensor matters for the logits.
    """
    import transformers

    torch.manual_seed(seed)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
           "mixtral": transformers.MixtralForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM}[family]
    model = cls(hf_config(family, num_layers, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn_like(p)
            p.copy_(1 + 0.3 * noise if name.endswith("norm.weight") else 0.2 * noise)
    model = model.to(dtype)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def load_folder(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of every ``*.safetensors`` file in ``path`` (sharded or not)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors
