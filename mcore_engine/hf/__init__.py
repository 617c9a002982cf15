"""Hugging Face checkpoints in and out: Llama / Qwen2 / Qwen3, Qwen2-MoE / Qwen3-MoE / Mixtral,
DeepSeek-V3 (Kimi-K2, Moonlight), GLM-4.5, the hybrid Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (``hybrid``)
and the vision-language Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE / Qwen3.5(-MoE) folders with their vision
tower (``families.MULTIMODAL``, ``folder``) <-> the TP/PP/EP-sharded GPTModel.

``from_hf_config`` / ``to_hf_config`` map ``config.json``; ``load_hf_weights`` imports (each rank
reads its slices); ``iter_hf_tensors`` streams ``(name, full tensor)``; ``export_hf`` writes a folder.
"""

from mcore_engine.hf.export import export_hf, iter_hf_tensors
from mcore_engine.hf.hf_config import from_hf_config, read_hf_config, to_hf_config
from mcore_engine.hf.load import load_hf_weights

__all__ = ["export_hf", "from_hf_config", "iter_hf_tensors", "load_hf_weights", "read_hf_config",
           "to_hf_config"]
