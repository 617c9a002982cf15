"""Bucketed weight sync: the Hugging Face tensors packed into flat buckets of at most N bytes.

Sender (collective over the model-parallel group, like ``iter_hf_tensors``) and receiver (this
module imports only torch)::

    for bucket, meta in iter_weight_buckets(engine.model, engine.config, bucket_bytes=512 << 20):
        send(bucket, meta)                                  # before the next bucket is requested
    model.load_weights(unflatten_bucket(bucket, meta).items())

Tensor i is ``bucket[offsets[i]:offsets[i] + prod(shapes[i])].view(shapes[i])``; buckets are filled
greedily in checkpoint order and a tensor over N bytes is alone. Memory above the model: one reused
buffer of the largest multi-tensor bucket (<= N bytes) plus one gathered parameter; a one-tensor
bucket is that tensor flattened, not copied.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mcore_engine.config import EngineConfig

__all__ = ["BucketMeta", "fill_buckets", "iter_weight_buckets", "plan_buckets", "unflatten_bucket"]


@dataclass(frozen=True, slots=True)
class BucketMeta:
    """What one bucket holds (picklable; lists are accepted and stored as tuples)."""

    names: tuple[str, ...]
    """Hugging Face names, in bucket order, unique."""
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    """Element (not byte) offset of each tensor in the bucket; spans increase and do not overlap."""
    dtype: torch.dtype
    """The dtype of the bucket and of every tensor in it."""
    numel: int
    """Elements in the bucket (at least the end of the last span)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "names", tuple(self.names))
        set_(self, "shapes", tuple(tuple(int(d) for d in s) for s in self.shapes))
        set_(self, "offsets", tuple(self.offsets))
        n = len(self.names)
        if n == 0 or len(self.shapes) != n or len(self.offsets) != n:
            raise ValueError(f"meta: names, shapes, offsets must be non-empty and of one length, got "
                             f"{n}, {len(self.shapes)}, {len(self.offsets)}")
        if not all(isinstance(x, str) for x in self.names) or len(set(self.names)) != n:
            raise ValueError(f"meta.names: must be unique strings, got {self.names}")
        if any(d < 0 for s in self.shapes for d in s):
            raise ValueError(f"meta.shapes: negative size in {self.shapes}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"meta.dtype: must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.numel, int) or isinstance(self.numel, bool):
            raise ValueError(f"meta.numel: must be an int, got {self.numel!r}")
        end = 0
        for name, shape, off in zip(self.names, self.shapes, self.offsets, strict=True):
            if not isinstance(off, int) or isinstance(off, bool) or off < end:
                raise ValueError(f"meta.offsets: {name!r} at {off!r} overlaps the previous tensor (ends at "
                                 f"{end}) or is not an int")
            end = off + math.prod(shape)
        if self.numel < end:
            raise ValueError(f"meta.numel: {self.numel} < {end}, the end of the last tensor")

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _check_bucket_bytes(bucket_bytes: object) -> int:
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be a positive int, got {bucket_bytes!r}")
    return bucket_bytes


def plan_buckets(shapes: Mapping[str, Sequence[int]], dtype: torch.dtype | Mapping[str, torch.dtype],
                 bucket_bytes: int) -> list[BucketMeta]:
    """Greedy packing of ``shapes`` (name -> shape, in stream order) into tight buckets of at most
    ``bucket_bytes`` bytes; a tensor larger than that is alone in its bucket. ``dtype``: of every
    tensor, or per name (a tensor of another dtype than the open bucket's starts a new bucket)."""
    _check_bucket_bytes(bucket_bytes)
    dtypes = dtype if isinstance(dtype, Mapping) else dict.fromkeys(shapes, dtype)
    for name in shapes:
        if not isinstance(dtypes.get(name), torch.dtype):
            raise ValueError(f"dtype: must be a torch.dtype (or one per name), got {dtypes.get(name)!r} "
                             f"for {name!r}")
    plan: list[BucketMeta] = []
    names: list[str] = []
    sizes: list[tuple[int, ...]] = []
    offsets: list[int] = []
    used = 0
    current: torch.dtype | None = None

    def close() -> None:
        nonlocal used
        if names:
            plan.append(BucketMeta(tuple(names), tuple(sizes), tuple(offsets), current, used))
        names.clear()
        sizes.clear()
        offsets.clear()
        used = 0

    for name, shape in shapes.items():
        numel = math.prod(shape)
        if names and (dtypes[name] != current or used + numel > bucket_bytes // current.itemsize):
            close()
        current = dtypes[name]
        names.append(name)
        sizes.append(tuple(shape))
        offsets.append(used)
        used += numel
    close()
    return plan


def _is_one_tensor(meta: BucketMeta) -> bool:
    """A bucket that is exactly one tensor (sent as the tensor itself, flattened)."""
    return len(meta.names) == 1 and meta.offsets[0] == 0 and meta.numel == math.prod(meta.shapes[0])


def fill_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 plan: Sequence[BucketMeta]) -> Iterator[tuple[torch.Tensor, BucketMeta]]:
    """``(bucket, meta)`` per ``plan`` entry, filled from ``named_tensors`` (matching the plan in name,
    shape and dtype, else ``ValueError``). Multi-tensor buckets are views of one reused buffer, valid
    until the next step of the generator; a one-tensor bucket is the tensor ``named_tensors`` gave.
    Memory: the buffer plus what ``named_tensors`` holds."""
    stream = iter(named_tensors)
    buffer_numel = max((m.numel for m in plan if not _is_one_tensor(m)), default=0)
    buffers: dict[torch.dtype, torch.Tensor] = {}  # one reused buffer per dtype
    for meta in plan:
        bucket = None
        for name, shape, off in zip(meta.names, meta.shapes, meta.offsets, strict=True):
            item = next(stream, None)
            if item is None:
                raise ValueError(f"named_tensors: ended before {name!r}")
            got, t = item
            if got != name or tuple(t.shape) != shape or t.dtype != meta.dtype:
                raise ValueError(f"named_tensors: got {got!r} {tuple(t.shape)} {t.dtype} where the plan has "
                                 f"{name!r} {shape} {meta.dtype}")
            if _is_one_tensor(meta):
                bucket = t.reshape(-1)
                continue
            buffer = buffers.get(t.dtype)
            if buffer is None or buffer.device != t.device:
                buffer = buffers[t.dtype] = torch.empty(buffer_numel, dtype=t.dtype, device=t.device)
            bucket = buffer[:meta.numel]
            bucket[off:off + t.numel()].view(shape).copy_(t)
        yield bucket, meta
    extra = next(stream, None)
    if extra is not None:
        raise ValueError(f"named_tensors: {extra[0]!r} is not in the plan")


