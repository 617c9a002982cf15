"""Export the TP/PP-sharded GPTModel chunks as Hugging Face tensors, streamed or to a folder.

``iter_hf_tensors`` is a collective over the model-parallel group (every rank consumes it to the
end): per parameter, the owning stage all-gathers the shard over TP (``torch.cat(all_gather(shard),
dim=tp_dim)``; routed experts: over expert TP on the expert-parallel rank that holds the expert,
then broadcast over EP), rebuilds the Hugging Face tensors (``layout.hf_from_gathered``) and, with
PP > 1, broadcasts them. Memory: one gathered parameter and its tensors at a time; yielded tensors may share
storage with parameters (copy them to keep them past an update).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mcore_engine.config import EngineConfig
from mcore_engine.hf.checkpoint_io import HFCheckpointReader, ShardedSafetensorsWriter
from mcore_engine.hf.folder import folder_stream, kept_out_names, model_format
from mcore_engine.hf.hf_config import read_hf_config, to_hf_config
from mcore_engine.hf.hybrid import assemble_parts, row_map
from mcore_engine.hf.layout import gathered_names, hf_from_gathered
from mcore_engine.hf.mapping import hf_shapes, iter_units, model_units, unit_rule
from mcore_engine.hf.mtp_names import mtp_aliases


def precision_dtype(cfg: EngineConfig) -> torch.dtype:
    """The parameter dtype of ``cfg.precision`` (the default dtype of exported tensors)."""
    return torch.bfloat16 if cfg.precision == "bf16" else torch.float32


def _gather_tp(t: torch.Tensor, dim: int | None, group, size: int) -> torch.Tensor:
    if dim is None or size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _owners(local_keys: dict[str, str], pp_group, pp_size: int) -> list[dict[str, str]]:
    """Per pipeline rank: {stage key: dtype name} of the units it holds (one all_gather_object)."""
    if pp_size == 1:
        return [local_keys]
    gathered: list = [None] * pp_size
    dist.all_gather_object(gathered, local_keys, group=pp_group)
    return gathered


def _stage_key(unit: str) -> str:
    """``unit`` with its expert index replaced by ``*``: the key every expert-parallel rank of the
    stage that holds the layer shares."""
    return re.sub(r"\.local_experts\.\d+\.", ".local_experts.*.", unit)


def iter_hf_tensors(model_chunks: Sequence[torch.nn.Module], cfg: EngineConfig, *,
                    dtype: torch.dtype | None = None,
                    overrides: Mapping[int, Callable[[], torch.Tensor]] | None = None,
                    keep_fp32: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for the whole model in checkpoint order, in the names and expert layout of
    the folder ``cfg.model.hf_path`` (``hf.folder``: a vision-language folder's ``model.language_model.``
    prefix, fused experts; without a folder the released folders' of ``cfg.model.vision``), the vision
    tower first when the model has one (``cfg.model.vision``; else, as the MTP weights without
    ``mtp_num_layers``, not part of the stream), on the
    parameters' device, in ``dtype`` (None: ``cfg.precision``; fp32 norms of a bf16 model are cast;
    ``keep_fp32``: the tensors of ``TensorRule.fp32`` rules, the expert biases, stay fp32). Collective
    over the tensor-, pipeline- and (MoE) expert-parallel groups.

    A routed expert's weight is gathered over the expert-tensor-parallel group on the
    expert-parallel rank that holds it and broadcast over the expert-parallel group. No yielded
    tensor shares storage with a parameter (unsharded ones are copied). ``overrides``: ``id(param) ->
    callable`` giving the local tensor to export instead (LoRA's merged weights). Memory: one full
    tensor (fused experts: one layer's).
    """
    moe = cfg.model.moe
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    stream = _iter_engine_tensors(model_chunks, cfg, dtype=dtype, overrides=overrides, keep_fp32=keep_fp32)
    return folder_stream(assemble_parts(stream, cfg.model, tp_size), model_format(cfg.model),
                         moe.num_experts if moe is not None else 0)


