"""A plain sampling loop and teacher top-k scoring over vocab-parallel logits, through the engine.

Both call ``infer_batch(batch, logits_func=..., builtin_outputs=False)`` on this rank's shard
``z [..., V_local]``; rollouts (no KV cache, one forward per token) are Gumbel-max::

    g = -log(-log(U)),  U ~ uniform(0, 1) per (token, id), each TP rank for its own shard
    next = vocab_parallel_topk(z + g, 1)     # argmax over the global vocab = a draw from softmax(z)

Outputs are broadcast from the last pipeline stage. Memory: one fp32 ``[T, V_local]`` copy (rollouts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

from mcore_engine.ops import vocab_parallel_topk

__all__ = ["GumbelMaxSampler", "from_last_stage", "sample_continuations", "teacher_topk", "topk_processor"]

_SEED_STRIDE = 1_000_003


def _tp_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group`` if given, else Megatron's tensor-parallel group when initialised, else None (one shard)."""
    if group is not None:
        return group
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


class GumbelMaxSampler:
    """``logits_func`` -> ``{"sampled_ids": int64 [...]}``, one draw from ``softmax(student_logits)``,
    the same on every TP rank; call ``i`` seeds with ``(seed, i, tp_rank)``; padded ids never drawn."""

    def __init__(self, *, seed: int, vocab_size: int | None, group: dist.ProcessGroup | None = None) -> None:
        self.seed = seed
        self.vocab_size = vocab_size
        self.group = group
        self.calls = 0

    def __call__(self, student_logits: torch.Tensor, data=None,
                 data_format: str = "thd") -> dict[str, torch.Tensor]:
        group = _tp_group(self.group)
        tp_rank = dist.get_rank(group) if group is not None else 0
        gen = torch.Generator(device=student_logits.device)
        gen.manual_seed(((self.seed * _SEED_STRIDE + self.calls) * 1009 + tp_rank) % 2**63)
        self.calls += 1
        with torch.no_grad():
            # --- 1. one fp32 buffer: U -> log(-log U) = -g -> z + g (in place on our own buffer) ---
            tiny = torch.finfo(torch.float32).tiny
            noise = torch.rand(student_logits.shape, generator=gen, device=student_logits.device,
                               dtype=torch.float32)
            noise.clamp_min_(tiny).log_().neg_().clamp_min_(tiny).log_()
            perturbed = noise.neg_().add_(student_logits)
            # --- 2. argmax over the global vocab: identical on every rank of the group ---
            _, ids = vocab_parallel_topk(perturbed, 1, group=group, vocab_size=self.vocab_size)
        return {"sampled_ids": ids[..., 0]}


def topk_processor(k: int, *, vocab_size: int | None, group: dist.ProcessGroup | None = None):
    """``logits_func`` returning ``{"topk_log_probs": fp32 [..., k], "topk_ids": int64 [..., k]}``:
    the top-k of ``log_softmax(logits)`` over the global vocab (``vocab_parallel_topk``)."""

    def fn(student_logits: torch.Tensor, data=None, data_format: str = "thd") -> dict[str, torch.Tensor]:
        log_probs, ids = vocab_parallel_topk(student_logits, k, group=_tp_group(group), vocab_size=vocab_size)
        return {"topk_log_probs": log_probs, "topk_ids": ids}

    return fn


def from_last_stage(out, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``out[key]`` (dense ``shape``) on every pipeline stage: one broadcast from the last stage."""
    from megatron.core import parallel_state

    from mcore_engine.parallel.platform import get_device

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return out[key]
    device = get_device().torch_device
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        value = out[key].to(device=device, dtype=dtype).contiguous()
    else:
        value = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(value, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return value


def _inference_batch(tokens: torch.Tensor, *, micro_batch_size: int, temperature: float) -> TensorDict:
    """Padded ``[B, S]`` batch without padding (an all-ones ``attention_mask``), no distillation flags."""
    batch = TensorDict({"input_ids": tokens, "attention_mask": torch.ones_like(tokens, dtype=torch.bool)},
                       batch_size=[tokens.shape[0]])
    batch.set_non_tensor("temperature", temperature)
    batch.set_non_tensor("micro_batch_size_per_gpu", micro_batch_size)
    return batch


def sample_continuations(engine, prompts: torch.Tensor, num_new_tokens: int, *, sampler: GumbelMaxSampler,
                         temperature: float = 1.0, micro_batch_size: int = 8) -> torch.Tensor:
    """int64 ``[B, P]`` -> ``[B, P + num_new_tokens]`` sampled from ``softmax(logits / temperature)``."""
    if prompts.dim() != 2 or prompts.shape[1] < 1 or prompts.dtype != torch.int64:
        raise ValueError(f"prompts must be int64 [B, P] with P >= 1, got {prompts.dtype} "
                         f"{tuple(prompts.shape)}")
    tokens = prompts
    for _ in range(num_new_tokens):
        batch = _inference_batch(tokens, micro_batch_size=micro_batch_size, temperature=temperature)
        out = engine.infer_batch(batch, logits_func=sampler, builtin_outputs=False)
        sampled = from_last_stage(out, "sampled_ids", tuple(tokens.shape), torch.int64)
        next_ids = sampled[:, -1].to(tokens.device)
        tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
    return tokens


def teacher_topk(engine, tokens: torch.Tensor, k: int, *,
                 micro_batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens [B, S]`` -> (ids int64, log-probs fp32) ``[B, S, k]``; position t scores token t + 1."""
    batch = _inference_batch(tokens, micro_batch_size=micro_batch_size, temperature=1.0)
    processor = topk_processor(k, vocab_size=engine.config.model.vocab_size)
    out = engine.infer_batch(batch, logits_func=processor, builtin_outputs=False)
    shape = (*tokens.shape, k)
    ids = from_last_stage(out, "topk_ids", shape, torch.int64)
    log_probs = from_last_stage(out, "topk_log_probs", shape, torch.float32)
    return ids.to(tokens.device), log_probs.to(tokens.device)
