"""verl's configs -> the core's ``EngineConfig``.

:func:`engine_config_from_verl` maps every field of verl's model / engine / optimizer / checkpoint
configs with a meaning here and refuses, naming verl's field, every setting the engine cannot honour
(:data:`NOT_APPLICABLE`: fields without a meaning here). The core decides: its ``ConfigError``s are
re-raised with the verl field their field comes from (``verl_fields.VERL_FIELDS``). LoRA:
``verl_lora_config``; MoE routing replay modes: ``verl_router_replay``; the backend's config classes:
``verl``.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from verl.workers.config.optimizer import McoreOptimizerConfig, OptimizerConfig

from mcore_engine import EngineConfig
from mcore_engine.config import OptimizerConfig as CoreOptimizerConfig
from mcore_engine.config import ParallelConfig
from mcore_engine.integrations.verl_fields import (
    DTYPES,
    PARALLEL_FIELDS,
    _check,
    _plain,
    _refuse,
    in_verl_terms,
)
from mcore_engine.integrations.verl_lora_config import lora_from_verl, lora_merge

__all__ = ["BACKEND", "NOT_APPLICABLE", "engine_config_from_verl", "lora_from_verl", "lora_merge",
           "router_replay_mode"]

BACKEND = "mcore_engine"

NOT_APPLICABLE: dict[str, str] = {
    "engine_config.use_mbridge": "HF weights are imported by mcore_engine.hf, not by mbridge",
    "engine_config.vanilla_mbridge": "HF weights are imported by mcore_engine.hf, not by mbridge",
    "engine_config.pad_bshd_to_minibatch_max": "a cuDNN plan-reuse knob; the core pads per micro-batch",
    "engine_config.entropy_from_logits_with_chunking": "entropy is always computed chunk by chunk",
    "engine_config.dist_ckpt_optim_fully_reshardable": "checkpoints are always reshardable",
    "engine_config.infer_max_token_len_per_gpu / infer_micro_batch_size_per_gpu":
        "TrainingWorker puts them on each inference batch, where the core reads them",
    "model_config.trust_remote_code / external_lib / tokenizer / custom_chat_template":
        "tokenizer-side settings; the engine sees token ids",
    "checkpoint_config.strict / save_lora_only":
        "the HF export is always complete; with LoRA a checkpoint always holds only the adapters and their "
        "optimizer state (the frozen base comes from model_config.path)",
    "model_config.lora.freeze_vision_model / freeze_vision_projection / freeze_language_model":
        "settings of type vlm_lora (refused); with LoRA the whole base is frozen",
    "model_config.lora.fully_sharded_loras": "a vLLM rollout setting",
    "model_config.mtp.enable_rollout / speculative_* / method / num_speculative_tokens":
        "the rollout's speculative decoding (vLLM / SGLang) with the MTP modules",
    "optimizer_config.use_checkpoint_opt_param_scheduler":
        "the scheduler state is always restored with the checkpoint",
    "model_config.fused_kernel_options.impl_backend":
        "the core picks the lm-head kernels itself (Triton for CUDA tensors when it imports, "
        "torch otherwise)",
    "engine_config.override_transformer_config.attention_backend":
        "the core's layer spec picks the attention (Megatron's local attention without Transformer Engine, "
        "TE's own selection with it); verl's default 'flash' is accepted and not forwarded",
}

# Megatron-Core's AttnBackend names (verl's default override_transformer_config says "flash")
_ATTENTION_BACKENDS = frozenset({"flash", "fused", "unfused", "local", "auto"})
_CKPT_CONTENTS = {"model", "optimizer", "extra"}
_ENGINE_FLAGS_OFF = {
    "dynamic_context_parallel": "context parallelism is static (context_parallel_size)",
    "full_determinism": "no deterministic-kernel mode",
    "pad_to_length": "micro-batches are packed to their own length",
    "use_dist_checkpointing": "initial weights come from model_config.path (HF)",
    "use_megatron_fsdp": "Megatron DDP / distributed optimizer only",
    "distrib_optim_fully_reshardable_mem_efficient": "not implemented",
}


def engine_config_from_verl(model_config: Any, engine_config: Any, optimizer_config: Any,
                            checkpoint_config: Any = None) -> EngineConfig:
    """The core :class:`EngineConfig` for verl's four config objects; ``ValueError`` naming the
    first verl field that cannot be honoured. Architecture from the HF ``config.json``, weights from
    ``model_config.local_path``."""
    from mcore_engine.hf import from_hf_config, read_hf_config

    e, m, o = engine_config, model_config, optimizer_config
    roots = dict(engine_config=e, model_config=m, optimizer_config=o)
    sources: dict[str, str] = {}  # core field -> the verl field it came from, when several can
    _check(getattr(e, "strategy", None) == BACKEND, "engine_config.strategy", getattr(e, "strategy", None),
           f"build the engine block as McoreEngineVerlConfig (strategy={BACKEND!r})")
    otc, replay = _check_engine(e), router_replay_mode(e)
    # --- model_config
    model_type = getattr(m, "model_type", "language_model")
    _check(model_type in ("language_model", "value_model"), "model_config.model_type", model_type,
           "language models and value models (critics) only")
    value = model_type == "value_model"
    for name in ("use_fused_kernels", "logits_chunk_size"):  # lm-head settings: a critic has no lm-head
        _check(not value or not getattr(e, name, None), f"engine_config.{name}", getattr(e, name, None),
               "a value model (model_type='value_model') has no lm-head")
    lora, lora_source = lora_from_verl(m, e.dtype, value_model=value)
    if lora is not None:
        sources["model.lora"] = lora_source
    _check_model(m)
    weights = getattr(m, "local_path", None) or getattr(m, "path", None)
    hf_dir = getattr(m, "local_hf_config_path", None) or weights
    with in_verl_terms(sources, **roots):  # e.g. the core's LoRA checks against the model (MoE experts)
        model = from_hf_config(read_hf_config(hf_dir), hf_path=weights, head="value" if value else "lm",
                               fused_lm_head=bool(getattr(e, "use_fused_kernels", False)) and not value,
                               lora=lora)
    forward_only = bool(getattr(e, "forward_only", False))
    _check(replay == "disabled" or (model.moe is not None and not value and not forward_only),
           "engine_config.router_replay.mode", replay,
           "a dense model has no routing to replay" if model.moe is None else
           "verl replays routing on the actor only (its reference policy and critic route natively)")
    model = _moe_from_verl(otc, model, roots)
    model = _mtp_from_verl(m, otc, model, sources, value=value, forward_only=forward_only)
    # --- optimizer_config (a reference policy may have none)
    optimizer = CoreOptimizerConfig() if forward_only and o is None else _optimizer_from_verl(o, e, roots)
    _check_checkpoint(checkpoint_config)
    recompute, source = _recompute_from_verl(m, e)
    sources.update(dict.fromkeys(recompute, source))
    mbs = e.micro_batch_size_per_gpu
    with in_verl_terms(sources, **roots):  # the core's checks name its own fields: name verl's
        layout = ParallelConfig(**{n: _integral(getattr(e, n)) for n in PARALLEL_FIELDS},
                                sequence_parallel=bool(e.sequence_parallel),
                                cp_comm_type=otc.get("cp_comm_type", "p2p"))
        return EngineConfig(model=model, parallel=layout, optimizer=optimizer, precision=DTYPES[e.dtype],
                            seed=_integral(e.seed), micro_batch_size=1 if mbs is None else _integral(mbs),
                            logits_chunk_size=getattr(e, "logits_chunk_size", None),
                            data_format="thd" if e.use_remove_padding else "bshd",
                            forward_only=forward_only, **recompute)


def _check_engine(e: Any) -> dict[str, Any]:
    """The engine_config flags with no meaning here refused; ``override_transformer_config`` as a dict."""
    _check(e.dtype in DTYPES, "engine_config.dtype", e.dtype, "use float32 or bfloat16")
    for name, why in _ENGINE_FLAGS_OFF.items():
        _check(not getattr(e, name, False), f"engine_config.{name}", getattr(e, name, None), why)
    for name in ("max_seqlen_per_dp_cp_rank", "dist_checkpointing_path"):
        _check(getattr(e, name, None) is None, f"engine_config.{name}", getattr(e, name, None),
               "no dynamic context parallelism / dist-checkpoint weight import")
    for name in ("override_ddp_config", "override_mcore_model_config"):
        _check(not getattr(e, name, None), f"engine_config.{name}", getattr(e, name, None),
               "the model and DDP are built from the HF config and EngineConfig only")
    otc = dict(getattr(e, "override_transformer_config", None) or {})
    mapped = [*_RECOMPUTE_KEYS, "cp_comm_type", *_MOE_KEYS, *_MTP_KEYS]
    extra = sorted(set(otc) - set(mapped) - {"attention_backend"})
    _check(not extra, "engine_config.override_transformer_config", extra,
           f"only {mapped} are mapped (attention_backend is not applicable); the "
           "model is built from the HF config and EngineConfig")
    backend = otc.get("attention_backend")
    _check(backend is None or str(getattr(backend, "name", backend)) in _ATTENTION_BACKENDS,
           "engine_config.override_transformer_config.attention_backend", backend,
           f"not one of Megatron's attention backends {sorted(_ATTENTION_BACKENDS)}")
    _check(not getattr(getattr(e, "qat", None), "enable", False), "engine_config.qat.enable", True,
           "no quantisation-aware training")
    return otc


def _check_model(m: Any) -> None:
    for name, why in (("enable_activation_offload", "no activation offload"),
                      ("use_liger", "Liger kernels are for the FSDP backend")):
        _check(not getattr(m, name, False), f"model_config.{name}", getattr(m, name, None), why)
    options = dict(getattr(m, "fused_kernel_options", None) or {})
    _check(not set(options) - {"impl_backend"}, "model_config.fused_kernel_options", options,
           "the fused lm-head has no options (impl_backend is not applicable)")
    _check(options.get("impl_backend") in (None, "torch", "triton"),
           "model_config.fused_kernel_options.impl_backend", options.get("impl_backend"),
           "verl's backends are 'torch' and 'triton'")
    tiled = getattr(m, "tiled_mlp", None) or {}
    _check(not tiled.get("enabled", False), "model_config.tiled_mlp.enabled", True, "no tiled MLP")
    extra = sorted(set(getattr(m, "override_config", None) or {}) - {"attn_implementation"})
    _check(not extra, "model_config.override_config", extra, "the architecture comes from config.json only")


def _check_checkpoint(c: Any) -> None:
    if c is None:
        return
    for name in ("save_contents", "load_contents"):
        contents = set(getattr(c, name, None) or _CKPT_CONTENTS)
        _check(_CKPT_CONTENTS <= contents and contents <= _CKPT_CONTENTS | {"hf_model"},
               f"checkpoint_config.{name}", sorted(contents),
               "model, optimizer and extra are always saved and loaded together (+ optional hf_model)")
    _check(not getattr(c, "async_save", False), "checkpoint_config.async_save", True, "no async save")


# ------------------------------------------------------------------------------- MoE routing and MTP
_MOE_KEYS = ("moe_router_bias_update_rate", "moe_router_enable_expert_bias")
_MTP_KEYS = ("mtp_num_layers", "mtp_loss_scaling_factor")


def _integral(value: Any) -> Any:
    """A verl integer (a numpy one too) as ``int``; anything else as it is, for the core to judge."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


