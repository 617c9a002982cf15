"""The mapping of verl's configs onto the core's config.

:func:`engine_config_from_verl` maps every field of verl's model / engine / optimizer / checkpoint
configs with a meaning here onto an :class:`mcore_engine.EngineConfig` and raises ``ValueError``
naming the field for every setting the engine cannot honour; the fields in :data:`NOT_APPLICABLE`
have no meaning for this engine. :func:`lora_from_verl` maps verl's LoRA settings (the Megatron-style
``lora`` block and the FSDP-style ``lora_rank`` fields) onto the core's ``LoRAConfig``;
:func:`lora_merge` reads the weight-sync choice. MoE and MTP: :func:`router_replay_mode` checks
``router_replay`` (its modes: ``verl_router_replay``), ``override_transformer_config``'s
``moe_router_bias_update_rate`` / ``moe_router_enable_expert_bias`` map onto the core's expert bias and
verl's ``model_config.mtp`` (+ ``override_transformer_config.mtp_num_layers`` /
``mtp_loss_scaling_factor``) onto ``ModelConfig.mtp_num_layers`` / ``mtp_loss_scaling_factor``, with
verl's semantics (``_moe_from_verl`` / ``_mtp_from_verl``). The config classes that select the backend
(``McoreEngineVerlConfig`` / ``McoreEngineActorConfig``) live with the registered engines in
``mcore_engine.integrations.verl``.
"""

from __future__ import annotations

import os
import re
from typing import Any

from verl.workers.config.optimizer import McoreOptimizerConfig, OptimizerConfig

from mcore_engine import EngineConfig
from mcore_engine.config import OptimizerConfig as CoreOptimizerConfig
from mcore_engine.config import ParallelConfig
from mcore_engine.config.lora import HF_PROJECTIONS, LoRAConfig

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

_DTYPES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16"}
_CKPT_CONTENTS = {"model", "optimizer", "extra"}


def _refuse(field: str, value: Any, why: str) -> None:
    raise ValueError(f"{field}={value!r} is not supported by the mcore_engine backend: {why}")


def _check(ok: bool, field: str, value: Any, why: str) -> None:
    if not ok:
        _refuse(field, value, why)

