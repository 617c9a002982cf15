"""PEFT LoRA adapter folders in and out: ``adapter_config.json`` + ``adapter_model.safetensors``.

Key names are PEFT's (``get_peft_model_state_dict``, adapter name dropped), per adapted projection
of global layer ``i``::

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight    # A [r, in], B [out, r]
    base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight
    base_model.model.model.layers.{i}.linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj}.lora_{A,B}.weight

(the last on the Gated DeltaNet layers of a Qwen3.5 model; its gated attention's ``q_proj`` adapter
has ``B [2 n d, r]``, per head ``[q_h; gate_h]`` as the weight). On a vision-language folder
(``Qwen2_5_VLForConditionalGeneration``, ``Qwen3VL(Moe)ForConditionalGeneration``,
``Qwen3_5(Moe)ForConditionalGeneration``) the decoder is ``model.language_model.layers``, and so are PEFT's
keys (Qwen2.5-VL's too, though its weight files say ``model.layers.*``):
``base_model.model.model.language_model.layers.{i}...`` (:func:`decoder_prefix`); the vision tower
takes no adapters. On a MoE model's layers with a shared expert the MLP projections are the shared
expert's: ``...layers.{i}.mlp.shared_expert.{gate,up,down}_proj...`` (:func:`shared_expert_layers`):
what PEFT's ``gate_proj`` / ``up_proj`` / ``down_proj`` adapt on Qwen3.5-MoE. On Qwen2-MoE / Qwen3-Next
PEFT 0.21 maps those names to the routed experts' fused 3-D parameters instead (``target_parameters``,
its transformers-v5 MoE conversion), so MLP targets there are refused (:func:`check_shared_expert_family`).
Qwen3-Next (:func:`fused_gdn`) keys its Gated DeltaNet input
adapters ``linear_attn.in_proj_qkvz`` / ``linear_attn.in_proj_ba``: one ``A`` each, ``B``'s rows in the
fused weight's per-key-head order; the engine holds them as the adapters of its ``in_proj_qkv`` +
``in_proj_z`` / ``in_proj_b`` + ``in_proj_a`` sharing that ``A`` (:func:`split_gdn_adapters`,
:func:`fuse_gdn_adapters`: ``B``'s rows by ``hf.hybrid.row_map``, as the weights).

what ``PeftModel.from_pretrained`` and vLLM's LoRA loader read. Tensors here are full (unsharded);
the engine gathers / slices them over TP. Memory: the adapters, which are small.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mcore_engine.config.lora import FUSED_GDN, GDN_LINEARS, HF_PROJECTIONS, PROJECTION_HF_NAMES, LoRAConfig
from mcore_engine.hf.families import is_multimodal
from mcore_engine.hf.folder import folder_format

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "TEXT_PREFIX", "VL_PREFIX", "check_gdn_family",
           "decoder_prefix", "fuse_gdn_adapters", "fused_gdn", "gdn_projection_shapes", "peft_config",
           "peft_key", "read_adapter", "check_shared_expert_family", "shared_expert_layers",
           "split_gdn_adapters", "write_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TEXT_PREFIX = "model."
VL_PREFIX = "model.language_model."
"""Where the decoder's ``layers`` sit in the Hugging Face model PEFT wraps: a ``*ForCausalLM``
(``model.layers``) or a Qwen3.5 ``*ForConditionalGeneration`` (``model.language_model.layers``)."""
_KEY = re.compile(r"base_model\.model\.(model\.(?:language_model\.)?)layers\.(\d+)\."
                  r"(self_attn|mlp|mlp\.shared_expert|linear_attn)\.(\w+)\.lora_([AB])\.weight")
_SUBMODULE = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn",
              "gate": "mlp", "up": "mlp", "down": "mlp",
              **{name: "linear_attn" for name in (*GDN_LINEARS, *FUSED_GDN)}}
_ROWS = {"in_proj_qkv": "next_qkv", "in_proj_z": "next_z", "in_proj_b": "next_b", "in_proj_a": "next_a"}
_FUSED_OF = {part: fused for fused, pair in FUSED_GDN.items() for part in pair}

_CLASS_KIND = {TEXT_PREFIX: "a *ForCausalLM model",
               VL_PREFIX: "a vision-language *ForConditionalGeneration model"}

Adapters = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
"""``(global layer, projection) -> (A [r, in], B [out, r])``, full tensors."""


def _submodule(layer: int, projection: str, shared_layers: Collection[int]) -> str:
    sub = _SUBMODULE[projection]
    return "mlp.shared_expert" if sub == "mlp" and layer in shared_layers else sub


def peft_key(layer: int, projection: str, which: str, prefix: str = TEXT_PREFIX,
             shared_layers: Collection[int] = ()) -> str:
    """PEFT's saved key of ``lora_A`` (``which="A"``) or ``lora_B`` of one projection; ``prefix``: the
    decoder's place (:func:`decoder_prefix`); ``shared_layers``: the layers whose MLP projections are a
    shared expert's (:func:`shared_expert_layers`)."""
    return (f"base_model.model.{prefix}layers.{layer}.{_submodule(layer, projection, shared_layers)}."
            f"{PROJECTION_HF_NAMES.get(projection, projection)}.lora_{which}.weight")


