"""A vision-language ``GPTModel``: the vision tower on the first pipeline stage, its outputs in place
of the image tokens' embeddings, 3-D mRoPE, and Qwen3-VL's DeepStack.

First stage, per micro-batch (``vision``: :class:`~mcore_engine.data.multimodal.VisionBatch`)::

    text   = embedding(input_ids)                                   # [s, b, H] (s / tp under SP)
    feats, deep = tower(vision.pixel_values, vision.grid_thw)       # [n_visual, H] each
    visual = scatter(feats[vision.feature_index] -> vision.token_slots)   # zeros elsewhere, [s, b, H]
    decoder_input = where(is_visual, visual, text)                  # transformers' masked_scatter
    hidden_after_layer_i += scatter(deep[i] -> token_slots)         # i < len(deepstack), DeepStack

``scatter`` builds the rank's local ``[s, b, H]`` (after the context-parallel cut: ``token_slots`` are
this rank's) and, under sequence parallelism, cuts it with Megatron-Core's
``scatter_to_sequence_parallel_region`` (backward: all-gather), so every tensor-parallel rank's tower
sees the whole gradient and its replicated weights stay equal. Every stage's attention rotates by
``MultimodalRotaryEmbedding`` on the whole pack's ``[3, rows, cols]`` positions. The tower is trained
unless ``freeze_vision_tower`` (then no grad and no autograd graph). Memory beyond ``GPTModel``: the
tower's (see :mod:`~mcore_engine.layers.vision_tower`) and two ``[s, b, H]`` tensors per micro-batch
(plus one per DeepStack layer).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

from mcore_engine.config.vision import VisionConfig
from mcore_engine.data.multimodal import VisionBatch
from mcore_engine.layers.mrope import MultimodalRotaryEmbedding
from mcore_engine.layers.vision_tower import build_vision_tower, run_vision_tower

__all__ = ["MultimodalGPTModel"]


class MultimodalGPTModel(GPTModel):
    """``GPTModel`` plus ``vision`` (first stage) and mRoPE; ``forward`` takes ``vision=VisionBatch``
    and, with it, ``position_ids`` ``[3, rows, cols]`` (the whole pack's)."""

    def __init__(self, *args: Any, vision_config: VisionConfig, freeze_vision_tower: bool = False,
                 seed: int = 0, **kwargs: Any) -> None:
        config = kwargs["config"]
        config.mrope_section = list(vision_config.mrope_section)
        super().__init__(*args, position_embedding_type="mrope", **kwargs)
        self.rotary_pos_emb = MultimodalRotaryEmbedding(
            kv_channels=config.kv_channels, rotary_percent=kwargs.get("rotary_percent", 1.0),
            rotary_base=kwargs.get("rotary_base", 10000), mrope_section=list(vision_config.mrope_section),
            interleaved=vision_config.mrope_interleaved)
        self.vision_config = vision_config
        self.vision = build_vision_tower(vision_config, seed=seed) if self.pre_process else None
        self.freeze_vision_tower = freeze_vision_tower
        if self.vision is not None and freeze_vision_tower:
            self.vision.requires_grad_(False)
        self._deepstack: list[torch.Tensor] | None = None
        num_deep = len(vision_config.deepstack_visual_indexes)
        for layer in self.decoder.layers:
            if layer.layer_number - 1 < num_deep:  # global 1-based layer numbers
                layer.register_forward_hook(self._deepstack_hook(layer.layer_number - 1))

    def _deepstack_hook(self, index: int):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if self._deepstack is None:
                return output
            if isinstance(output, tuple):
                return (output[0] + self._deepstack[index], *output[1:])
            return output + self._deepstack[index]
        return hook

    def _scatter(self, feats: torch.Tensor, vision: VisionBatch, shape: tuple[int, int]) -> torch.Tensor:
        """``feats`` rows at ``vision.token_slots`` of a zero ``[cols, rows, H]`` (sequence-first), cut
        to this rank's sequence share under sequence parallelism."""
        rows, cols = shape
        flat = feats.new_zeros(rows * cols, feats.shape[-1])
        flat = flat.index_copy(0, vision.token_slots, feats.index_select(0, vision.feature_index))
        out = flat.view(rows, cols, -1).transpose(0, 1).contiguous()
        if self.config.sequence_parallel:
            out = scatter_to_sequence_parallel_region(out)
        return out

    def _visual_mask(self, vision: VisionBatch, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        rows, cols = shape
        mask = torch.zeros(rows * cols, dtype=torch.bool, device=device)
        mask[vision.token_slots] = True
        mask = mask.view(rows, cols).transpose(0, 1)
        if self.config.sequence_parallel:
            tp, rank = (parallel_state.get_tensor_model_parallel_world_size(),
                        parallel_state.get_tensor_model_parallel_rank())
            mask = mask.chunk(tp, dim=0)[rank]
        return mask[..., None]

    def _embed(self, input_ids: torch.Tensor, vision: VisionBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        text = self.embedding(input_ids=input_ids, position_ids=None)
        if vision.grid_thw is None:
            return text, []
        train_tower = torch.is_grad_enabled() and not self.freeze_vision_tower
        with torch.set_grad_enabled(train_tower):
            feats, deep = run_vision_tower(self.vision, vision.pixel_values, vision.grid_thw)
        shape = tuple(input_ids.shape)
        feats = feats.to(text.dtype)
        visual = self._scatter(feats, vision, shape)
        mask = self._visual_mask(vision, shape, text.device)
        return torch.where(mask, visual, text), [self._scatter(d.to(text.dtype), vision, shape) for d in deep]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, decoder_input: torch.Tensor | None = None, *args: Any,
                vision: VisionBatch | None = None,
                packed_seq_params: Any = None, **kwargs: Any) -> torch.Tensor:
        if vision is None:
            raise ValueError("MultimodalGPTModel.forward needs vision= (the micro-batch's VisionBatch: its "
                             "3-D positions at least)")
        self.rotary_pos_emb.packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        position_ids = vision.positions
        deep: list[torch.Tensor] = []
        if self.pre_process and decoder_input is None:
            decoder_input, deep = self._embed(input_ids, vision)
            padding = kwargs.get("padding_mask")
            if padding is not None and self.config.sequence_parallel:  # as GPTModel does for its embedding
                kwargs["padding_mask"] = scatter_to_sequence_parallel_region(
                    padding.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
        self._deepstack = deep or None
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args,
                                   packed_seq_params=packed_seq_params, **kwargs)
        finally:
            self._deepstack = None