# ------------------------------------------------------------------------------------------- config
def engine_config_from_verl(model_config: Any, engine_config: Any, optimizer_config: Any,
                            checkpoint_config: Any = None) -> EngineConfig:
    """The core :class:`EngineConfig` for verl's four config objects; ``ValueError`` naming the
    first field that cannot be honoured. Architecture from the HF ``config.json``
    (``mcore_engine.hf.from_hf_config``), weights from ``model_config.local_path``."""
    from mcore_engine.hf import from_hf_config, read_hf_config

    e, m, o = engine_config, model_config, optimizer_config
    _check(getattr(e, "strategy", None) == BACKEND, "engine_config.strategy", getattr(e, "strategy", None),
           f"build the engine block as McoreEngineVerlConfig (strategy={BACKEND!r})")
    # --- engine_config
    _check(e.dtype in _DTYPES, "engine_config.dtype", e.dtype, "use float32 or bfloat16")
    flags_off = {
        "dynamic_context_parallel": "context parallelism is static (context_parallel_size)",
        "full_determinism": "no deterministic-kernel mode",
        "pad_to_length": "micro-batches are packed to their own length",
        "use_dist_checkpointing": "initial weights come from model_config.path (HF)",
        "use_megatron_fsdp": "Megatron DDP / distributed optimizer only",
        "distrib_optim_fully_reshardable_mem_efficient": "not implemented",
    }
    for name, why in flags_off.items():
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
    replay = router_replay_mode(e)
    qat = getattr(e, "qat", None)
    _check(not getattr(qat, "enable", False), "engine_config.qat.enable", True,
           "no quantisation-aware training")
    _check(e.micro_batch_size_per_gpu is None or e.micro_batch_size_per_gpu >= 1,
           "engine_config.micro_batch_size_per_gpu", e.micro_batch_size_per_gpu, "must be >= 1")
    # --- model_config
    model_type = getattr(m, "model_type", "language_model")
    _check(model_type in ("language_model", "value_model"), "model_config.model_type", model_type,
           "language models and value models (critics) only")
    value = model_type == "value_model"
    for name in ("use_fused_kernels", "logits_chunk_size"):  # lm-head settings: a critic has no lm-head
        _check(not value or not getattr(e, name, None), f"engine_config.{name}", getattr(e, name, None),
               "a value model (model_type='value_model') has no lm-head")
    lora, lora_source = lora_from_verl(m, e.dtype, value_model=value)
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
    weights = getattr(m, "local_path", None) or getattr(m, "path", None)
    hf_dir = getattr(m, "local_hf_config_path", None) or weights
    try:
        model = from_hf_config(read_hf_config(hf_dir), hf_path=weights, head="value" if value else "lm",
                               fused_lm_head=bool(getattr(e, "use_fused_kernels", False)) and not value,
                               lora=lora)
    except ValueError as exc:  # the core's LoRA checks against the model (MoE experts): name verl's field
        if lora is None or "lora" not in str(exc).lower():
            raise
        raise ValueError(f"{lora_source} is not supported by the mcore_engine backend: {exc}") from exc
    forward_only = bool(getattr(e, "forward_only", False))
    _check(replay == "disabled" or (model.moe is not None and not value and not forward_only),
           "engine_config.router_replay.mode", replay,
           "a dense model has no routing to replay" if model.moe is None else
           "verl replays routing on the actor only (its reference policy and critic route natively)")
    model = _moe_from_verl(otc, model)
    model = _mtp_from_verl(m, otc, model, value=value, forward_only=forward_only)
    # --- optimizer_config (a reference policy may have none)
    optimizer = CoreOptimizerConfig() if forward_only and o is None else _optimizer_from_verl(o, e)
    # --- checkpoint_config
    if checkpoint_config is not None:
        c = checkpoint_config
        for name in ("save_contents", "load_contents"):
            contents = set(getattr(c, name, None) or _CKPT_CONTENTS)
            _check(_CKPT_CONTENTS <= contents and contents <= _CKPT_CONTENTS | {"hf_model"},
                   f"checkpoint_config.{name}", sorted(contents),
                   "model, optimizer and extra are always saved and loaded together (+ optional hf_model)")
        _check(not getattr(c, "async_save", False), "checkpoint_config.async_save", True, "no async save")
    parallel = {name: getattr(e, name) for name in _PARALLEL_FIELDS}
    recompute, recompute_source = _recompute_from_verl(m, e)
    try:
        layout = ParallelConfig(**parallel, sequence_parallel=bool(e.sequence_parallel),
                                cp_comm_type=otc.get("cp_comm_type", "p2p"))
        return EngineConfig(model=model, parallel=layout, optimizer=optimizer, precision=_DTYPES[e.dtype],
                            seed=int(e.seed), micro_batch_size=int(e.micro_batch_size_per_gpu or 1),
                            logits_chunk_size=getattr(e, "logits_chunk_size", None),
                            data_format="thd" if e.use_remove_padding else "bshd",
                            forward_only=forward_only, **recompute)
    except ValueError as exc:  # the core's checks name its own fields: name verl's too
        if "EngineConfig.recompute_" in str(exc):
            raise ValueError(f"{recompute_source} is not supported by the mcore_engine backend: "
                             f"{exc}") from exc
        named = [n for n in _PARALLEL_FIELDS if re.search(rf"(?<![A-Za-z_]){n}", str(exc))]
        named = [n for n in named if parallel[n] not in (None, 1)] or named
        if not named:
            raise
        fields = ", ".join(f"engine_config.{n}={parallel[n]!r}" for n in named)
        raise ValueError(f"{fields} is not supported by the mcore_engine backend: {exc}") from exc