def _iter_engine_tensors(model_chunks: Sequence[torch.nn.Module], cfg: EngineConfig, *,
                         dtype: torch.dtype | None = None,
                         overrides: Mapping[int, Callable[[], torch.Tensor]] | None = None,
                         keep_fp32: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`iter_hf_tensors` in the engine's names (``model.layers.*``, one tensor per expert;
    Qwen3-Next's parts ``"{name}#{kind}"``: ``hybrid.assemble_parts``)."""
    model_cfg = cfg.model
    dtype = dtype or precision_dtype(cfg)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    moe = model_cfg.moe
    if moe is not None:
        etp_group = parallel_state.get_expert_tensor_parallel_group()
        etp_size = parallel_state.get_expert_tensor_parallel_world_size()
        ep_group = parallel_state.get_expert_model_parallel_group()
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        ep_rank = parallel_state.get_expert_model_parallel_rank()

    # storages of live parameters: a yielded tensor never shares one (a receiver may keep, modify
    # or .numpy() it, which would pin the storage and break offload)
    live = {p.untyped_storage()._cdata for chunk in model_chunks for p in chunk.parameters()}
    local: dict[str, tuple[torch.nn.Parameter, object]] = {}
    for chunk in model_chunks:
        for unit, param, rule in iter_units(chunk, model_cfg):
            if not (unit == "output_layer.weight" and model_cfg.tie_word_embeddings):
                local[unit] = (param, rule)
    mine = {_stage_key(unit): str(param.dtype).removeprefix("torch.") for unit, (param, _) in local.items()}
    owners = _owners(mine, pp_group, pp_size)
    owner = {}
    for rank, held in enumerate(owners):
        for key in held:
            owner.setdefault(key, rank)
    shapes = hf_shapes(model_cfg)
    if local:
        device = next(iter(local.values()))[0].device
    else:  # a stage without parameters still receives the broadcasts
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"

    def receive(name: str, key: str, src: int) -> torch.Tensor:
        if "#" in name:  # a part of a Qwen3-Next tensor: its TP-gathered engine rows
            hf_name, kind = name.split("#")
            shape = (row_map(kind, model_cfg, tp_size).numel(), *shapes[hf_name][1:])
        else:
            shape = shapes[name]
        return torch.empty(shape, dtype=getattr(torch, owners[src][key]), device=device)

    for unit in model_units(model_cfg):
        key = _stage_key(unit)
        if key not in owner:
            raise ValueError(f"model_chunks: no pipeline stage holds {unit!r}; cfg.model does not match "
                             "the model")
        src = owner[key]
        rule = unit_rule(unit, model_cfg)
        if src != pp_rank:
            tensors = [(name, None) for name in gathered_names(rule)]
        elif not rule.expert:
            param, rule = local[unit]
            value = overrides[id(param)]() if overrides and id(param) in overrides else param.detach()
            full = _gather_tp(value, rule.tp_dim, tp_group, tp_size)
            tensors = hf_from_gathered(rule, full, model_cfg, tp_size)
        else:  # --- a routed expert: ETP gather on its EP rank, EP broadcast ---
            holder = int(unit.split(".")[6]) // (moe.num_experts // ep_size)
            if holder == ep_rank:
                param, rule = local[unit]
                full = _gather_tp(param.detach(), rule.tp_dim, etp_group, etp_size)
                tensors = hf_from_gathered(rule, full, model_cfg, etp_size)
            else:
                tensors = [(name, receive(name, key, pp_rank)) for name in rule.hf_names]
            if ep_size > 1:
                tensors = [(name, t.contiguous()) for name, t in tensors]
                for _, t in tensors:
                    dist.broadcast(t, src=dist.get_global_rank(ep_group, holder), group=ep_group)
        for name, t in tensors:
            if pp_size > 1:
                t = receive(name, key, src) if t is None else t.contiguous()
                dist.broadcast(t, src=dist.get_global_rank(pp_group, src), group=pp_group)
            t = t.to(torch.float32 if keep_fp32 and rule.fp32 else dtype)
            yield name, t.clone() if t.untyped_storage()._cdata in live else t
            for alias in mtp_aliases(name, model_cfg):  # the MTP modules' copies of the shared weights
                yield alias, t.clone()


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def _copy_kept_out(src: Path, writer: ShardedSafetensorsWriter, mtp_exported: bool,
                   vision_exported: bool) -> None:
    """The source folder's tensors the engine does not hold (a vision tower without ``ModelConfig.vision``,
    ``mtp.*``: ``hf.folder``), copied unchanged, so the folder stays a whole vision-language / MTP
    checkpoint. Memory: one tensor."""
    with HFCheckpointReader(src) as reader:
        for name in kept_out_names(reader, load_mtp=mtp_exported, load_vision=vision_exported):
            writer.add(name, reader.read(name, reader.shape(name)))


def _copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer / generation files of the source folder (everything but weights, indexes, config)."""
    if src.resolve() == dst.resolve():
        return
    for file in src.iterdir():
        if (file.is_file() and file.suffix not in _WEIGHT_SUFFIXES and not file.name.endswith(".index.json")
                and file.name != "config.json"):
            shutil.copy2(file, dst / file.name)


def export_hf(model_chunks: Sequence[torch.nn.Module], cfg: EngineConfig, out_dir: str | os.PathLike, *,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
              overrides: Mapping[int, Callable[[], torch.Tensor]] | None = None) -> None:
    """Write ``out_dir`` (shards of at most ``max_shard_bytes`` + ``config.json``) from global rank 0,
    memory one shard; call on every rank. ``cfg.model.hf_path`` supplies token ids and tokenizer files.
    Tensors are in ``dtype`` (None: ``cfg.precision``) but the expert biases, which stay fp32.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    writer = ShardedSafetensorsWriter(out_dir, max_shard_bytes) if rank == 0 else None
    dtype = dtype or precision_dtype(cfg)
    # the ranks of one full copy: data-parallel rank 0 (MoE: and expert-data-parallel rank 0, whose
    # expert-parallel group holds every expert; with expert TP 1 < TP, the TP group spans expert-DP)
    first = parallel_state.get_data_parallel_rank()
    if cfg.model.moe is not None:
        first = min(first, parallel_state.get_expert_data_parallel_rank())
    if first == 0:
        for name, tensor in iter_hf_tensors(model_chunks, cfg, dtype=dtype, overrides=overrides,
                                            keep_fp32=True):
            if writer is not None:
                writer.add(name, tensor)
    if writer is not None and cfg.model.hf_path:
        _copy_kept_out(Path(cfg.model.hf_path), writer, cfg.model.mtp_num_layers > 0,
                       cfg.model.vision is not None)
    if writer is not None:
        writer.close()
        hf_path = cfg.model.hf_path
        base = read_hf_config(hf_path) if hf_path else None
        config = to_hf_config(cfg.model, dtype=dtype, base=base)
        (Path(out_dir) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if hf_path:
            _copy_side_files(Path(hf_path), Path(out_dir))
    if dist.is_initialized():
        dist.barrier()