def router_replay_mode(e: Any) -> str:
    """verl's ``engine_config.router_replay.mode`` ("disabled" when the block is absent), checked:
    ``record_file`` / ``replay_file`` are refused (verl 0.9.1 reads neither: routes travel in the
    batch). The modes' meaning: ``mcore_engine.integrations.verl_router_replay``."""
    from mcore_engine.integrations.verl_router_replay import MODES

    block = getattr(e, "router_replay", None)
    if block is None:
        return "disabled"
    mode = getattr(block, "mode", None)
    _check(mode in MODES, "engine_config.router_replay.mode", mode, f"one of {list(MODES)}")
    for name in ("record_file", "replay_file"):
        _check(getattr(block, name, None) is None, f"engine_config.router_replay.{name}",
               getattr(block, name, None), "routes are recorded into and replayed from the batch "
               "(verl 0.9.1's engines read no routing file)")
    return mode


def _moe_from_verl(otc: dict[str, Any], model: Any, roots: dict[str, Any]) -> Any:
    """``override_transformer_config.moe_router_bias_update_rate`` (Megatron's name, as verl hands it to
    its Megatron engine) -> ``MoEConfig.router_bias_update_rate``: the aux-loss-free expert-bias update
    ``b += rate * sign(mean load - load)`` per step. Absent: 0 (the bias stays as loaded; verl's
    Megatron engine would take Megatron's 1e-3 for a checkpoint with an expert bias).
    ``moe_router_enable_expert_bias`` must say what the checkpoint has (``e_score_correction_bias``)."""
    rate, bias = otc.get("moe_router_bias_update_rate"), otc.get("moe_router_enable_expert_bias")
    for name, value in (("moe_router_bias_update_rate", rate), ("moe_router_enable_expert_bias", bias)):
        _check(value is None or model.moe is not None, f"engine_config.override_transformer_config.{name}",
               value, "a dense model has no router")
    if model.moe is None:
        return model
    _check(bias is None or bool(bias) == model.moe.router_expert_bias,
           "engine_config.override_transformer_config.moe_router_enable_expert_bias", bias,
           f"the expert bias comes from the checkpoint (e_score_correction_bias), which "
           f"{'has' if model.moe.router_expert_bias else 'has none'}")
    if rate is None:
        return model
    field = "engine_config.override_transformer_config.moe_router_bias_update_rate"
    _check(isinstance(rate, (int, float)) and not isinstance(rate, bool), field, rate, "a number >= 0")
    with in_verl_terms(**roots):  # no expert bias, negative rate: the core's message, verl's field
        moe = dataclasses.replace(model.moe, router_bias_update_rate=float(rate))
    return dataclasses.replace(model, moe=moe)


