"""The vision tower of a vision-language model: ``transformers``' own module, as Megatron-Bridge runs
Qwen2.5-VL's (pure torch: SDPA attention per image through ``cu_seqlens``, no GPU-only kernels).

``tower(pixel_values [P, C t p^2], grid_thw [n, 3])`` -> ``(embeds [P / m^2, H], deepstack)``: each
image's ``t h w`` patches through the ViT blocks (Qwen2.5-VL: windowed attention but in its
``fullatt_block_indexes``; Qwen3-VL / 3.5: learned position embeddings interpolated to the grid) and
merged ``m x m`` into one language-model token of width ``H`` (``out_hidden_size``); Qwen3-VL's
DeepStack adds one ``[P / m^2, H]`` per ``deepstack_visual_indexes`` entry (features of those blocks
through their own mergers). Images never attend to each other: one call on a concatenation equals
one call per image. Replicated on every tensor / context-parallel rank (its inputs and, through
Megatron-Core's regions, its output gradients are the same on each). Memory: the parameters and,
when trained, each block's activations ``O(P D)`` plus ``O(P_image^2)`` attention scores per image on
the SDPA math path.
"""

from __future__ import annotations

import torch

from mcore_engine.config.vision import VisionConfig

__all__ = ["TOWER_CLASSES", "build_vision_tower", "run_vision_tower"]

# model_type -> (transformers module, vision config class, vision model class)
TOWER_CLASSES = {
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLVisionConfig", "Qwen2_5_VisionTransformerPretrainedModel"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLVisionConfig", "Qwen3VLVisionModel"),
    "qwen3_vl_moe": ("qwen3_vl_moe", "Qwen3VLMoeVisionConfig", "Qwen3VLMoeVisionModel"),
    "qwen3_5": ("qwen3_5", "Qwen3_5VisionConfig", "Qwen3_5VisionModel"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeVisionConfig", "Qwen3_5MoeVisionModel"),
}


def build_vision_tower(vision: VisionConfig, *, seed: int = 0) -> torch.nn.Module:
    """The tower of ``vision.model_type`` from ``vision.vision_config`` (SDPA attention), its weights
    drawn from a generator seeded ``seed`` (the same on every rank; a checkpoint overwrites them)."""
    import importlib

    package, config_name, model_name = TOWER_CLASSES[vision.model_type]
    config_mod = importlib.import_module(f"transformers.models.{package}.configuration_{package}")
    model_mod = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    fields = {k: v for k, v in vision.vision_config.items()
              if k not in ("model_type", "transformers_version")}
    config = getattr(config_mod, config_name)(**fields)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tower = getattr(model_mod, model_name)._from_config(config, attn_implementation="sdpa")
    return tower


def run_vision_tower(tower: torch.nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor
                     ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(embeds [P / m^2, H], deepstack features)`` of the images (module docstring); pixels cast
    to the tower's dtype."""
    dtype = next(tower.parameters()).dtype
    out = tower(pixel_values.to(dtype), grid_thw=grid_thw)
    embeds = out.pooler_output if hasattr(out, "pooler_output") else out[0]
    deepstack = list(getattr(out, "deepstack_features", None) or [])
    return embeds, deepstack