def fused_gdn(model: Any) -> bool:
    """Whether a hybrid ``ModelConfig``'s Hugging Face folder (``hf_path``) is Qwen3-Next's: fused
    ``in_proj_qkvz`` / ``in_proj_ba``."""
    if model.linear_attention is None or model.hf_path is None:
        return False
    from mcore_engine.hf.families import hf_family_of
    from mcore_engine.hf.hf_config import read_hf_config

    return hf_family_of(read_hf_config(model.hf_path)).hybrid == "fused"


def fuse_gdn_adapters(adapters: Adapters, model: Any) -> Adapters:
    """The engine's adapters with each layer's ``in_proj_qkv`` + ``in_proj_z`` (``in_proj_b`` +
    ``in_proj_a``) as Qwen3-Next's one ``in_proj_qkvz`` (``in_proj_ba``) adapter: their shared ``A``,
    ``B``'s rows placed as the fused weight's. ``ValueError`` for half a pair or two different ``A``."""
    from mcore_engine.hf.hybrid import row_map

    out = dict(adapters)
    for fused, pair in FUSED_GDN.items():
        for layer in sorted({layer for layer, p in adapters if p in pair}):
            got = [adapters.get((layer, p)) for p in pair]
            if any(ab is None for ab in got):
                raise ValueError(f"adapters: layer {layer} adapts one of {pair}, which Qwen3-Next holds as "
                                 f"one tensor ({fused}): adapt both")
            if not torch.equal(got[0][0], got[1][0]):
                raise ValueError(f"adapters: layer {layer} {pair} have different A; Qwen3-Next's {fused} "
                                 "adapter has one")
            perms = [row_map(_ROWS[p], model, 1) for p in pair]
            b = got[0][1].new_empty((sum(len(perm) for perm in perms), got[0][1].shape[1]))
            for (_, part), perm in zip(got, perms, strict=True):
                b[perm] = part
            for p in pair:
                del out[(layer, p)]
            out[(layer, fused)] = (got[0][0], b)
    return out


def split_gdn_adapters(adapters: Adapters, model: Any) -> Adapters:
    """Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` adapters as the engine's pairs (the one ``A``
    each, ``B``'s rows of each linear); the inverse of :func:`fuse_gdn_adapters`."""
    from mcore_engine.hf.hybrid import row_map

    out: Adapters = {}
    for (layer, p), (a, b) in adapters.items():
        for part in FUSED_GDN.get(p, (p,)):
            out[(layer, part)] = (a, b[row_map(_ROWS[part], model, 1)] if p in FUSED_GDN else b)
    return out


