"""Import a Hugging Face Llama / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE / Mixtral / DeepSeek-V3 / GLM-4.5
/ Qwen3.5 / Qwen3.5-MoE / Qwen3-Next / gpt-oss (MXFP4 experts dequantised) folder into this rank's
GPTModel chunks (router expert biases, which are buffers, included); a vision-language folder's tower
too when ``ModelConfig.vision`` (whole, on every rank of the first stage), else its language model only
(``hf.folder``).

No collectives: each rank reads only its shards' rows / columns, of routed experts only its
expert-parallel rank's experts and its expert-tensor-parallel slice (memory: its shards plus one
shard-sized buffer). Call after ``build_model_chunks(cfg)`` and before the DDP wrap and the
optimizer, whose fp32 main parameters are copied from the model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from megatron.core import parallel_state

from mcore_engine.config import EngineConfig, ModelConfig
from mcore_engine.hf.checkpoint_io import HFCheckpointReader
from mcore_engine.hf.folder import FolderReader
from mcore_engine.hf.hf_config import from_hf_config, is_token_classification, read_hf_config
from mcore_engine.hf.hybrid import config_hint
from mcore_engine.hf.layout import shard_from_hf
from mcore_engine.hf.mapping import check_hf_names, hf_shapes, iter_units
from mcore_engine.hf.mtp_names import check_mtp_present, mtp_alias_shapes

# Fields that must agree between the engine config and the checkpoint's config.json (the others,
# e.g. max_sequence_length or init_method_std, may differ on purpose), compared by their resolved
# values (num_query_groups=None means one group per head; ffn_hidden_size=None means 4 * hidden).
_MATCHING_FIELDS = {"num_layers": "num_layers", "hidden_size": "hidden_size",
                    "num_attention_heads": "num_attention_heads", "num_query_groups": "query_groups",
                    "ffn_hidden_size": "ffn_size", "vocab_size": "vocab_size", "rotary_base": "rotary_base",
                    "normalization": "normalization", "norm_epsilon": "norm_epsilon", "swiglu": "swiglu",
                    "tie_word_embeddings": "tie_word_embeddings", "add_qkv_bias": "add_qkv_bias",
                    "qk_layernorm": "qk_layernorm", "kv_channels": "kv_channels",
                    "rotary_percent": "rotary_percent", "mla": "mla",
                    "zero_centered_norm": "zero_centered_norm",
                    "attention_output_gate": "attention_output_gate",
                    # gpt-oss
                    "add_bias_linear": "add_bias_linear", "attention_sinks": "attention_sinks",
                    "sliding_window": "sliding_window", "sliding_window_pattern": "sliding_window_pattern",
                    "glu_activation": "glu_activation", "glu_linear_offset": "glu_linear_offset",
                    "glu_clamp": "glu_clamp", "yarn": "yarn", "vision": "vision"}
# MoEConfig fields that must agree (routing and expert shapes).
_MOE_MATCHING_FIELDS = ("num_experts", "router_topk", "ffn_hidden_size", "shared_expert_ffn_hidden_size",
                        "shared_expert_gate", "router_pre_softmax", "router_score_function",
                        "router_topk_scaling_factor", "router_num_groups", "router_group_topk",
                        "router_expert_bias")


def _moe_fields(cfg: ModelConfig) -> dict | None:
    if cfg.moe is None:
        return None
    out = {name: getattr(cfg.moe, name) for name in _MOE_MATCHING_FIELDS}
    out["ffn_hidden_size"] = cfg.moe.ffn_hidden_size or cfg.ffn_size
    out["layer_freq"] = cfg.moe.layer_pattern(cfg.num_layers)
    return out


def _gdn_fields(cfg: ModelConfig) -> dict | None:
    g = cfg.linear_attention
    if g is None:
        return None
    return {"num_key_heads": g.num_key_heads, "num_value_heads": g.num_value_heads,
            "key_head_dim": g.key_head_dim, "value_head_dim": g.value_head_dim,
            "conv_kernel_dim": g.conv_kernel_dim, "layer_types": g.layer_pattern(cfg.num_layers)}


def check_config_matches(cfg: ModelConfig, hf_cfg: ModelConfig) -> None:
    """``ValueError`` naming the first architecture field where ``cfg`` and the checkpoint differ."""
    ours, theirs = _gdn_fields(cfg), _gdn_fields(hf_cfg)
    for name in sorted(set(ours or {}) | set(theirs or {})):
        a, b = (ours or {}).get(name), (theirs or {}).get(name)
        if a != b:
            raise ValueError(f"model.linear_attention.{name}: the engine config has {a!r} but the Hugging "
                             f"Face checkpoint's config.json implies {b!r}")
    for name, attr in _MATCHING_FIELDS.items():
        if name == "tie_word_embeddings" and cfg.head == "value":
            continue  # a value trunk never ties (the causal LM's lm_head is dropped)
        ours, theirs = getattr(cfg, attr, None), getattr(hf_cfg, attr, None)
        if ours != theirs:
            raise ValueError(f"model.{name}: the engine config has {ours!r} but the Hugging Face "
                             f"checkpoint's config.json implies {theirs!r}")
    ours, theirs = _moe_fields(cfg), _moe_fields(hf_cfg)
    if (ours is None) != (theirs is None):
        raise ValueError(f"model.moe: the engine config has {cfg.moe!r} but the Hugging Face checkpoint is "
                         f"{'dense' if theirs is None else 'a mixture of experts'}")
    for name in ours or {}:
        if ours[name] != theirs[name]:
            raise ValueError(f"model.moe.{name}: the engine config has {ours[name]!r} but the Hugging Face "
                             f"checkpoint's config.json implies {theirs[name]!r}")


def value_head_names_to_skip(cfg: ModelConfig, hf_config: dict, names: set[str]) -> set[str]:
    """The value head's Hugging Face tensors to leave at their initialisation: both for a causal-LM
    folder, ``score.bias`` when a ``*ForTokenClassification`` folder has none; else empty."""
    if cfg.head != "value":
        return set()
    if not is_token_classification(hf_config):
        return {"score.weight", "score.bias"}
    return {"score.bias"} - names


def check_shapes(reader, shapes: dict[str, tuple[int, ...]], cfg: ModelConfig) -> None:
    """``reader.check(shapes)``, its ``ValueError`` naming the ``config.json`` fields behind the tensor
    (a hybrid folder's layer type, GDN heads, conv kernel: ``hf.hybrid.config_hint``)."""
    for name, shape in shapes.items():
        try:
            reader.check({name: shape})
        except ValueError as e:
            raise ValueError(f"{e}{config_hint(name, cfg)}") from e


def load_hf_weights(model_chunks: Sequence[torch.nn.Module], hf_path: str | os.PathLike,
                    cfg: EngineConfig) -> None:
    """``param.copy_(shard_from_hf(rule, read, cfg.model, tp_rank, tp_size, param.shape))`` per parameter
    (expert weights: the expert-tensor-parallel rank and size).

    Every check runs before any parameter changes: ``ValueError`` (naming the field or tensor) for a
    config mismatch, a missing, misshaped or unreadable tensor, an unplaced tensor, an unknown family.
    """
    model_cfg = cfg.model
    hf_config = read_hf_config(hf_path)
    # a text model on a vision-language folder: its language model alone (the tower kept out)
    text_only = {"vision": None} if model_cfg.vision is None else {}
    check_config_matches(model_cfg, from_hf_config(hf_config, head=model_cfg.head, **text_only))
    shapes = hf_shapes(model_cfg)
    if model_cfg.linear_attention is not None and model_cfg.mtp_num_layers > 1:
        raise ValueError("model.mtp_num_layers: the hybrid (Qwen3.5 / Qwen3-Next) folders have one MTP "
                         f"module (mtp.*), got {model_cfg.mtp_num_layers}")

    # by the engine's names: a vision-language folder's model.language_model.* / visual.* prefixes and
    # fused experts translated, its vision tower (unless model.vision) and mtp.* (unless
    # model.mtp_num_layers) kept out (hf.folder); the tower is whole on every rank of the first stage
    load_mtp = model_cfg.mtp_num_layers > 0
    load_vision = model_cfg.vision is not None
    with (HFCheckpointReader(hf_path) as raw,
          FolderReader(raw, load_mtp=load_mtp, load_vision=load_vision) as reader):
        check_hf_names(reader.names(), model_cfg)
        # a value head keeps its fresh (seeded) initialisation when the folder is a causal LM, and a
        # zero bias when a *ForTokenClassification folder has none
        fresh = value_head_names_to_skip(model_cfg, hf_config, set(reader.names()))
        shapes = {k: v for k, v in shapes.items() if k not in fresh}
        check_mtp_present(model_cfg, reader.names())
        check_shapes(reader, shapes, model_cfg)
        reader.check(mtp_alias_shapes(model_cfg, reader.names()))  # MTP copies of the shared weights, if any
        tp = (parallel_state.get_tensor_model_parallel_rank(),
              parallel_state.get_tensor_model_parallel_world_size())
        etp = tp if model_cfg.moe is None else (parallel_state.get_expert_tensor_parallel_rank(),
                                                parallel_state.get_expert_tensor_parallel_world_size())

        def read(name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
            return reader.read(name, shapes[name], dim, start, stop)

        for chunk in model_chunks:
            for unit, param, rule in iter_units(chunk, model_cfg):
                if set(rule.hf_names) <= fresh:
                    continue
                shard = shard_from_hf(rule, read, model_cfg, *(etp if rule.expert else tp), param.shape)
                if shard.shape != param.shape:
                    raise ValueError(f"parameter {unit!r}: built a shard of shape {tuple(shard.shape)} from "
                                     f"{list(rule.hf_names)} but the model expects {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(shard)