# ---------------------------------------------------------------------------------------------- LoRA
# verl's Megatron-style block (hf_model.yaml `lora:`, Megatron-Bridge's LoRA settings); a key the
# block lacks takes verl's default from there
_VERL_LORA_DEFAULTS: dict[str, Any] = {
    "type": "lora", "merge": False, "rank": 0, "alpha": 32, "dropout": 0.0,
    "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "exclude_modules": [],
    "dropout_position": "pre", "lora_A_init_method": "xavier", "lora_B_init_method": "zero",
    "a2a_experimental": False, "dtype": None, "adapter_path": None, "freeze_vision_model": True,
    "freeze_vision_projection": True, "freeze_language_model": True, "fully_sharded_loras": False}
# Megatron-Bridge's canonical_lora names: one adapter per projection, the core's (and PEFT's) layout
_CANONICAL_TARGETS = {"linear_q": "q_proj", "linear_k": "k_proj", "linear_v": "v_proj",
                      "linear_proj": "o_proj", "linear_fc1_gate": "gate_proj", "linear_fc1_up": "up_proj",
                      "linear_fc2": "down_proj"}
# type "lora" puts ONE adapter on each named linear: on these single-projection linears that is the
# core's adapter exactly; on the fused linear_qkv / linear_fc1 (one A shared by q, k, v / gate, up) not
_SINGLE_PROJECTION_TARGETS = {"linear_proj": "o_proj", "linear_fc2": "down_proj"}
_FUSED_TARGETS = {"linear_qkv": "linear_q, linear_k, linear_v",
                  "linear_fc1": "linear_fc1_gate, linear_fc1_up"}
_LORA_INIT = {"lora_A_init_method": "kaiming", "lora_B_init_method": "zero"}  # Megatron-Bridge names


