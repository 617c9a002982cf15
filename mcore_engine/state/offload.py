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

from mcore_engine.step.optimizer import sub_optimizers

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


def _not_resizable(plan: dict[str, list[torch.UntypedStorage]]) -> list[tuple[str, torch.UntypedStorage]]:
    """``(part, storage)`` for every storage that ``resize_`` would refuse."""
    return [(part, s) for part, storages in plan.items() for s in storages if not s.resizable()]


def _restore(saved: list[tuple[torch.UntypedStorage, torch.Tensor]], pin: bool) -> None:
    """Reallocate each freed storage and copy its host bytes back."""
    for storage, host in saved:
        storage.resize_(host.numel())
        live = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        live.copy_(host, non_blocking=pin)
    if pin:
        torch.cuda.synchronize()


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
    def _names(self) -> dict[int, str]:
        """A readable owner for each storage: the first parameter name that reaches it."""
        names: dict[int, str] = {}
        for i, chunk in enumerate(self._chunks):
            for name, param in chunk.module.named_parameters():
                names.setdefault(_key(param.untyped_storage()), f"model chunk {i} parameter {name!r}")
        return names

    def offload(self, parts: Iterable[str]) -> None:
        """Copy each part's storages to the host and free them on the device (already offloaded
        parts are left alone). All or nothing: a storage that cannot be freed (not resizable, e.g.
        after ``.numpy()`` on a tensor sharing it) raises ``RuntimeError`` naming its owner before
        anything moves, and a failure part-way restores what was freed."""
        pin, parts = torch.cuda.is_available(), set(parts)
        todo = [p for p in self.parts if p in parts and p not in self._host]
        plan = {part: [s for s in self.storages(part).values()
                       if not (s.device.type == "cpu" and pin) and s.nbytes() > 0]  # CUDA: host already
                for part in todo}
        stuck = _not_resizable(plan)
        if stuck:
            names = self._names()
            part, storage = stuck[0]
            owner = names.get(_key(storage), f"a {part!r} storage")
            raise RuntimeError(
                f"offload: {owner} ({storage.nbytes()} bytes, part {part!r}) cannot be freed: its storage "
                f"is not resizable ({len(stuck)} such storages), typically because .numpy() was called on "
                "a tensor sharing it; nothing was offloaded")
        moved: dict[str, list[tuple[torch.UntypedStorage, torch.Tensor]]] = {}
        try:
            for part in todo:
                saved = moved.setdefault(part, [])
                copies = []
                for storage in plan[part]:
                    live = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
                    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                    host.copy_(live, non_blocking=pin)
                    copies.append((storage, host))
                if pin:
                    torch.cuda.synchronize()
                for storage, host in copies:
                    storage.resize_(0)
                    saved.append((storage, host))
        except BaseException:
            for saved in moved.values():  # put back every storage freed so far
                _restore(saved, pin)
            raise
        self._host.update(moved)
        if pin and todo:
            torch.cuda.empty_cache()

    def onload(self, parts: Iterable[str]) -> None:
        """Reallocate each offloaded part's storages and copy their bytes back."""
        pin, parts = torch.cuda.is_available(), set(parts)
        for part in [p for p in PARTS if p in parts and p in self._host]:
            _restore(self._host[part], pin)
            del self._host[part]

    def require(self, what: str, parts: Iterable[str]) -> None:
        """``RuntimeError`` naming the offloaded parts among ``parts`` that ``what`` needs."""
        parts = set(parts)
        missing = [p for p in PARTS if p in parts and p in self._host]
        if missing:
            raise RuntimeError(f"{what} needs {missing}, which are offloaded to host memory; call "
                               f"engine.onload() first (offloaded now: {sorted(self._host)})")