def _mtp_from_verl(m: Any, otc: dict[str, Any], model: Any, sources: dict[str, str], *, value: bool,
                   forward_only: bool) -> Any:
    """verl's MTP settings -> ``ModelConfig.mtp_num_layers`` / ``mtp_loss_scaling_factor`` with verl's
    rules (``check_mtp_config``): ``model_config.mtp.enable=False`` builds no MTP modules whatever the
    checkpoint has; ``enable=True`` builds the checkpoint's (``override_transformer_config.
    mtp_num_layers`` may only repeat their count) and ``enable_train=True`` trains them with
    ``mtp_loss_scaling_factor`` (``override_transformer_config``'s, else ``model_config.mtp``'s), else
    they are kept and not run. ``detach_encoder`` is refused. ``sources`` gets the factor's verl field."""
    block = _plain(getattr(m, "mtp", None))
    get = block.get if isinstance(block, dict) else (lambda k, d=None: getattr(block, k, d))
    enable, enable_train = bool(get("enable", False)), bool(get("enable_train", False))
    layers, factor = otc.get("mtp_num_layers"), otc.get("mtp_loss_scaling_factor")
    ckpt_layers = model.mtp_num_layers
    if not enable:
        _check(layers in (None, 0), "engine_config.override_transformer_config.mtp_num_layers", layers,
               "model_config.mtp.enable=false builds no MTP modules (verl's rule); set it true")
        _check(factor is None, "engine_config.override_transformer_config.mtp_loss_scaling_factor", factor,
               "model_config.mtp.enable=false builds no MTP modules to train")
        if ckpt_layers == 0 and model.mtp_loss_scaling_factor == 0:
            return model
        return dataclasses.replace(model, mtp_num_layers=0, mtp_loss_scaling_factor=0.0)
    _check(not value, "model_config.mtp.enable", True, "a value model (critic) has no lm-head to predict")
    _check(ckpt_layers > 0, "model_config.mtp.enable", True,
           "the checkpoint has no MTP layers (config.json num_nextn_predict_layers)")
    _check(layers is None or layers == ckpt_layers,
           "engine_config.override_transformer_config.mtp_num_layers", layers,
           f"the checkpoint has {ckpt_layers} MTP layers; the engine builds exactly those")
    _check(not get("detach_encoder", False), "model_config.mtp.detach_encoder", True,
           "the MTP loss reaches the shared embedding and the trunk (no detached encoder)")
    scale = factor if factor is not None else get("mtp_loss_scaling_factor", 0.1)
    field = ("engine_config.override_transformer_config.mtp_loss_scaling_factor" if factor is not None
             else "model_config.mtp.mtp_loss_scaling_factor")
    sources["model.mtp_loss_scaling_factor"] = f"{field}={scale!r}"
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        _refuse(field, scale, "a number >= 0")
    scale = scale if enable_train and not forward_only else 0.0
    with in_verl_terms(sources):
        return dataclasses.replace(model, mtp_num_layers=ckpt_layers, mtp_loss_scaling_factor=scale)