def _plain(value: Any) -> Any:
    """OmegaConf containers as plain dicts / lists (verl hands the lora block over either way)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _lora_block(m: Any) -> dict[str, Any]:
    return dict(_plain(getattr(m, "lora", None) or {}))


def lora_merge(model_config: Any) -> bool:
    """verl's ``model_config.lora.merge`` (read for both LoRA styles, as ``ActorRolloutRefWorker``
    reads it): True syncs merged weights to the rollout, False (verl's default) the base once and then
    the adapters with a PEFT config."""
    return bool(_lora_block(model_config).get("merge", False))


def lora_from_verl(m: Any, dtype: str, *, value_model: bool = False) -> tuple[LoRAConfig | None, str]:
    """The core's :class:`LoRAConfig` for verl's LoRA settings (None: LoRA off) and the verl field it
    came from (for error messages); ``ValueError`` naming the field for what cannot be honoured.

    LoRA is on as verl's trainer reads it (``ref_in_actor``): the Megatron-style ``lora.rank > 0``
    (the ``lora`` block: Megatron-Bridge's settings), else the FSDP-style ``lora_rank > 0`` or
    ``lora_adapter_path`` (``lora_alpha``, ``target_modules``: PEFT's settings; with an adapter
    folder its own ``adapter_config.json`` decides, as verl's FSDP engine's ``PeftModel.from_pretrained``).
    """
    block = _lora_block(m)
    unknown = sorted(set(block) - set(_VERL_LORA_DEFAULTS))
    _check(not unknown, "model_config.lora", unknown,
           f"unknown keys; verl 0.9.1's block has {sorted(_VERL_LORA_DEFAULTS)}")
    block = {**_VERL_LORA_DEFAULTS, **block}
    m_rank, f_rank = block["rank"] or 0, getattr(m, "lora_rank", 0) or 0
    f_path = getattr(m, "lora_adapter_path", None)
    for name, rank in (("model_config.lora.rank", m_rank), ("model_config.lora_rank", f_rank)):
        _check(isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0, name, rank,
               "an int >= 0 (0: no LoRA)")
    _check(isinstance(block["merge"], bool), "model_config.lora.merge", block["merge"], "true or false")
    if m_rank == 0 and f_rank == 0 and f_path is None:
        _check(block["adapter_path"] is None, "model_config.lora.adapter_path", block["adapter_path"],
               "needs model_config.lora.rank > 0 (verl's Megatron engine ignores the block at rank 0)")
        return None, ""
    if m_rank > 0:
        source = f"model_config.lora.rank={m_rank!r}"
    elif f_rank > 0:
        source = f"model_config.lora_rank={f_rank!r}"
    else:
        source = f"model_config.lora_adapter_path={f_path!r}"
    _check(not value_model, source.split("=")[0], m_rank or f_rank or f_path,
           "no LoRA critic (model_type='value_model': the value head would stay frozen with the base)")
    _check(not (m_rank > 0 and f_rank > 0), "model_config.lora_rank", f_rank,
           "set either the Megatron-style model_config.lora.rank or the FSDP-style lora_rank, not both")
    fields = _megatron_lora(block, f_path, dtype) if m_rank > 0 else _fsdp_lora(m, f_rank, f_path)
    try:
        return LoRAConfig(**fields), source
    except ValueError as exc:  # e.g. alpha <= 0, dropout outside [0, 1)
        raise ValueError(f"{source} is not supported by the mcore_engine backend: {exc}") from exc


def _megatron_lora(block: dict[str, Any], f_path: str | None, dtype: str) -> dict[str, Any]:
    """LoRAConfig fields from verl's Megatron-style ``lora`` block (Megatron-Bridge's semantics)."""
    kind = block["type"]
    _check(kind in ("lora", "canonical_lora"), "model_config.lora.type", kind,
           "plain LoRA only ('lora' or 'canonical_lora'); no DoRA, no VLM LoRA")
    names = block["target_modules"]
    names = [names] if isinstance(names, str) else names
    _check(isinstance(names, list) and names and all(isinstance(n, str) for n in names),
           "model_config.lora.target_modules", names, "a non-empty list of module names")
    targets: list[str] = []
    for name in names:
        if name in HF_PROJECTIONS:  # a projection by its Hugging Face name: one adapter on it
            targets.append(name)
        elif kind == "canonical_lora" and name in _CANONICAL_TARGETS:
            targets.append(_CANONICAL_TARGETS[name])
        elif kind == "lora" and name in _SINGLE_PROJECTION_TARGETS:
            targets.append(_SINGLE_PROJECTION_TARGETS[name])
        elif kind == "lora" and name in _FUSED_TARGETS:
            _refuse("model_config.lora.target_modules", names,
                    f"type 'lora' puts one fused adapter on {name} (one A shared by its projections); the "
                    f"core's adapters are per projection (Megatron-Bridge's canonical_lora, PEFT's layout): "
                    f"set model_config.lora.type=canonical_lora and name {_FUSED_TARGETS[name]} (the "
                    "packaged verl config's default), or Hugging Face projection names")
        else:
            known = sorted(_CANONICAL_TARGETS if kind == "canonical_lora" else _SINGLE_PROJECTION_TARGETS)
            _refuse("model_config.lora.target_modules", names,
                    f"unknown module {name!r} for type {kind!r} (no wildcards); expected {known} or "
                    f"{sorted(HF_PROJECTIONS)}")
    exclude = block["exclude_modules"] or []
    _check(not exclude, "model_config.lora.exclude_modules", exclude,
           "name the adapted linears in target_modules")
    dropout = block["dropout"] or 0.0
    _check(block["dropout_position"] == "pre" or not dropout, "model_config.lora.dropout_position",
           block["dropout_position"], "dropout applies to the adapter's input ('pre', PEFT's)")
    _check(not block["a2a_experimental"], "model_config.lora.a2a_experimental", True, "not implemented")
    lora_dtype = block["dtype"]
    _check(lora_dtype is None or _DTYPES.get(str(lora_dtype)) == _DTYPES.get(dtype),
           "model_config.lora.dtype", lora_dtype,
           f"the adapters are kept in the model's dtype (engine_config.dtype={dtype!r})")
    path = block["adapter_path"]
    _check(path is None or f_path is None or path == f_path, "model_config.lora_adapter_path", f_path,
           f"differs from model_config.lora.adapter_path={path!r}")
    path = path or f_path
    if path is None:  # fresh adapters: the core draws PEFT's (A kaiming-uniform(a=sqrt 5), B zero)
        for key, want in _LORA_INIT.items():
            _check(block[key] == want, f"model_config.lora.{key}", block[key],
                   "the core initialises the adapters as PEFT does: A kaiming-uniform(a=sqrt(5)), B zero "
                   "(Megatron-Bridge's lora_A_init_method='kaiming', lora_B_init_method='zero'; the "
                   "packaged verl config's default)")
    return dict(rank=block["rank"], alpha=float(block["alpha"]), dropout=float(dropout),
                target_modules=list(dict.fromkeys(targets)), adapter_path=path)


def _fsdp_lora(m: Any, rank: int, path: str | None) -> dict[str, Any]:
    """LoRAConfig fields from verl's FSDP-style fields (PEFT's semantics)."""
    for name in ("exclude_modules", "target_parameters"):
        value = _plain(getattr(m, name, None))
        _check(not value, f"model_config.{name}", value, "name the adapted projections in target_modules")
    if path is not None:  # verl's FSDP engine: PeftModel.from_pretrained, the folder's own config
        config = _peft_folder_config(path)
        rank, alpha, dropout = config.get("r"), config.get("lora_alpha"), config.get("lora_dropout") or 0.0
        names = config.get("target_modules")
        field = f"model_config.lora_adapter_path={path!r}: target_modules"
    else:
        alpha, dropout = getattr(m, "lora_alpha", 16), 0.0
        names, field = _plain(getattr(m, "target_modules", "all-linear")), "model_config.target_modules"
    if isinstance(names, (list, tuple, set)):
        names = sorted(names)
        bad = [n for n in names if n not in HF_PROJECTIONS]
        _check(names and not bad, field, names, f"PEFT module names of the adapted projections "
               f"{sorted(HF_PROJECTIONS)} (or 'all-linear')")
    else:
        _check(names == "all-linear", field, names, "'all-linear' or a list of projection names (no regex)")
    return dict(rank=rank, alpha=float(alpha), dropout=float(dropout), target_modules=names,
                adapter_path=path)


def _peft_folder_config(path: str) -> dict[str, Any]:
    import json

    config_file = os.path.join(path, "adapter_config.json")
    _check(os.path.isfile(config_file), "model_config.lora_adapter_path", path,
           "expected a local PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    with open(config_file) as f:
        config = json.load(f)
    _check(str(config.get("peft_type", "LORA")).upper() == "LORA", "model_config.lora_adapter_path", path,
           f"peft_type={config.get('peft_type')!r}: plain LoRA only")
    for flag in ("use_dora", "use_rslora"):
        _check(not config.get(flag), "model_config.lora_adapter_path", path, f"{flag}=true is not supported")
    return config


# ------------------------------------------------------------------------------- MoE routing and MTP
_MOE_KEYS = ("moe_router_bias_update_rate", "moe_router_enable_expert_bias")
_MTP_KEYS = ("mtp_num_layers", "mtp_loss_scaling_factor")
# verl's MtpConfig (model_config.mtp): what the engine honours; the rest configures the rollout's
# speculative decoding (vLLM / SGLang) and has no meaning for a training engine
_MTP_ENGINE_FIELDS = ("enable", "enable_train", "detach_encoder", "mtp_loss_scaling_factor")


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


def _moe_from_verl(otc: dict[str, Any], model: Any) -> Any:
    """``override_transformer_config.moe_router_bias_update_rate`` (Megatron's name, as verl hands it to
    its Megatron engine) -> ``MoEConfig.router_bias_update_rate``: the aux-loss-free expert-bias update
    ``b += rate * sign(mean load - load)`` per step. Absent: 0 (the bias stays as loaded; verl's
    Megatron engine would take Megatron's 1e-3 for a checkpoint with an expert bias).
    ``moe_router_enable_expert_bias`` must say what the checkpoint has (``e_score_correction_bias``)."""
    import dataclasses

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
    try:
        moe = dataclasses.replace(model.moe, router_bias_update_rate=float(rate))
    except ValueError as exc:  # no expert bias, negative rate: the core's message, verl's field
        raise ValueError(f"{field}={rate!r} is not supported by the mcore_engine backend: {exc}") from exc
    return dataclasses.replace(model, moe=moe)


def _mtp_from_verl(m: Any, otc: dict[str, Any], model: Any, *, value: bool, forward_only: bool) -> Any:
    """verl's MTP settings -> ``ModelConfig.mtp_num_layers`` / ``mtp_loss_scaling_factor``, with verl's
    semantics (``check_mtp_config``, its Megatron engine):

    - ``model_config.mtp.enable=False`` (default): no MTP modules (``mtp_num_layers=0``), whatever
      the checkpoint has; ``override_transformer_config.mtp_num_layers`` may then only be 0 / null,
      its ``mtp_loss_scaling_factor`` unset.
    - ``enable=True``: the checkpoint's MTP modules are loaded, exported and checkpointed (a
      checkpoint without them is refused); ``override_transformer_config.mtp_num_layers`` may only
      repeat their count. ``enable_train=True`` trains them with ``mtp_loss_scaling_factor``
      (``override_transformer_config``'s when set, else ``model_config.mtp``'s), otherwise they are
      kept and not run (factor 0: outputs equal a model without MTP), as on a forward-only engine.

    ``detach_encoder`` is refused (the MTP loss reaches the shared embedding and trunk); the
    speculative-decoding fields configure the rollout."""
    import dataclasses

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
    train = enable_train and not forward_only
    try:
        return dataclasses.replace(model, mtp_num_layers=ckpt_layers,
                                   mtp_loss_scaling_factor=float(scale) if train else 0.0)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{field}={scale!r} is not supported by the mcore_engine backend: {exc}") from exc


_PARALLEL_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "virtual_pipeline_model_parallel_size", "context_parallel_size",
                    "expert_model_parallel_size", "expert_tensor_parallel_size")
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


def _optimizer_from_verl(o: Any, e: Any) -> CoreOptimizerConfig:
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
        _check(style in ("constant", "cosine", "linear"), "optimizer_config.lr_decay_style", style,
               "constant, cosine or linear")
        _check(o.weight_decay_incr_style == "constant", "optimizer_config.weight_decay_incr_style",
               o.weight_decay_incr_style, "constant weight decay only")
        _check(o.lr_wsd_decay_steps is None, "optimizer_config.lr_wsd_decay_steps", o.lr_wsd_decay_steps,
               "no WSD schedule")
        for name in ("use_precision_aware_optimizer", "use_layer_wise_distributed_optimizer"):
            _check(not getattr(o, name), f"optimizer_config.{name}", getattr(o, name), "not implemented")
        _check(not o.override_optimizer_config, "optimizer_config.override_optimizer_config",
               o.override_optimizer_config, "set the fields of OptimizerConfig instead")
    decay = (o.lr_decay_steps if mcore and o.lr_decay_steps is not None else o.total_training_steps)
    warmup = o.lr_warmup_steps if o.lr_warmup_steps is not None and o.lr_warmup_steps > 0 else None
    if warmup is None:
        warmup = int((o.lr_warmup_steps_ratio or 0.0) * max(decay, 0))
    if style != "constant":
        _check(isinstance(decay, int) and decay > warmup, "optimizer_config.total_training_steps", decay,
               f"lr_decay_style={style!r} needs lr_decay_steps or total_training_steps > warm-up ({warmup})")
    beta1, beta2 = o.betas
    return CoreOptimizerConfig(lr=float(o.lr), min_lr=float(o.min_lr) if mcore else 0.0,
                               adam_beta1=float(beta1), adam_beta2=float(beta2),
                               weight_decay=float(o.weight_decay), clip_grad=float(o.clip_grad),
                               lr_warmup_steps=int(warmup), lr_decay_style=style,
                               lr_decay_steps=int(decay) if style != "constant" else None,
                               use_distributed_optimizer=bool(e.use_distributed_optimizer))

