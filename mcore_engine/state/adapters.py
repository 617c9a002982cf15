"""LoRA in the engine (``ModelConfig.lora``): :func:`attach_lora` freezes the base (no grad buffer, no
optimizer state), applies the adapters and loads ``adapter_path``;
:func:`gather_adapters` / :func:`iter_adapter_tensors` give the full adapters (collective over TP and
PP); :func:`merged_weight_overrides` the merged ``W + scaling B A`` for exports. Memory: the adapters;
one merged weight at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mcore_engine.config import EngineConfig
from mcore_engine.config.lora import FUSED_GDN
from mcore_engine.hf.peft import (
    TEXT_PREFIX,
    Adapters,
    check_gdn_family,
    check_shared_expert_family,
    decoder_prefix,
    fuse_gdn_adapters,
    fused_gdn,
    gdn_projection_shapes,
    peft_key,
    read_adapter,
    shared_expert_layers,
)
from mcore_engine.layers.lora import (
    adapter_shards,
    apply_lora,
    load_adapters,
    lora_modules,
    sum_partial_adapter_grads,  # lives with the LoRA layers; importable from here as before
)

__all__ = ["attach_lora", "gather_adapters", "iter_adapter_tensors", "merged_weight_overrides",
           "sum_partial_adapter_grads"]


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


def attach_lora(chunks: Sequence[torch.nn.Module], cfg: EngineConfig) -> None:
    """Freeze the base and put the adapters on every (unwrapped) chunk; load ``adapter_path``."""
    m, lora = cfg.model, cfg.model.lora
    hybrid = m.linear_attention is not None
    pattern = m.linear_attention.layer_pattern(m.num_layers) if hybrid else []
    gdn_layers = [i for i, is_gdn in enumerate(pattern) if is_gdn]
    check_gdn_family(m)
    check_shared_expert_family(m)
    fused = fused_gdn(m)  # Qwen3-Next: in_proj_qkv + in_proj_z (in_proj_b + in_proj_a) share one A
    adapters = None
    if lora.adapter_path is not None:  # read and checked before anything changes
        adapters = read_adapter(lora.adapter_path, lora, swiglu=m.swiglu, num_layers=m.num_layers,
                                shapes=_projection_shapes(cfg), gdn_layers=gdn_layers,
                                prefix=decoder_prefix(m.hf_path), shared_layers=shared_expert_layers(m),
                                shared_shapes=_shared_expert_shapes(cfg), fused=m if fused else None)
    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
        apply_lora(chunk, rank=lora.rank, alpha=lora.alpha, targets=lora.targets(m.swiglu, hybrid),
                   seed=cfg.seed, dropout=lora.dropout, swiglu=m.swiglu,
                   shared_a=FUSED_GDN.values() if fused else ())
        if getattr(chunk, "embedding", None) is not None:
            # the frozen embedding's output does not require grad: activation recompute (Megatron's
            # checkpoint of a block whose inputs need no grad) would give the adapters in it none
            chunk.embedding.register_forward_hook(_require_grad)
    if adapters is not None:
        load_adapters(chunks, adapters)


def _require_grad(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: the output requires grad (HF's ``enable_input_require_grads``)."""
    return output.requires_grad_(True) if torch.is_grad_enabled() and not output.requires_grad else output


def _projection_shapes(cfg: EngineConfig) -> dict[str, tuple[int, int]]:
    """``projection -> (out, in)`` of the full (TP = 1) weights, Hugging Face's orientation."""
    m = cfg.model
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    h, f = m.hidden_size, m.ffn_size
    q = m.num_attention_heads * d * (2 if m.attention_output_gate else 1)  # gated: per head [q_h; gate_h]
    shapes = {"q": (q, h), "k": (m.query_groups * d, h), "v": (m.query_groups * d, h),
              "o": (h, m.num_attention_heads * d), "gate": (f, h), "up": (f, h), "down": (h, f)}
    if m.linear_attention is not None:
        shapes.update(gdn_projection_shapes(m))
    return shapes


def _shared_expert_shapes(cfg: EngineConfig) -> dict[str, tuple[int, int]] | None:
    """``projection -> (out, in)`` of a MoE model's shared expert MLP; None without one."""
    moe, h = cfg.model.moe, cfg.model.hidden_size
    if moe is None or moe.shared_expert_ffn_hidden_size is None:
        return None
    f = moe.shared_expert_ffn_hidden_size
    return {"gate": (f, h), "up": (f, h), "down": (h, f)}


def _gather_dim(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    group = parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    if dim is None or size == 1:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def gather_adapters(model_chunks: Sequence[torch.nn.Module]) -> Adapters:
    """Every adapted projection's full ``(A [r, in], B [out, r])`` on every rank, keyed ``(global
    layer, projection)``, on the CPU in the parameters' dtype. Collective over TP and PP."""
    shards = adapter_shards([_unwrap(c) for c in model_chunks])
    local: Adapters = {key: (_gather_dim(s.a, s.a_tp_dim).cpu(), s.full_b(_gather_dim(s.b, s.b_tp_dim)).cpu())
                       for key, s in shards.items()}
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp_group) == 1:
        return local
    stages: list[Adapters | None] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, local, group=pp_group)
    return {k: v for stage in stages for k, v in stage.items()}


def iter_adapter_tensors(model_chunks: Sequence[torch.nn.Module], dtype: torch.dtype | None = None,
                         prefix: str = TEXT_PREFIX, shared_layers: Sequence[int] = (), fused: Any = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(PEFT key, full tensor)`` of every adapter in key order (``lora_A`` then ``lora_B`` per
    projection); collective over TP and PP (gathers first). ``dtype`` None: the parameters';
    ``prefix``: the decoder's place in the base folder (``hf.peft.decoder_prefix``: the
    ``model.language_model.`` of a vision-language folder); ``shared_layers``: the layers whose MLP
    adapters are a shared expert's (``hf.peft.shared_expert_layers``); ``fused``: the ``ModelConfig`` of
    a Qwen3-Next model (its GDN pairs streamed as one fused adapter each, ``hf.peft.fuse_gdn_adapters``)."""
    adapters = gather_adapters(model_chunks)
    if fused is not None:
        adapters = fuse_gdn_adapters(adapters, fused)
    for (layer, projection), (a, b) in sorted(adapters.items()):
        for which, t in (("A", a), ("B", b)):
            key = peft_key(layer, projection, which, prefix, shared_layers)
            yield key, t if dtype is None else t.to(dtype)


def merged_weight_overrides(model_chunks: Sequence[torch.nn.Module]
                            ) -> dict[int, Callable[[], torch.Tensor]]:
    """``id(base weight) -> merged_weight`` (this rank's ``W + scaling B A``) for every LoRA linear."""
    return {id(module.weight): module.merged_weight
            for _, module in lora_modules([_unwrap(c) for c in model_chunks])}