_RECOMPUTE_KEYS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")


def _recompute_from_verl(m: Any, e: Any) -> tuple[dict[str, Any], str]:
    """The core's recompute fields and the verl fields they come from (for error messages).

    ``engine_config.override_transformer_config.recompute_granularity`` (verl's Megatron engine's
    switch) wins, with its ``recompute_method`` / ``recompute_num_layers`` for ``"full"`` and
    ``recompute_modules`` for ``"selective"``; when it is null, ``model_config.
    enable_gradient_checkpointing=True`` means full recompute (by default uniform, one layer per
    unit: every layer keeps only its input ``[s, b, h]``)."""
    otc = dict(getattr(e, "override_transformer_config", None) or {})
    granularity = otc.get("recompute_granularity")
    if granularity is None:
        if not getattr(m, "enable_gradient_checkpointing", False):
            return {}, "model_config.enable_gradient_checkpointing"
        granularity, source = "full", "model_config.enable_gradient_checkpointing=True"
    else:
        source = f"engine_config.override_transformer_config.recompute_granularity={granularity!r}"
    out = {"recompute_granularity": granularity}
    keys = ("recompute_method", "recompute_num_layers") if granularity == "full" else ("recompute_modules",)
    for key in keys:
        if otc.get(key) is not None:
            out[key] = list(otc[key]) if key == "recompute_modules" else otc[key]
            source += f", engine_config.override_transformer_config.{key}={otc[key]!r}"
    if "layernorm" in (out.get("recompute_modules") or ()):
        from mcore_engine.model.build import has_te

        _check(has_te(), "engine_config.override_transformer_config.recompute_modules",
               out["recompute_modules"], "'layernorm' needs Transformer Engine (GPU); use core_attn / mlp")
    return out, source



