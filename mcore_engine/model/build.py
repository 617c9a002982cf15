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
from mcore_engine.model.multimodal import MultimodalGPTModel
from mcore_engine.model.spec import decoder_spec, has_te, mtp_source_spec, uses_te_spec
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
            config, mtp_source_spec(cfg, config, vp_stage), vp_stage, te=uses_te_spec(cfg))
        cls, extra = (GPTModel if mtp_spec is None else MTPGPTModel), {}
        if cfg.model.vision is not None:  # the tower (first stage), mRoPE, DeepStack: model/multimodal.py
            cls, extra = MultimodalGPTModel, {"vision_config": cfg.model.vision, "seed": cfg.seed,
                                              "freeze_vision_tower": cfg.model.freeze_vision_tower}
        model = cls(
            **extra,
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=cfg.model.max_sequence_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,
            share_embeddings_and_output_weights=cfg.model.tie_word_embeddings and cfg.model.head == "lm",
            **({} if cfg.model.vision is not None else
               {"position_embedding_type": "rope" if cfg.model.yarn is None else "yarn"}),
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
        _expert_grad_groups(model, cfg)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def _expert_grad_groups(model: torch.nn.Module, cfg: EngineConfig) -> None:
    """Reduce the routed experts' gradients over the expert data-parallel group, never over TP.

    Megatron-Core marks expert parameters ``allreduce`` (the dense data-parallel group) unless
    ``expert_model_parallel_size > 1``: at EP = 1 with ``expert_tensor_parallel_size < tp`` the
    experts are replicated over TP ranks that route other tokens (sequence parallelism), which the
    dense group leaves out (each rank kept its own partial gradient). And a biased expert's
    ``linear_fc2.bias`` carries ``sequence_parallel``, so ``finalize_model_grads`` summed it over
    the TP ranks, which at EP > 1 hold other experts; the expert optimizer, which reduces its grad
    norm over the expert TP x EP x PP group, counted that bias on TP rank 0 only (Megatron's test for
    a TP duplicate looks at the dense TP rank). Here: ``allreduce`` off at EP = 1 with ETP < TP (DDP
    then reduces them over the expert data-parallel group, TP included), ``sequence_parallel`` off
    on every expert parameter (each expert sees all its tokens), and every expert parameter marked
    ``tensor_model_parallel`` as Megatron marks the expert weights (split over the expert-TP group,
    which is 1 for biased experts: counted on every rank)."""
    par = cfg.parallel
    over_tp = par.expert_model_parallel_size == 1 and par.expert_tensor_size != par.tensor_model_parallel_size
    for name, param in model.named_parameters():
        if ".experts." not in name:
            continue
        if over_tp:
            param.allreduce = False
        if getattr(param, "sequence_parallel", False):
            param.sequence_parallel = False
        if not getattr(param, "tensor_model_parallel", False):
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1


def _cast_params(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter in ``dtype``: the local spec's torch norms ignore
    ``params_dtype`` (fp32 under bf16), and Megatron's optimizers index state through the float16
    params only when all of them are float16 (what ``Float16Module`` would otherwise ensure)."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