def iter_weight_buckets(model_chunks: Sequence[torch.nn.Module], cfg: EngineConfig, bucket_bytes: int, *,
                        dtype: torch.dtype | None = None, overrides: Mapping | None = None
                        ) -> Iterator[tuple[torch.Tensor, BucketMeta]]:
    """``iter_hf_tensors(model_chunks, cfg, dtype=dtype, overrides=overrides, keep_fp32=True)`` packed
    by ``plan_buckets`` (the expert biases in fp32 buckets of their own; the MTP modules' copies of the
    embedding / output layer after their source). Collective over TP, PP and, with MoE, EP: every
    rank consumes it to the end and gets the same buckets. Validity and memory as in :func:`fill_buckets`."""
    from mcore_engine.hf.export import iter_hf_tensors, precision_dtype
    from mcore_engine.hf.mapping import hf_fp32_names, hf_stream_shapes

    _check_bucket_bytes(bucket_bytes)
    dtype = dtype or precision_dtype(cfg)
    shapes, fp32 = hf_stream_shapes(cfg.model), hf_fp32_names(cfg.model)
    plan = plan_buckets(shapes, {n: torch.float32 if n in fp32 else dtype for n in shapes}, bucket_bytes)
    return fill_buckets(iter_hf_tensors(model_chunks, cfg, dtype=dtype, overrides=overrides, keep_fp32=True),
                        plan)


def bucket_named_tensors(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
                         ) -> Iterator[tuple[torch.Tensor, BucketMeta]]:
    """``named`` tensors (one dtype, in order) packed by ``plan_buckets`` (the LoRA adapters)."""
    _check_bucket_bytes(bucket_bytes)
    if not named:
        return iter(())
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) != 1:
        raise ValueError(f"named tensors must share one dtype, got {sorted(map(str, dtypes))}")
    plan = plan_buckets({k: tuple(t.shape) for k, t in named}, dtypes.pop(), bucket_bytes)
    return fill_buckets(named, plan)


def unflatten_bucket(bucket: torch.Tensor, meta: BucketMeta) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` in bucket order, views of ``bucket`` (no copy). ``ValueError`` unless
    ``bucket`` is a contiguous 1-D tensor of ``meta.dtype`` and ``meta.numel`` elements."""
    if not isinstance(meta, BucketMeta):
        raise ValueError(f"meta: must be a BucketMeta, got {type(meta).__name__}")
    if not isinstance(bucket, torch.Tensor):
        raise ValueError(f"bucket: must be a torch.Tensor, got {type(bucket).__name__}")
    if bucket.dim() != 1 or not bucket.is_contiguous():
        raise ValueError(f"bucket: must be a contiguous 1-D tensor, got shape {tuple(bucket.shape)} stride "
                         f"{bucket.stride()}")
    if bucket.dtype != meta.dtype or bucket.numel() != meta.numel:
        raise ValueError(f"bucket: {bucket.numel()} x {bucket.dtype} does not match the metadata's "
                         f"{meta.numel} x {meta.dtype}")
    return {name: bucket[off:off + math.prod(shape)].view(shape)
            for name, shape, off in zip(meta.names, meta.shapes, meta.offsets, strict=True)}