def _optimizer_from_verl(o: Any, e: Any, roots: dict[str, Any]) -> CoreOptimizerConfig:
    """Adam(W) + warm-up + decay with verl's Megatron step rules: decay steps default to
    ``total_training_steps``; warm-up is ``lr_warmup_steps`` when > 0, else
    ``int(lr_warmup_steps_ratio * decay_steps)``."""
    _check(isinstance(o, OptimizerConfig) and type(o) in (OptimizerConfig, McoreOptimizerConfig),
           "optimizer_config", type(o).__name__, "use verl's McoreOptimizerConfig (or OptimizerConfig)")
    mcore = isinstance(o, McoreOptimizerConfig)
    style = o.lr_decay_style if mcore else "constant"
    if mcore:
        _check(o.optimizer in ("adam", "adamw"), "optimizer_config.optimizer", o.optimizer, "Adam(W) only")
        _check(o.lr_warmup_init == 0, "optimizer_config.lr_warmup_init", o.lr_warmup_init,
               "warm-up starts at 0")
        _check(o.weight_decay_incr_style == "constant", "optimizer_config.weight_decay_incr_style",
               o.weight_decay_incr_style, "constant weight decay only")
        _check(o.lr_wsd_decay_steps is None, "optimizer_config.lr_wsd_decay_steps", o.lr_wsd_decay_steps,
               "no WSD schedule")
        for name in ("use_precision_aware_optimizer", "use_layer_wise_distributed_optimizer"):
            _check(not getattr(o, name), f"optimizer_config.{name}", getattr(o, name), "not implemented")
        _check(not o.override_optimizer_config, "optimizer_config.override_optimizer_config",
               o.override_optimizer_config, "set the fields of OptimizerConfig instead")
    own_decay = mcore and o.lr_decay_steps is not None
    decay = o.lr_decay_steps if own_decay else o.total_training_steps
    warmup = o.lr_warmup_steps if o.lr_warmup_steps is not None and o.lr_warmup_steps > 0 else None
    if warmup is None:
        warmup = int((o.lr_warmup_steps_ratio or 0.0) * max(decay or 0, 0))
    decay_field = "optimizer_config." + ("lr_decay_steps" if own_decay else "total_training_steps")
    beta1, beta2 = o.betas
    with in_verl_terms({"optimizer.lr_decay_steps": f"{decay_field}={decay!r}"}, **roots):
        return CoreOptimizerConfig(lr=float(o.lr), min_lr=float(o.min_lr) if mcore else 0.0,
                                   adam_beta1=float(beta1), adam_beta2=float(beta2),
                                   weight_decay=float(o.weight_decay), clip_grad=float(o.clip_grad),
                                   lr_warmup_steps=int(warmup), lr_decay_style=style,
                                   lr_decay_steps=decay if style != "constant" else None,
                                   use_distributed_optimizer=bool(e.use_distributed_optimizer))

