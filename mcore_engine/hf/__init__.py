"""Hugging Face checkpoints in and out: Llama / Qwen2 / Qwen3 <-> the engine's TP/PP-sharded GPTModel.

- ``from_hf_config`` / ``to_hf_config``: ``config.json`` <-> ``ModelConfig`` (``mapping.py``).
- ``load_hf_weights(model_chunks, hf_path, cfg)``: import, each rank reading only its slices.
- ``iter_hf_tensors(model_chunks, cfg)``: streaming ``(name, full tensor)`` export for weight sync.
- ``export_hf(model_chunks, cfg, out_dir)``: a Hugging Face folder (safetensors + config.json).
"""

from mcore_engine.hf.export import export_hf, iter_hf_tensors
from mcore_engine.hf.load import load_hf_weights
from mcore_engine.hf.mapping import from_hf_config, read_hf_config, to_hf_config

__all__ = ["export_hf", "from_hf_config", "iter_hf_tensors", "load_hf_weights", "read_hf_config",
           "to_hf_config"]
