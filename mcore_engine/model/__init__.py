"""The Megatron-Core ``GPTModel`` from the config: transformer config, layer spec, MoE runtime and
routing replay, the output head, and its wrapping (DDP or forward-only).

The names of the old ``mcore_engine.model`` module load lazily from their new homes."""

from typing import Any

_OLD_NAMES = {"PackedDotProductAttention": "mcore_engine.layers.packed_attention",
              **dict.fromkeys(("build_model_chunks", "build_transformer_config", "has_te",
                               "apply_output_layer", "is_last_stage_chunk", "lm_head_weight",
                               "output_hidden_states", "padded_vocab_size"), "mcore_engine.model.build")}


def __getattr__(name: str) -> Any:
    if name not in _OLD_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_OLD_NAMES[name]), name)
