"""Offload / onload of the engine's device memory in three parts, each moved on its own::

    params     the storages behind the model chunks' parameters (DDP ``param_data`` buffers under
               the distributed optimizer)
    grads      every DDP bucket's ``grad_data`` (holds the ``main_grad`` views)
    optimizer  Adam state and the fp32 main weights it steps, less what the parts above own

A forward-only engine (no optimizer, chunks without DDP) has the params part only.

Offload copies each storage into a host buffer (pinned on CUDA) and resizes it to 0 bytes; onload
resizes and copies back, so every view keeps its metadata and comes back bit-identical. Memory: the
host copy holds the offloaded bytes; the peak is one storage on both sides at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from mcore_engine.optim import sub_optimizers

__all__ = ["PARTS", "HostOffloader"]

PARTS = ("params", "grads", "optimizer")


def _key(storage: torch.UntypedStorage) -> int:
    return storage._cdata  # the StorageImpl: one per storage, whatever wrapper or view reaches it


def _unique(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        out.setdefault(_key(storage), storage)
    return out


class HostOffloader:
    """Moves the parts of ``model_chunks`` (Megatron DDP wrappers) and ``optimizer`` (a Megatron
    optimizer) to host memory and back; tracks which parts are offloaded. ``optimizer`` None: the
    chunks are forward-only (``.module``, no grad buffers) and ``params`` is the only part."""

    def __init__(self, model_chunks: list[torch.nn.Module], optimizer) -> None:
        self._chunks = model_chunks
        self._optimizer = optimizer
        self.parts = PARTS if optimizer is not None else ("params",)
        self._host: dict[str, list[tuple[torch.UntypedStorage, torch.Tensor]]] = {}

    @property
    def offloaded(self) -> frozenset[str]:
        return frozenset(self._host)

    # ------------------------------------------------------------------ what each part owns
    def _params(self) -> Iterator[torch.Tensor]:
        for chunk in self._chunks:
            yield from chunk.module.parameters()

    def _grads(self) -> Iterator[torch.Tensor]:
        for chunk in self._chunks if self._optimizer is not None else ():
            for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
                if buffer.grad_data is not None:
                    yield buffer.grad_data

    def _optimizer_tensors(self) -> Iterator[torch.Tensor]:
        for sub in sub_optimizers(self._optimizer) if self._optimizer is not None else ():
            inner = sub.optimizer
            if inner is None:
                continue
            for group in inner.param_groups:
                for p in group["params"]:
                    yield p
                    if p.grad is not None:
                        yield p.grad
            for state in inner.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def storages(self, part: str) -> dict[int, torch.UntypedStorage]:
        """The device storages ``part`` owns, by identity (the optimizer's less the other parts')."""
        if part == "params":
            return _unique(self._params())
        if part == "grads":
            return _unique(self._grads())
        if part == "optimizer":
            owned = _unique(self._optimizer_tensors())
            for other in ("params", "grads"):
                for key in self.storages(other):
                    owned.pop(key, None)
            return owned
        raise ValueError(f"unknown part {part!r}; expected one of {PARTS}")

    def device_bytes(self) -> dict[str, int]:
        """Bytes each part's storages hold now (0 for an offloaded part; on CUDA device storages only)."""
        cpu_ok = not torch.cuda.is_available()
        return {part: sum(s.nbytes() for s in self.storages(part).values()
                          if cpu_ok or s.device.type == "cuda") for part in PARTS}

    # ------------------------------------------------------------------ moves
    def offload(self, parts: Iterable[str]) -> None:
        """Copy each part's storages to the host and free them on the device (already offloaded
        parts are left alone)."""
        pin, parts = torch.cuda.is_available(), set(parts)
        todo = [p for p in self.parts if p in parts and p not in self._host]
        for part in todo:
            saved = []
            for storage in self.storages(part).values():
                if storage.device.type == "cpu" and pin or storage.nbytes() == 0:
                    continue  # on CUDA a CPU storage (Adam's step counter) is host memory already
                live = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(live, non_blocking=pin)
                saved.append((storage, host))
            if pin:
                torch.cuda.synchronize()
            for storage, _ in saved:
                storage.resize_(0)
            self._host[part] = saved
        if pin and todo:
            torch.cuda.empty_cache()

    def onload(self, parts: Iterable[str]) -> None:
        """Reallocate each offloaded part's storages and copy their bytes back."""
        pin, parts = torch.cuda.is_available(), set(parts)
        for part in [p for p in PARTS if p in parts and p in self._host]:
            for storage, host in self._host[part]:
                storage.resize_(host.numel())
                live = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
                live.copy_(host, non_blocking=pin)
            if pin:
                torch.cuda.synchronize()
            del self._host[part]

    def require(self, what: str, parts: Iterable[str]) -> None:
        """``RuntimeError`` naming the offloaded parts among ``parts`` that ``what`` needs."""
        parts = set(parts)
        missing = [p for p in PARTS if p in parts and p in self._host]
        if missing:
            raise RuntimeError(f"{what} needs {missing}, which are offloaded to host memory; call "
                               f"engine.onload() first (offloaded now: {sorted(self._host)})")
