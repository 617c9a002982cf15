"""How a Hugging Face folder names and lays out the language model's tensors, beyond the family's
names in ``mapping`` (``model.layers.*``, one tensor per expert):

- ``prefix``: Qwen3.5 vision-language folders (``*ForConditionalGeneration``) hold the decoder as
  ``model.language_model.*`` (``lm_head.weight`` stays); the engine's names are ``model.*``.
- ``fused_experts``: Hub Qwen3.5-MoE folders hold a layer's experts as ``mlp.experts.gate_up_proj``
  ``[E, 2F, H]`` (expert ``e``'s rows ``[gate_e; up_e]``) and ``mlp.experts.down_proj`` ``[E, H, F]``;
  ``save_pretrained`` writes one tensor per expert. Both load; export keeps the folder's layout.
- ``kept_out``: tensors the engine does not hold: the vision tower (``model.visual.*``) and the
  multi-token-prediction weights (``mtp.*``) of the hybrid families. Import skips them (said once in
  the log); ``export_hf`` copies them from the source folder unchanged; weight sync leaves them out
  (an inference replica keeps its own).

:class:`FolderReader` reads a folder by the engine's names; :func:`folder_stream` renames / fuses an
export stream into the folder's names.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from mcore_engine.hf.checkpoint_io import HFCheckpointReader

__all__ = ["FolderFormat", "FolderReader", "folder_format", "folder_stream", "kept_out_names"]

_LOG = logging.getLogger(__name__)
_MM_PREFIX = "model.language_model."
_KEPT_OUT = ("model.visual.", "mtp.")
_EXPERT = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)"
                     r"\.weight$")
_FUSED = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class FolderFormat:
    """A folder's naming (see the module docstring); the default is the engine's own."""

    prefix: bool = False
    fused_experts: bool = False

    def to_folder(self, name: str) -> str:
        """The folder's name of an engine (``model.*``) name."""
        return _MM_PREFIX + name[len("model."):] if self.prefix and name.startswith("model.") else name

    def from_folder(self, name: str, load_mtp: bool = False) -> str | None:
        """The engine's name of a folder name; None for a tensor kept out (vision tower, MTP unless
        ``load_mtp``)."""
        if name.startswith(_KEPT_OUT) and not (load_mtp and name.startswith("mtp.")):
            return None
        if self.prefix:
            if name.startswith(_MM_PREFIX):
                return "model." + name[len(_MM_PREFIX):]
            if name.startswith("model."):
                return None  # another tower of a vision-language folder
        return name


def _format_of(names: list[str]) -> FolderFormat:
    return FolderFormat(prefix=any(n.startswith(_MM_PREFIX) for n in names),
                        fused_experts=any(_FUSED.match(n.replace(_MM_PREFIX, "model.", 1)) for n in names))


@lru_cache(maxsize=16)
def _cached_format(path: str, stamp: tuple) -> FolderFormat:
    with HFCheckpointReader(path) as reader:
        return _format_of(reader.names())


def folder_format(path: str | os.PathLike | None) -> FolderFormat:
    """The format of the folder at ``path`` (cached while its weight files are unchanged); the default
    without a folder or weights."""
    if not path or not Path(path).is_dir():
        return FolderFormat()
    files = sorted(Path(path).glob("*.safetensors*")) + sorted(Path(path).glob("*.index.json"))
    if not files:
        return FolderFormat()
    return _cached_format(str(path), tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files))


def kept_out_names(reader: HFCheckpointReader, load_mtp: bool = False) -> list[str]:
    """The folder's tensors the engine does not hold (vision tower, MTP unless ``load_mtp``)."""
    fmt = _format_of(reader.names())
    return [n for n in reader.names() if fmt.from_folder(n, load_mtp) is None]


