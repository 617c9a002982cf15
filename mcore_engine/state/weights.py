"""The engine's weights out, in Hugging Face names: tensors, buckets and folders, with LoRA merged
(``W + scaling B A``), or the LoRA adapters alone in PEFT key names. Collective over TP and PP."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from mcore_engine.config import EngineConfig
from mcore_engine.hf import export_hf, iter_hf_tensors
from mcore_engine.hf.export import precision_dtype
from mcore_engine.hf.peft import decoder_prefix, fused_gdn, shared_expert_layers, write_adapter
from mcore_engine.state.adapters import gather_adapters, iter_adapter_tensors, merged_weight_overrides
from mcore_engine.weight_sync import BucketMeta, bucket_named_tensors, iter_weight_buckets

__all__ = ["require_lora", "weight_buckets", "weight_tensors", "write_adapter_folder", "write_hf_folder"]


def require_lora(config: EngineConfig, what: str) -> None:
    """``ValueError`` unless ``config`` has LoRA adapters."""
    if config.model.lora is None:
        raise ValueError(f"{what} needs LoRA adapters: set EngineConfig.model.lora")


def _peft_names(config: EngineConfig) -> dict[str, Any]:
    """Where the PEFT keys of the model's adapters go (``hf.peft``): the decoder's prefix in the base
    folder, the shared-expert layers, Qwen3-Next's fused GDN adapters."""
    m = config.model
    return {"prefix": decoder_prefix(m.hf_path), "shared_layers": shared_expert_layers(m),
            "fused": m if fused_gdn(m) else None}


def _merged(chunks: list[torch.nn.Module], config: EngineConfig) -> dict | None:
    return merged_weight_overrides(chunks) if config.model.lora is not None else None


def weight_tensors(chunks: list[torch.nn.Module], config: EngineConfig, dtype: torch.dtype | None,
                   adapter_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` of the model (MoE expert biases kept fp32) or of its adapters."""
    if adapter_only:
        require_lora(config, "per_tensor_generator(adapter_only=True)")
        return iter_adapter_tensors(chunks, dtype=dtype or precision_dtype(config), **_peft_names(config))
    return iter_hf_tensors(chunks, config, dtype=dtype, overrides=_merged(chunks, config), keep_fp32=True)


def weight_buckets(chunks: list[torch.nn.Module], config: EngineConfig, bucket_bytes: int,
                   dtype: torch.dtype | None, adapter_only: bool
                   ) -> Iterator[tuple[torch.Tensor, BucketMeta]]:
    """:func:`weight_tensors` packed into ``(bucket, meta)`` (:mod:`mcore_engine.weight_sync`)."""
    if adapter_only:
        require_lora(config, "bucketed_weight_generator(adapter_only=True)")
        named = list(iter_adapter_tensors(chunks, dtype=dtype or precision_dtype(config),
                                          **_peft_names(config)))
        return bucket_named_tensors(named, bucket_bytes)
    return iter_weight_buckets(chunks, config, bucket_bytes, dtype=dtype, overrides=_merged(chunks, config))


def write_hf_folder(chunks: list[torch.nn.Module], config: EngineConfig, out_dir: str | os.PathLike,
                    **kwargs: Any) -> None:
    """The model as a Hugging Face folder (:func:`mcore_engine.hf.export_hf`), LoRA merged."""
    export_hf(chunks, config, out_dir, overrides=_merged(chunks, config), **kwargs)


def write_adapter_folder(chunks: list[torch.nn.Module], config: EngineConfig, out_dir: str | os.PathLike,
                         dtype: torch.dtype | None) -> None:
    """The adapters as a PEFT folder, written by global rank 0; the other ranks wait for it."""
    require_lora(config, "export_adapter")
    adapters = gather_adapters(chunks)
    if not dist.is_initialized() or dist.get_rank() == 0:
        m = config.model
        write_adapter(out_dir, adapters, m.lora, swiglu=m.swiglu, hybrid=m.linear_attention is not None,
                      base_model=m.hf_path, dtype=dtype or precision_dtype(config),
                      **_peft_names(config))
    if dist.is_initialized():
        dist.barrier()
