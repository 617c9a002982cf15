"""Megatron-Core ``GPTModel`` chunks from an :class:`~mcore_engine.config.EngineConfig` (no
process-group code): the layer spec of :mod:`.spec`, the config of :mod:`.transformer_config`, the
vocabulary padded as Megatron pads it; logits vocab-sharded ``[b, s, V_padded / tp]`` in the
parameters' dtype. On CPU a TP shard is an exact slice of the TP=1 weight.

Re-exported for their callers: ``has_te``, ``build_transformer_config`` and the :mod:`.head` names.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from mcore_engine.config import EngineConfig
from mcore_engine.layers.mtp import MTPGPTModel, freeze_untrained_mtp, mtp_block_spec
from mcore_engine.layers.value_head import attach_value_head
from mcore_engine.model.head import (
    apply_output_layer,
    is_last_stage_chunk,
    lm_head_weight,
    output_hidden_states,
)
from mcore_engine.model.spec import decoder_spec, has_te, mtp_source_spec
from mcore_engine.model.transformer_config import build_transformer_config
from mcore_engine.parallel.cpu_device import apply_cpu_device_layer

__all__ = ["apply_output_layer", "build_model_chunks", "build_transformer_config", "has_te",
           "is_last_stage_chunk", "lm_head_weight", "output_hidden_states", "padded_vocab_size"]


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by * tp`` (``(250, 128, 2) -> 256``)."""
    for name, value in (("vocab_size", vocab_size), ("divisible_by", divisible_by), ("tp", tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"padded_vocab_size: {name} must be an int >= 1, got {value!r}")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def build_model_chunks(cfg: EngineConfig) -> list[GPTModel]:
    """One unwrapped ``GPTModel`` per virtual pipeline stage of this rank (embedding on the first
    stage, output layer on the last). Memory: the parameters (on CPU plus one fp32 copy of the largest
    weight while it is drawn).
    """
    if not parallel_state.model_parallel_is_initialized():
        raise ValueError("build_model_chunks: parallel_state is not initialised; call "
                         "mcore_engine.parallel.platform.init_distributed(cfg.parallel, cfg.seed) first")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if (tp, pp) != (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size):
        raise ValueError(f"build_model_chunks: parallel_state has tp={tp}, pp={pp} but cfg.parallel asks "
                         f"tensor_model_parallel_size={cfg.parallel.tensor_model_parallel_size}, "
                         f"pipeline_model_parallel_size={cfg.parallel.pipeline_model_parallel_size}")
    apply_cpu_device_layer()
    config = build_transformer_config(cfg)
    vocab = padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp is not None else None
        spec = decoder_spec(cfg, config, vp_stage)
        mtp_spec = None if not cfg.model.mtp_num_layers else mtp_block_spec(  # None but on the last stage
            config, mtp_source_spec(cfg, config, vp_stage), vp_stage, te=has_te())
        model = (GPTModel if mtp_spec is None else MTPGPTModel)(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=cfg.model.max_sequence_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,
            share_embeddings_and_output_weights=cfg.model.tie_word_embeddings and cfg.model.head == "lm",
            position_embedding_type="rope" if cfg.model.yarn is None else "yarn",
            rotary_base=cfg.model.rotary_base,
            rope_scaling=cfg.model.rope_scaling_factor is not None,
            rope_scaling_factor=cfg.model.rope_scaling_factor or 8.0,  # 8.0: GPTModel's unused default
            rotary_percent=cfg.model.rotary_percent,
            vp_stage=vp_stage,
            mtp_block_spec=mtp_spec,
        )
        freeze_untrained_mtp(model, cfg.model.mtp_loss_scaling_factor)
        if cfg.model.head == "value" and model.post_process:
            attach_value_head(model, cfg)  # mcore_engine.layers.value_head: replicated Linear(H, 1)
        _cast_params(model, config.params_dtype)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def _cast_params(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter in ``dtype``: the local spec's torch norms ignore
    ``params_dtype`` (fp32 under bf16), and Megatron's optimizers index state through the float16
    params only when all of them are float16 (what ``Float16Module`` would otherwise ensure)."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