class FolderReader:
    """``HFCheckpointReader`` by the engine's names (``mapping.hf_shapes``'), whatever the folder's prefix
    and expert layout; the tensors kept out are not listed (``mtp.*`` is, with ``load_mtp``)."""

    def __init__(self, reader: HFCheckpointReader, load_mtp: bool = False) -> None:
        self.reader = reader
        self.format = _format_of(reader.names())
        self._names: list[str] = []
        kept_out = []
        for folder_name in reader.names():
            name = self.format.from_folder(folder_name, load_mtp)
            if name is None:
                kept_out.append(folder_name)
                continue
            fused = _FUSED.match(name)
            if fused is None:
                self._names.append(name)
                continue
            shape = reader.shape(folder_name)
            projs = ("gate_proj", "up_proj") if fused[2] == "gate_up_proj" else ("down_proj",)
            self._names += [f"{fused[1]}.{e}.{p}.weight" for e in range(shape[0]) for p in projs]
        if kept_out:
            towers = sorted({"mtp" if n.startswith("mtp.") else ".".join(n.split(".")[:2]) for n in kept_out})
            _LOG.info("hf_path: %d tensors (%s) kept out of the engine: only the language model is loaded",
                      len(kept_out), ", ".join(f"{t}.*" for t in towers))

    def names(self) -> list[str]:
        """The language model's tensors, by the engine's names (experts one tensor each)."""
        return list(self._names)

    def _fused(self, name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...], int, int] | None:
        """``(folder name, its full shape, expert, row offset)`` of an expert's tensor in a fused folder."""
        match = _EXPERT.match(name) if self.format.fused_experts else None
        if match is None:
            return None
        experts = int(self._num_experts(match[1]))
        if match[3] == "down_proj":
            return self.format.to_folder(f"{match[1]}.down_proj"), (experts, *shape), int(match[2]), 0
        rows = shape[0]
        offset = rows if match[3] == "up_proj" else 0
        return (self.format.to_folder(f"{match[1]}.gate_up_proj"), (experts, 2 * rows, shape[1]),
                int(match[2]), offset)

    def __enter__(self) -> FolderReader:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def _num_experts(self, block: str) -> int:
        folder = self.format.to_folder(f"{block}.down_proj")
        return self.reader.shape(folder)[0]

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Every tensor of ``expected`` (engine names, per-expert shapes) exists with that shape."""
        for name, shape in expected.items():
            fused = self._fused(name, shape)
            if fused is None:
                self.reader.check({self.format.to_folder(name): shape})
            else:
                self.reader.check({fused[0]: fused[1]})

    def read(self, name: str, expected_shape: tuple[int, ...], dim: int = 0,
             start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """``HFCheckpointReader.read`` by the engine's name (an expert's slice of a fused tensor)."""
        fused = self._fused(name, expected_shape)
        if fused is None:
            return self.reader.read(self.format.to_folder(name), expected_shape, dim, start, stop)
        folder_name, shape, e, offset = fused
        if start is None and stop is None:
            start, stop = 0, expected_shape[dim]
        if dim == 0:
            return self.reader.read_index(folder_name, shape, (e, slice(offset + start, offset + stop)))
        return self.reader.read_index(folder_name, shape, (e, slice(offset, offset + expected_shape[0]),
                                                          slice(start, stop)))


def folder_stream(stream: Iterator[tuple[str, torch.Tensor]], fmt: FolderFormat,
                  num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` (engine names, checkpoint order) in the folder's names: the prefix, and with fused
    experts a layer's ``gate_up_proj`` / ``down_proj`` after its last expert. Memory: one layer's experts."""
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in stream:
        match = _EXPERT.match(name) if fmt.fused_experts else None
        if match is None:
            yield fmt.to_folder(name), t
            continue
        parts = pending.setdefault(match[1], {})
        parts[(int(match[2]), match[3])] = t
        if len(parts) == 3 * num_experts:
            del pending[match[1]]
            gate_up = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]])
                                   for e in range(num_experts)])
            yield fmt.to_folder(f"{match[1]}.gate_up_proj"), gate_up
            yield fmt.to_folder(f"{match[1]}.down_proj"), torch.stack([parts[(e, "down_proj")]
                                                                       for e in range(num_experts)])
    if pending:
        raise ValueError(f"stream: experts of {sorted(pending)} missing")
