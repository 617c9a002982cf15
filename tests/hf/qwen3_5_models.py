"""Tiny random Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints and their vision-language folders, built
with ``transformers`` 5.24 (no downloads).

4 layers (GDN, GDN, GDN, attention), hidden 64, vocab 250 (padded by Megatron), 4 query heads of 16 in
2 groups (gated q_proj), GDN 2 key heads of 16 and 4 value heads of 16 (TP 2 splits them), kernel 4.
Qwen3.5 dense ties its embeddings; the MoE models have 4 experts of width 24, top-2, a gated shared
expert of 40; Qwen3-Next's layer 1 is dense (``mlp_only_layers``). ``fused_experts`` rewrites a
Qwen3.5-MoE folder in the Hub's layout (``experts.gate_up_proj`` / ``experts.down_proj``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_vl", "qwen3_5_moe_vl")
MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_next": "qwen3_next",
               "qwen3_5_vl": "qwen3_5_text", "qwen3_5_moe_vl": "qwen3_5_moe_text"}
VOCAB = 250

_TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
             linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4)
_MOE = dict(moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
            num_experts_per_tok=2)
_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=2,
               num_position_embeddings=16)


def text_fields(kind: str) -> dict[str, Any]:
    if kind in ("qwen3_5", "qwen3_5_vl"):
        return {**_TEXT, "intermediate_size": 88}
    if kind == "qwen3_next":
        return {**_TEXT, **_MOE, "intermediate_size": 88, "mlp_only_layers": [1]}
    return {**_TEXT, **_MOE}


def hf_config(kind: str, **overrides: Any):
    """A transformers config object of the tiny model (``overrides``: text config fields)."""
    import transformers as T

    text = text_fields(kind) | overrides
    if kind == "qwen3_5":
        return T.Qwen3_5TextConfig(**text, tie_word_embeddings=True, architectures=["Qwen3_5ForCausalLM"])
    if kind == "qwen3_5_moe":
        return T.Qwen3_5MoeTextConfig(**text, architectures=["Qwen3_5MoeForCausalLM"])
    if kind == "qwen3_next":
        return T.Qwen3NextConfig(**text, architectures=["Qwen3NextForCausalLM"])
    if kind == "qwen3_5_vl":
        return T.Qwen3_5Config(text_config=text, vision_config=_VISION,
                               architectures=["Qwen3_5ForConditionalGeneration"])
    return T.Qwen3_5MoeConfig(text_config=text, vision_config=_VISION,
                              architectures=["Qwen3_5MoeForConditionalGeneration"])


def hf_config_dict(kind: str, **overrides: Any) -> dict[str, Any]:
    """``config.json`` content of the tiny model, as ``save_pretrained`` writes it."""
    return json.loads(hf_config(kind, **overrides).to_json_string(use_diff=False))


def model_class(kind: str):
    import transformers as T

    return {"qwen3_5": T.Qwen3_5ForCausalLM, "qwen3_5_moe": T.Qwen3_5MoeForCausalLM,
            "qwen3_next": T.Qwen3NextForCausalLM, "qwen3_5_vl": T.Qwen3_5ForConditionalGeneration,
            "qwen3_5_moe_vl": T.Qwen3_5MoeForConditionalGeneration}[kind]


def save_tiny_model(kind: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                    fused_experts: bool = False, mtp: bool = False) -> Path:
    """Random weights (norms and ``A_log`` / ``dt_bias`` too, never zero) saved with ``save_pretrained``;
    ``fused_experts``: then rewritten with 3-D fused experts as the Hub's Qwen3.5-MoE folders hold them;
    ``mtp``: with ``mtp.*`` tensors (:func:`add_mtp_tensors`)."""
    torch.manual_seed(seed)
    model = model_class(kind)(hf_config(kind)).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if "norm" in name else 0.5))
    model.save_pretrained(path)
    if fused_experts:
        fuse_expert_files(path)
    if mtp:
        add_mtp_tensors(path, seed)
    return path


def add_mtp_tensors(path: Path, seed: int = 0) -> None:
    """Add a Hub folder's multi-token-prediction module (random ``mtp.*``: ``fc``, its two input norms,
    one layer shaped as the last (full-attention) decoder layer, ``norm``) and ``mtp_num_hidden_layers``
    = 1: ``transformers`` ignores them; the engine keeps them out unless ``model.mtp_num_layers``."""
    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    tensors = load_file(str(file))
    g = torch.Generator().manual_seed(seed)
    h = _TEXT["hidden_size"]
    prefixes = ("model.language_model.layers.3.", "model.layers.3.")
    last = next(p for p in prefixes if any(n.startswith(p) for n in tensors))
    layer = {"mtp.layers.0." + n[len(last):]: torch.randn(t.shape, generator=g) * 0.1
             for n, t in tensors.items() if n.startswith(last)}
    tensors.update({"mtp.fc.weight": torch.randn(h, 2 * h, generator=g),
                    "mtp.pre_fc_norm_embedding.weight": torch.randn(h, generator=g),
                    "mtp.pre_fc_norm_hidden.weight": torch.randn(h, generator=g), **layer,
                    "mtp.norm.weight": torch.randn(h, generator=g)})
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((Path(path) / "config.json").read_text())
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))


def fuse_expert_files(path: Path) -> None:
    """Rewrite ``path``'s per-expert tensors as ``experts.gate_up_proj [E, 2F, H]`` /
    ``experts.down_proj [E, H, F]``."""
    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    tensors = load_file(str(file))
    out, experts = {}, {}
    for name, t in tensors.items():
        m = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m[1], {})[(int(m[2]), m[3])] = t
    for block, parts in experts.items():
        n = len(parts) // 3
        gate_up = [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(n)]
        out[f"{block}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{block}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
    save_file(out, str(file), metadata={"format": "pt"})
