"""A tiny random gpt-oss (``GptOssForCausalLM``) built with ``transformers`` (no downloads), saved
dequantised (``save_pretrained``) and in the Hub's MXFP4 layout.

4 layers, hidden 64, 4 query heads / 2 KV heads of 16, 4 experts of width 32, top-2, vocab 250
(padded by Megatron), ``sliding_window`` 4 with ``layer_types`` sliding / full / sliding / full, YaRN
(factor 4 over 16 original positions, ``truncate`` False as on the Hub). Every weight, bias and sink
random and non-zero; the experts' ``gate_up_proj`` large enough that the clamp at 7 bites. The expert
weights are MXFP4 values (``quantize`` then ``dequantize``), so the dense folder is the MXFP4
folder's dequantised model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mcore_engine.hf.mxfp4 import dequantize, quantize

VOCAB = 250
NUM_LAYERS = 4
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=NUM_LAYERS,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64, rms_norm_eps=1e-5,
              layer_types=["sliding_attention", "full_attention"] * 2, router_aux_loss_coef=0.01,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
              architectures=["GptOssForCausalLM"])
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                    "model.layers.*.mlp.router",
                                                                    "model.embed_tokens", "lm_head"]}


def hf_config(**overrides):
    """The ``transformers`` ``GptOssConfig`` of the tiny model."""
    import transformers

    return transformers.GptOssConfig(**(CONFIG | overrides))


def _mxfp4_round(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[E, X, Y]`` (transformers' layout) with its ``[E, Y, X]`` rows rounded to MXFP4."""
    return dequantize(*quantize(w.transpose(1, 2))).transpose(1, 2).contiguous()


def build_model(seed: int = 0, **overrides) -> torch.nn.Module:
    """The random tiny model in fp32, eval mode, ``attn_implementation="eager"``."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(hf_config(**overrides)).eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn_like(p)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * noise)
            elif name.endswith("experts.gate_up_proj"):  # pre-activations of several units beyond 7
                p.copy_(_mxfp4_round(0.8 * noise))
            elif name.endswith("experts.down_proj"):
                p.copy_(_mxfp4_round(0.05 * noise))
            elif name.endswith("sinks"):
                p.copy_(noise)
            else:
                p.copy_(0.2 * noise)
    return model


def save_tiny_model(path: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """:func:`build_model` saved to ``path`` (dequantised layout); returns the model."""
    model = build_model(seed, **overrides)
    model.save_pretrained(path)
    return model


def save_mxfp4_folder(dense: Path, path: Path) -> None:
    """The folder ``dense`` in the Hub's layout: each layer's ``gate_up_proj`` ``[E, H, 2I]`` as
    ``gate_up_proj_blocks`` ``[E, 2I, H/32, 16]`` + ``_scales`` ``[E, 2I, H/32]``, ``down_proj`` ``[E, I, H]``
    as ``down_proj_blocks`` ``[E, H, I/32, 16]`` + ``_scales``; ``quantization_config`` in config.json."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for file in sorted(Path(dense).glob("*.safetensors")):
        tensors.update(load_file(file))
    out = {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize(t.transpose(1, 2))
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
        else:
            out[name] = t
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(dense) / "config.json").read_text())
    config["quantization_config"] = MXFP4_CONFIG
    (path / "config.json").write_text(json.dumps(config, indent=2))