def shared_expert_layers(model: Any) -> list[int]:
    """The layers of a ``ModelConfig`` whose MLP is a MoE with a shared expert (where LoRA's MLP
    projections go)."""
    moe = model.moe
    if moe is None or moe.shared_expert_ffn_hidden_size is None:
        return []
    return [i for i, is_moe in enumerate(moe.layer_pattern(model.num_layers)) if is_moe]


def decoder_prefix(hf_path: str | os.PathLike | None) -> str:
    """:data:`VL_PREFIX` when the base folder at ``hf_path`` is a vision-language folder (its decoder
    ``model.language_model.*`` in ``transformers``' model, whatever its weight files say: Qwen2.5-VL's
    hold ``model.layers.*``), else :data:`TEXT_PREFIX`."""
    if folder_format(hf_path).prefix:
        return VL_PREFIX
    config = Path(hf_path) / "config.json" if hf_path else None
    try:
        multimodal = config is not None and config.is_file() and is_multimodal(json.loads(config.read_text()))
    except (OSError, json.JSONDecodeError):
        multimodal = False
    return VL_PREFIX if multimodal else TEXT_PREFIX


def peft_config(lora: LoRAConfig, *, swiglu: bool, hybrid: bool = False,
                fused: bool = False) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` fields for ``lora`` (``peft_type`` / ``task_type`` as strings); ``hybrid``:
    the model has Gated DeltaNet layers; ``fused``: Qwen3-Next's (:func:`fused_gdn`)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": lora.hf_target_modules(swiglu, hybrid, fused),
            "bias": "none"}


def write_adapter(out_dir: str | os.PathLike, adapters: Adapters, lora: LoRAConfig, *, swiglu: bool,
                  base_model: str | None, dtype: torch.dtype, hybrid: bool = False,
                  prefix: str = TEXT_PREFIX, shared_layers: Collection[int] = (), fused: Any = None) -> None:
    """Write a PEFT folder (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules`` from ``lora``;
    ``hybrid``: the model has Gated DeltaNet layers; ``prefix`` / ``shared_layers``: as :func:`peft_key`;
    ``fused``: the ``ModelConfig`` of a Qwen3-Next model, whose GDN pairs are written fused)."""
    if fused is not None:
        adapters = fuse_gdn_adapters(adapters, fused)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, projection), (a, b) in sorted(adapters.items()):
        for which, t in (("A", a), ("B", b)):
            key = peft_key(layer, projection, which, prefix, shared_layers)
            tensors[key] = t.detach().to("cpu", dtype).contiguous()
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {**peft_config(lora, swiglu=swiglu, hybrid=hybrid, fused=fused is not None),
              "base_model_name_or_path": base_model,
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
              "inference_mode": True, "modules_to_save": None, "layers_to_transform": None,
              "rank_pattern": {}, "alpha_pattern": {}}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def read_adapter(path: str | os.PathLike, lora: LoRAConfig, *, swiglu: bool, num_layers: int,
                 shapes: Mapping[str, tuple[int, int]], gdn_layers: Collection[int] = (),
                 prefix: str = TEXT_PREFIX, shared_layers: Collection[int] = (),
                 shared_shapes: Mapping[str, tuple[int, int]] | None = None, fused: Any = None) -> Adapters:
    """The adapters of a PEFT folder, checked against ``lora`` (rank, alpha, target modules) and the
    model (``num_layers``, ``shapes[projection] = (out, in)``, ``gdn_layers``: the Gated DeltaNet
    layers of a hybrid model, which hold the GDN projections, the others the attention ones;
    ``prefix``: where the base's decoder is, :func:`decoder_prefix`, every key's; ``shared_layers``: the
    layers whose MLP adapters are a shared expert's, of ``shared_shapes[projection]``; ``fused``: the
    ``ModelConfig`` of a Qwen3-Next model, whose folder holds the GDN pairs fused, returned split):
    ``ValueError`` naming ``LoRAConfig.adapter_path`` and the mismatch, before anything is loaded."""
    hybrid = bool(gdn_layers)
    folder = Path(path)
    where = f"LoRAConfig.adapter_path {str(folder)!r}"
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{where}: expected a PEFT folder with {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    config: dict[str, Any] = json.loads((folder / ADAPTER_CONFIG).read_text())
    checks = [("peft_type", config.get("peft_type"), "LORA"), ("r", config.get("r"), lora.rank),
              ("lora_alpha", config.get("lora_alpha"), lora.alpha),
              ("target_modules", sorted(config.get("target_modules") or []),
               lora.hf_target_modules(swiglu, hybrid, fused is not None))]
    for name, theirs, ours in checks:
        if theirs != ours and not (isinstance(ours, float) and theirs is not None and float(theirs) == ours):
            raise ValueError(f"{where}: adapter_config.json has {name}={theirs!r}, the engine's LoRAConfig "
                             f"gives {ours!r}")
    for name in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(name):
            raise ValueError(f"{where}: adapter_config.json {name}=true is not supported")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise ValueError(f"{where}: adapter biases / modules_to_save are not supported")
    for name in ("rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern"):
        if config.get(name):  # per-module ranks / alphas or a layer subset: one rank / alpha here
            raise ValueError(f"{where}: adapter_config.json {name}={config[name]!r} is not supported "
                             "(one rank and alpha for every adapted module of every layer)")
    wanted = {(layer, p) for layer in range(num_layers) for linear, ps in lora.targets(swiglu, hybrid).items()
              for p in ps if _SUBMODULE[p] == "mlp" or (layer in gdn_layers) == (linear in GDN_LINEARS)}
    if fused is not None:
        wanted = {(layer, _FUSED_OF.get(p, p)) for layer, p in wanted}
        shapes = {**shapes, **{f: (shapes[a][0] + shapes[b][0], shapes[a][1])
                               for f, (a, b) in FUSED_GDN.items()}}
    known = {**{name: p for name, (_, p) in HF_PROJECTIONS.items()},
             **({f: f for f in FUSED_GDN} if fused is not None else {})}
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(folder / ADAPTER_WEIGHTS), framework="pt") as f:
        for key in f.keys():
            match = _KEY.fullmatch(key.replace(".default.", "."))
            if key.startswith("base_model.model.model.visual."):
                raise ValueError(f"{where}: {key!r} adapts the vision tower, which the engine keeps out "
                                 "(target the language model's linears only)")
            if match is None or match.group(4) not in known \
                    or _submodule(int(match.group(2)), known[match.group(4)],
                                  shared_layers) != match.group(3):
                raise ValueError(f"{where}: unexpected tensor {key!r}")
            if match.group(1) != prefix:
                raise ValueError(f"{where}: {key!r} has its decoder at '{match.group(1)}layers', the base "
                                 f"folder (ModelConfig.hf_path) at '{prefix}layers': an adapter of "
                                 f"{_CLASS_KIND[match.group(1)]} on a base of {_CLASS_KIND[prefix]}")
            projection = known[match.group(4)]
            found.setdefault((int(match.group(2)), projection), {})[match.group(5)] = f.get_tensor(key)
    if set(found) != wanted:
        missing, extra = sorted(wanted - set(found))[:3], sorted(set(found) - wanted)[:3]
        raise ValueError(f"{where}: adapters do not match the model's layers / target modules "
                         f"(missing {missing}, unexpected {extra})")
    out: Adapters = {}
    for (layer, projection), ab in found.items():
        out_dim, in_dim = (shared_shapes if layer in shared_layers and shared_shapes
                           and projection in shared_shapes else shapes)[projection]
        a, b = ab.get("A"), ab.get("B")
        got = [None if t is None else tuple(t.shape) for t in (a, b)]
        if got != [(lora.rank, in_dim), (out_dim, lora.rank)]:
            raise ValueError(f"{where}: layer {layer} {PROJECTION_HF_NAMES.get(projection, projection)} has "
                             "lora_A / lora_B "
                             f"shapes {got[0]} / {got[1]}, expected ({lora.rank}, {in_dim}) / "
                             f"({out_dim}, {lora.rank})")
        out[(layer, projection)] = (a, b)
    return out if fused is None else split_gdn_adapters(out, fused)


SHARED_EXPERT_LORA_FAMILIES = ("qwen3_5_moe_text",)
"""Families whose PEFT ``gate_proj`` / ``up_proj`` / ``down_proj`` adapt the shared expert (PEFT leaves the
fused experts alone); on the other MoE families PEFT targets the routed experts with those names."""


def check_shared_expert_family(model: Any) -> None:
    """``ValueError`` for MLP targets on a MoE ``ModelConfig`` whose Hugging Face folder is not of
    :data:`SHARED_EXPERT_LORA_FAMILIES`: PEFT would adapt the routed experts there, the engine the shared
    expert, and the adapters would not be the same model."""
    if model.lora is None or model.moe is None or model.hf_path is None:
        return
    targets = model.lora.targets(model.swiglu, model.linear_attention is not None)
    if not {"linear_fc1", "linear_fc2"} & set(targets):
        return
    from mcore_engine.hf.families import hf_family_of
    from mcore_engine.hf.hf_config import read_hf_config

    family = hf_family_of(read_hf_config(model.hf_path)).model_type
    if family not in SHARED_EXPERT_LORA_FAMILIES:
        raise ValueError(f"ModelConfig.lora.target_modules: MLP projections on a {family} MoE model: PEFT "
                         "adapts the routed experts there (its fused-expert target_parameters), which the "
                         "engine does not support; target the attention (and Gated DeltaNet) linears")


def gdn_projection_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """``projection -> (out, in)`` of a hybrid ``ModelConfig``'s Gated DeltaNet linears (full, HF's
    orientation)."""
    g, h = model.linear_attention, model.hidden_size
    return {"in_proj_qkv": (2 * g.key_dim + g.value_dim, h), "in_proj_z": (g.value_dim, h),
            "in_proj_b": (g.num_value_heads, h), "in_proj_a": (g.num_value_heads, h),
            "out_proj": (h, g.value_dim)}


def check_gdn_family(model: Any) -> None:
    """``ValueError`` when the LoRA of a hybrid ``ModelConfig`` cannot be written as PEFT keys of its
    Hugging Face folder: on Qwen3-Next one of a fused pair (``in_proj_qkv`` + ``in_proj_z``,
    ``in_proj_b`` + ``in_proj_a``: one PEFT adapter ``in_proj_qkvz`` / ``in_proj_ba``, one ``A``) without
    the other, or a pair with dropout (PEFT's one mask); ``in_proj_qkvz`` / ``in_proj_ba`` named on a
    Qwen3.5-layout folder."""
    if model.lora is None or model.linear_attention is None or model.hf_path is None:
        return
    from mcore_engine.hf.families import hf_family_of
    from mcore_engine.hf.hf_config import read_hf_config

    targets = set(model.lora.targets(model.swiglu, True))
    named = model.lora.target_modules if isinstance(model.lora.target_modules, list) else []
    if hf_family_of(read_hf_config(model.hf_path)).hybrid != "fused":
        if set(named) & set(FUSED_GDN):
            raise ValueError(f"ModelConfig.lora.target_modules: {sorted(set(named) & set(FUSED_GDN))} are "
                             "Qwen3-Next's fused projections; this folder's are in_proj_qkv / in_proj_z / "
                             "in_proj_b / in_proj_a")
        return
    for fused, pair in FUSED_GDN.items():
        if len(targets & set(pair)) == 1:
            raise ValueError(f"ModelConfig.lora.target_modules: {sorted(targets & set(pair))} without "
                             f"{sorted(set(pair) - targets)} on a Qwen3-Next model, whose PEFT adapter "
                             f"{fused} covers both (target {fused!r})")
        if targets >= set(pair) and model.lora.dropout:
            raise ValueError(f"ModelConfig.lora.dropout={model.lora.dropout}: Qwen3-Next's {fused} adapter "
                             "(one A on two engine linears) needs dropout 0")
