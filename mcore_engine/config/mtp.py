"""The multi-token prediction block (``ModelConfig.mtp_num_layers`` / ``mtp_loss_scaling_factor``):
what Megatron-Core 0.16's MTP combines with (TP, SP, PP with the modules on the last stage, VPP, CP,
EP, MoE, the fused lm-head, thd and bshd). Full recompute of the MTP modules: ``recompute``."""

from __future__ import annotations

from typing import Any

from mcore_engine.config.checks import require

__all__ = ["MTP"]


class MTPBlock:
    """The MTP fields live on ``ModelConfig`` (their YAML keys); this is their ``check``."""

    def check(self, model: Any, parallel: Any) -> None:
        """A loss factor needs modules; an engine (``parallel`` given) needs an lm head, untied
        embeddings at PP > 1 and, when the modules train, no LoRA. A value model's folder may carry MTP
        tensors: the engine's config then sets ``mtp_num_layers: 0``."""
        n, factor = model.mtp_num_layers, model.mtp_loss_scaling_factor
        require(factor == 0 or n > 0, "ModelConfig.mtp_loss_scaling_factor > 0 needs "
                "ModelConfig.mtp_num_layers > 0", "model.mtp_loss_scaling_factor", "model.mtp_num_layers")
        if parallel is None or n == 0:
            return
        require(model.head == "lm", f"ModelConfig.mtp_num_layers ({n}) needs ModelConfig.head='lm' (the MTP "
                f"modules share the vocabulary head), got head={model.head!r}: set mtp_num_layers: 0 for a "
                "value model (the checkpoint's MTP tensors are then ignored)", "model.mtp_num_layers",
                "model.head")
        pp = parallel.pipeline_model_parallel_size
        require(not model.tie_word_embeddings or pp == 1, "ModelConfig.mtp_num_layers > 0 with "
                "ModelConfig.tie_word_embeddings needs ParallelConfig.pipeline_model_parallel_size == 1, got "
                f"{pp}: Megatron-Core 0.16 keeps an unused output layer on the MTP stage, whose checkpoint "
                "tying fails", "parallel.pipeline_model_parallel_size", "model.mtp_num_layers",
                "model.tie_word_embeddings")
        require(factor == 0 or model.lora is None, "ModelConfig.mtp_loss_scaling_factor > 0 with "
                "ModelConfig.lora: the MTP modules are part of the frozen base; set "
                "mtp_loss_scaling_factor: 0",
                "model.mtp_loss_scaling_factor", "model.lora")


MTP = MTPBlock()
