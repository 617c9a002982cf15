"""Hugging Face safetensors folders read and written one tensor (or one slice) at a time.

``HFCheckpointReader`` reads rows or columns of a named tensor (``safe_open(...).get_slice``) from
``model.safetensors``, indexed shards or unindexed ``*.safetensors``, after checking its full shape.
``ShardedSafetensorsWriter`` streams tensors into ``model-0000i-of-0000n.safetensors`` files of at
most ``max_shard_bytes`` plus an index (memory: one shard) and removes stale weight files.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class HFCheckpointReader:
    """Lazy, slice-wise reads from a safetensors folder; a context manager. Memory: what is read."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"hf_path: {str(self.path)!r} is not a directory")
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        try:
            self._weight_map = self._find_weight_map()
        except BaseException:
            self._stack.close()
            raise

    def _find_weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"hf_path: {index} is not a valid safetensors index ({e})") from e
            for name, file in weight_map.items():
                if not (self.path / file).is_file():
                    raise ValueError(f"tensor {name!r}: its file {file!r} listed in {INDEX_FILE} is missing")
            return dict(weight_map)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"hf_path: no *.safetensors files in {str(self.path)!r} "
                             "(PyTorch .bin checkpoints are not supported; re-save with safetensors)")
        weight_map: dict[str, str] = {}
        for file in files:
            for name in self._open(file.name).keys():
                weight_map[name] = file.name
        return weight_map

    def _open(self, file: str):
        if file not in self._handles:
            try:
                handle = safe_open(str(self.path / file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"hf_path: cannot read safetensors file {file!r}: {e}") from e
            self._handles[file] = self._stack.enter_context(handle)
        return self._handles[file]

    def __enter__(self) -> HFCheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._handles.clear()

    def names(self) -> list[str]:
        """All tensor names in the folder."""
        return list(self._weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name`` (reads its header)."""
        if name not in self._weight_map:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint at {str(self.path)!r}")
        return tuple(self._open(self._weight_map[name]).get_slice(name).get_shape())

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Every tensor of ``expected`` exists with that full shape (reads headers only)."""
        for name, shape in expected.items():
            self._slice(name, shape)

    def _slice(self, name: str, expected_shape: tuple[int, ...]):
        if name not in self._weight_map:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint at {str(self.path)!r}")
        try:
            sl = self._open(self._weight_map[name]).get_slice(name)
        except SafetensorError as e:
            raise ValueError(f"tensor {name!r}: cannot read it ({e})") from e
        shape = tuple(sl.get_shape())
        if shape != tuple(expected_shape):
            raise ValueError(f"tensor {name!r} has shape {shape}, expected {tuple(expected_shape)} "
                             "from the model config")
        return sl

    def read(self, name: str, expected_shape: tuple[int, ...], dim: int = 0,
             start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows (``dim=0``) or columns (``dim=1``) ``[start, stop)`` of ``name`` (all when None), after
        checking the stored shape against ``expected_shape``; reads only the slice.
        """
        sl = self._slice(name, expected_shape)
        if start is None and stop is None:
            return sl[:]
        if dim == 0:
            return sl[start:stop]
        if dim == 1:
            return sl[:, start:stop]
        raise ValueError(f"dim: expected 0 or 1, got {dim}")

    def read_index(self, name: str, expected_shape: tuple[int, ...], index: tuple) -> torch.Tensor:
        """``tensor[index]`` (ints and slices, e.g. one expert's rows of a fused 3-D expert tensor) after
        checking the stored shape; reads only the slice."""
        return self._slice(name, expected_shape)[index]


class ShardedSafetensorsWriter:
    """Streams ``(name, tensor)`` pairs into safetensors files of at most ``max_shard_bytes``."""

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 2**30) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes: expected > 0, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self._total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes
        self._total_bytes += nbytes

    def _flush(self) -> None:
        tmp = f".shard-{len(self._files):05d}.safetensors.tmp"
        save_file(self._pending, str(self.out_dir / tmp), metadata={"format": "pt"})
        self._files.append((tmp, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Flush, give the files their final names, write the index; returns the file names."""
        if self._pending or not self._files:
            self._flush()
        n = len(self._files)
        final = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for stale in [*self.out_dir.glob("model*.safetensors"), self.out_dir / INDEX_FILE]:
            if stale.name not in final and stale.is_file():  # left by an earlier export
                stale.unlink()
        weight_map = {}
        for (tmp, names), name in zip(self._files, final, strict=True):
            os.replace(self.out_dir / tmp, self.out_dir / name)
            weight_map.update(dict.fromkeys(names, name))
        if n > 1:
            index = {"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}
            (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return final
