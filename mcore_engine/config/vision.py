"""``VisionConfig`` (``ModelConfig.vision``): the vision tower of a vision-language model and the
3-D multimodal RoPE (mRoPE) of its language model (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5).

Each token has three positions ``(t, h, w)`` (text tokens: three equal ones; image tokens: the
temporal index and the row / column of their merged patch). mRoPE rotates channel pair ``i`` of
the ``r = rotary_dim / 2`` pairs by the position of the axis that pair belongs to::

    sectioned (Qwen2.5-VL):     pairs [0, s_t) -> t, [s_t, s_t + s_h) -> h, the rest -> w
    interleaved (Qwen3-VL / 3.5): pair i -> h if i % 3 == 1 and i < 3 s_h, w if i % 3 == 2 and
                                  i < 3 s_w, else t

with ``mrope_section = [s_t, s_h, s_w]`` (``s_t + s_h + s_w = r``). A sample without images has
``t = h = w``: both reduce to plain RoPE. No memory beyond the ``[3, tokens]`` positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mcore_engine.config.checks import Block, is_int, require

__all__ = ["VISION_MODEL_TYPES", "VisionConfig"]

VISION_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
"""The Hugging Face ``model_type`` of the vision-language folders whose tower the engine runs."""


@dataclass(kw_only=True)
class VisionConfig(Block):
    """A vision-language model's vision side (see the module docstring)."""

    PATH = "model.vision"

    model_type: str
    """Hugging Face ``model_type`` of the vision-language model (``VISION_MODEL_TYPES``): selects the
    tower class and the rule of the 3-D positions (``transformers``' ``get_rope_index``)."""
    vision_config: dict[str, Any] = field(default_factory=dict)
    """The folder's ``config.json`` ``vision_config``, as is (the tower's ``transformers`` config)."""
    image_token_id: int
    """The token each merged image patch takes in ``input_ids`` (``<|image_pad|>``)."""
    video_token_id: int
    """The token of each merged video patch (``<|video_pad|>``)."""
    vision_start_token_id: int
    """``<|vision_start|>``: the token before every image / video."""
    mrope_section: list[int]
    """Rotary channel pairs of the t, h and w axes; their sum is half the rotary dimension."""
    mrope_interleaved: bool = False
    """False: sectioned (Qwen2.5-VL); True: interleaved (Qwen3-VL, Qwen3.5)."""
    tokens_per_second: float | None = None
    """Qwen2.5-VL videos: temporal position step per second of video (``vision_config``'s)."""

    def __post_init__(self) -> None:
        self._choice("model_type", VISION_MODEL_TYPES)
        self._require(isinstance(self.vision_config, dict), "VisionConfig.vision_config must be a "
                      f"mapping (config.json's vision_config), got {type(self.vision_config).__name__}",
                      "vision_config")
        self._ints("image_token_id", "video_token_id", "vision_start_token_id", low=0)
        sec = self.mrope_section
        self._require(isinstance(sec, list) and len(sec) == 3 and all(is_int(s, 0) for s in sec),
                      "VisionConfig.mrope_section must be three ints >= 0 (t, h, w channel pairs), got "
                      f"{sec!r}", "mrope_section")
        self._bools("mrope_interleaved")
        self._numbers("tokens_per_second", strict=True, optional=True)

    def check(self, model: Any, parallel: Any) -> None:
        """mRoPE covers the rotary dimension; the DeepStack layers are decoder layers of the first
        pipeline stage (their inputs come from the tower there)."""
        d = model.kv_channels or model.hidden_size // model.num_attention_heads
        rotary = int(d * model.rotary_percent)
        require(2 * sum(self.mrope_section) == rotary,
                f"VisionConfig.mrope_section {self.mrope_section} must sum to half the rotary dimension "
                f"({rotary} = int(head dim {d} * rotary_percent {model.rotary_percent}))",
                "model.vision.mrope_section", "model.rotary_percent")
        require(model.mla is None, "ModelConfig.vision with ModelConfig.mla: the vision-language families "
                "here use grouped-query attention", "model.vision", "model.mla")
        require(not model.mtp_num_layers, "ModelConfig.vision with ModelConfig.mtp_num_layers > 0: "
                "multi-token prediction is not supported for vision-language models (the folder's MTP "
                "weights stay in the folder)", "model.vision", "model.mtp_num_layers")
        deep = len(self.deepstack_visual_indexes)
        require(deep <= model.num_layers, f"VisionConfig.vision_config.deepstack_visual_indexes has {deep} "
                f"entries for ModelConfig.num_layers = {model.num_layers}", "model.vision.vision_config")
        if parallel is None or not deep:
            return
        pp, vpp = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size or 1
        first = model.num_layers // (pp * vpp)
        require(first >= deep, f"VisionConfig: DeepStack adds the tower's features to the first {deep} "
                "decoder layers, which must sit on the first pipeline stage; pipeline_model_parallel_size="
                f"{pp} (x virtual {vpp}) gives it {first}", "parallel.pipeline_model_parallel_size",
                "model.vision.vision_config")

    @property
    def deepstack_visual_indexes(self) -> list[int]:
        """Tower layers whose features DeepStack adds to decoder layers ``0 .. len - 1`` (Qwen3-VL)."""
        return list(self.vision_config.get("deepstack_visual_indexes") or [])

    @property
    def spatial_merge_size(self) -> int:
        """Patches merged per side into one language-model token."""
        return int(self.vision_config.get("spatial_merge_size", 2))
