"""verl's LoRA settings -> the core's ``LoRAConfig``: the Megatron-style ``lora`` block
(Megatron-Bridge's semantics) and the FSDP-style ``lora_rank`` fields (PEFT's); ``lora_merge`` reads
the weight-sync choice. Refusals name verl's field."""

from __future__ import annotations

import os
from typing import Any

from mcore_engine.config.lora import HF_PROJECTIONS, LoRAConfig
from mcore_engine.integrations.verl_fields import DTYPES, _check, _plain, _refuse, in_verl_terms

__all__ = ["lora_from_verl", "lora_merge"]

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
    with in_verl_terms({"model.lora": source}):  # e.g. alpha <= 0, dropout outside [0, 1)
        return LoRAConfig(**fields), source


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
    _check(lora_dtype is None or DTYPES.get(str(lora_dtype)) == DTYPES.get(dtype),
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
