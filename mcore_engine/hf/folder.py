"""How a Hugging Face folder names and lays out the language model's tensors, beyond the family's
names in ``mapping`` (``model.layers.*``, one tensor per expert):

- ``prefix``: Qwen3-VL(-MoE) / Qwen3.5 vision-language folders (``*ForConditionalGeneration``) hold the
  decoder as ``model.language_model.*`` (``lm_head.weight`` stays); the engine's names are ``model.*``
  (Qwen2.5-VL folders keep ``model.layers.*``).
- ``vision_prefix``: the vision tower's tensors, ``visual.*`` (Qwen2.5-VL) or ``model.visual.*`` (the
  others), the engine's ``model.visual.*`` (``mapping``): read and written when the model has the
  tower (``ModelConfig.vision``), else kept out.
- ``fused_experts``: Hub Qwen3.5-MoE folders hold a layer's experts as ``mlp.experts.gate_up_proj``
  ``[E, 2F, H]`` (expert ``e``'s rows ``[gate_e; up_e]``) and ``mlp.experts.down_proj`` ``[E, H, F]``;
  ``save_pretrained`` writes one tensor per expert. ``fused_columns``: the Hub's Qwen3-VL-MoE folders
  hold them transposed, ``gate_up_proj`` ``[E, H, 2F]`` (``gate_e = [e, :, :F].T``, ``up_e = [e, :, F:].T``)
  and ``down_proj`` ``[E, F, H]`` (``down_e = [e].T``), which ``transformers`` 5.24 loads but saves as
  ``[E, 2F, H]`` / ``[E, H, F]``; the two orientations told apart by the pair's shapes. Every layout
  loads; export keeps the folder's.
- ``gpt_oss``: gpt-oss folders hold a layer's experts as ``mlp.experts.gate_up_proj`` ``[E, H, 2I]``
  (transposed, gate / up interleaved: ``gate_e = gate_up_proj[e, :, 0::2].T``, ``up_e = [e, :, 1::2].T``),
  ``gate_up_proj_bias`` ``[E, 2I]`` (interleaved alike), ``down_proj`` ``[E, I, H]`` (``down_e`` transposed)
  and ``down_proj_bias`` ``[E, H]``; ``mxfp4``: the Hub's folders hold the weights as
  ``gate_up_proj_blocks`` / ``_scales`` ``[E, 2I, H/32, 16]`` / ``[E, 2I, H/32]`` and ``down_proj_blocks`` /
  ``_scales`` ``[E, H, I/32, 16]`` / ``[E, H, I/32]`` (``hf.mxfp4``), dequantised on read (each rank its
  experts' rows only). Export writes the dequantised layout (``gate_up_proj`` ...) in the export dtype.
- ``kept_out``: tensors the engine does not hold: the vision tower of a model without
  ``ModelConfig.vision`` and the multi-token-prediction weights (``mtp.*``) of the hybrid families
  (unless ``mtp_num_layers``). Import skips them (said once in
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
from mcore_engine.hf.families import MULTIMODAL
from mcore_engine.hf.mxfp4 import dequantize

__all__ = ["FolderFormat", "FolderReader", "folder_format", "folder_stream", "hub_format", "kept_out_names"]

_LOG = logging.getLogger(__name__)
_MM_PREFIX = "model.language_model."
_VISION = "model.visual."  # the engine's Hugging Face names of the tower (mapping.VISION_HF)
_VISION_PREFIXES = ("model.visual.", "visual.")
_EXPERT = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)"
                     r"\.weight$")
_FUSED = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_OSS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(|_bias|_blocks|_scales)$")
_OSS_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)"
                         r"\.(weight|bias)$")
# gpt-oss fused tensor (suffix) -> the per-expert engine tensors it holds
_OSS_PARTS = {"gate_up_proj": ("gate_proj.weight", "up_proj.weight"), "down_proj": ("down_proj.weight",),
              "gate_up_proj_bias": ("gate_proj.bias", "up_proj.bias"), "down_proj_bias": ("down_proj.bias",),
              "gate_up_proj_blocks": ("gate_proj.weight", "up_proj.weight"),
              "down_proj_blocks": ("down_proj.weight",), "gate_up_proj_scales": (), "down_proj_scales": ()}


@dataclass(frozen=True)
class FolderFormat:
    """A folder's naming (see the module docstring); the default is the engine's own."""

    prefix: bool = False
    fused_experts: bool = False
    gpt_oss: bool = False
    mxfp4: bool = False
    vision_prefix: str = _VISION
    fused_columns: bool = False

    def to_folder(self, name: str) -> str:
        """The folder's name of an engine (``model.*``) name."""
        if name.startswith(_VISION):
            return self.vision_prefix + name[len(_VISION):]
        return _MM_PREFIX + name[len("model."):] if self.prefix and name.startswith("model.") else name

    def from_folder(self, name: str, load_mtp: bool = False, load_vision: bool = False) -> str | None:
        """The engine's name of a folder name; None for a tensor kept out (the vision tower unless
        ``load_vision``, MTP unless ``load_mtp``)."""
        if name.startswith(self.vision_prefix) or name.startswith(_VISION):
            return _VISION + name[len(self.vision_prefix):] if load_vision and name.startswith(
                self.vision_prefix) else None
        if name.startswith("mtp.") and not load_mtp:
            return None
        if self.prefix:
            if name.startswith(_MM_PREFIX):
                return "model." + name[len(_MM_PREFIX):]
            if name.startswith("model."):
                return None  # another tower of a vision-language folder
        return name


def _format_of(reader: HFCheckpointReader) -> FolderFormat:
    names = reader.names()
    gpt_oss = any(n.endswith((".mlp.experts.gate_up_proj_bias", ".mlp.experts.gate_up_proj_blocks"))
                  for n in names)
    fused = [] if gpt_oss else [n for n in names if _FUSED.match(n.replace(_MM_PREFIX, "model.", 1))]
    columns = False
    for n in fused:  # Qwen3-VL-MoE's Hub layout: gate_up [E, H, 2F] with down [E, F, H]
        if n.endswith(".gate_up_proj") and n[:-len("gate_up_proj")] + "down_proj" in names:
            gate_up, down = reader.shape(n), reader.shape(n[:-len("gate_up_proj")] + "down_proj")
            columns = gate_up[2] == 2 * down[1] and gate_up[1] != 2 * down[2]
            break
    vision = next((p for p in _VISION_PREFIXES if any(n.startswith(p) for n in names)), _VISION)
    return FolderFormat(prefix=any(n.startswith(_MM_PREFIX) for n in names), gpt_oss=gpt_oss,
                        mxfp4=any(n.endswith(".mlp.experts.gate_up_proj_blocks") for n in names),
                        fused_experts=bool(fused), vision_prefix=vision, fused_columns=columns)


@lru_cache(maxsize=16)
def _cached_format(path: str, stamp: tuple) -> FolderFormat:
    with HFCheckpointReader(path) as reader:
        return _format_of(reader)


def hub_format(vision_model_type: str | None) -> FolderFormat:
    """The released folders' format of a vision-language ``model_type`` (``families.MULTIMODAL``: the
    decoder's and tower's prefixes, the experts' layout); the engine's own for None."""
    mm = MULTIMODAL.get(vision_model_type) if vision_model_type else None
    if mm is None:
        return FolderFormat()
    return FolderFormat(prefix=mm.language_prefix == _MM_PREFIX, vision_prefix=mm.vision_prefix,
                        fused_experts=mm.fused_experts is not None,
                        fused_columns=mm.fused_experts == "columns")


def folder_format(path: str | os.PathLike | None, default: FolderFormat | None = None) -> FolderFormat:
    """The format of the folder at ``path`` (cached while its weight files are unchanged); ``default``
    (None: the engine's own) without a folder or weights."""
    default = default or FolderFormat()
    if not path or not Path(path).is_dir():
        return default
    files = sorted(Path(path).glob("*.safetensors*")) + sorted(Path(path).glob("*.index.json"))
    if not files:
        return default
    return _cached_format(str(path), tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files))


def model_format(cfg) -> FolderFormat:
    """The format a ``ModelConfig``'s tensors are streamed and exported in: its ``hf_path`` folder's, else
    the released folders' of its vision-language type (:func:`hub_format`)."""
    vision = getattr(cfg, "vision", None)
    return folder_format(cfg.hf_path, hub_format(vision.model_type if vision is not None else None))


def kept_out_names(reader: HFCheckpointReader, load_mtp: bool = False,
                   load_vision: bool = False) -> list[str]:
    """The folder's tensors the engine does not hold (the vision tower unless ``load_vision``, MTP unless
    ``load_mtp``)."""
    fmt = _format_of(reader)
    return [n for n in reader.names() if fmt.from_folder(n, load_mtp, load_vision) is None]


class FolderReader:
    """``HFCheckpointReader`` by the engine's names (``mapping.hf_shapes``'), whatever the folder's prefix
    and expert layout; the tensors kept out are not listed (``mtp.*`` is, with ``load_mtp``; the tower,
    ``model.visual.*``, with ``load_vision``)."""

    def __init__(self, reader: HFCheckpointReader, load_mtp: bool = False, load_vision: bool = False) -> None:
        self.reader = reader
        self.format = _format_of(reader)
        self._names: list[str] = []
        kept_out = []
        for folder_name in reader.names():
            name = self.format.from_folder(folder_name, load_mtp, load_vision)
            if name is None:
                kept_out.append(folder_name)
                continue
            oss = _OSS.match(name) if self.format.gpt_oss else None
            if oss is not None:
                parts = _OSS_PARTS[oss[2] + oss[3]]
                experts = reader.shape(folder_name)[0] if parts else 0
                self._names += [f"{oss[1]}.{e}.{p}" for e in range(experts) for p in parts]
                continue
            fused = _FUSED.match(name)
            if fused is None:
                self._names.append(name)
                continue
            shape = reader.shape(folder_name)
            projs = ("gate_proj", "up_proj") if fused[2] == "gate_up_proj" else ("down_proj",)
            self._names += [f"{fused[1]}.{e}.{p}.weight" for e in range(shape[0]) for p in projs]
        if kept_out:
            vision = self.format.vision_prefix
            towers = sorted({"mtp" if n.startswith("mtp.") else vision[:-1] if n.startswith(vision)
                             else ".".join(n.split(".")[:2]) for n in kept_out})
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
        columns = self.format.fused_columns  # the folder holds each expert's tensor transposed
        if match[3] == "down_proj":
            full = (experts, shape[1], shape[0]) if columns else (experts, *shape)
            return self.format.to_folder(f"{match[1]}.down_proj"), full, int(match[2]), 0
        rows = shape[0]
        offset = rows if match[3] == "up_proj" else 0
        full = (experts, shape[1], 2 * rows) if columns else (experts, 2 * rows, shape[1])
        return self.format.to_folder(f"{match[1]}.gate_up_proj"), full, int(match[2]), offset

    def _oss_shapes(self, block: str, proj: str, kind: str,
                    shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The folder tensors (full shapes) behind one gpt-oss expert tensor of per-expert ``shape``."""
        experts = self.reader.shape(f"{block}.down_proj_bias")[0]
        fused = "down_proj" if proj == "down_proj" else "gate_up_proj"
        if kind == "bias":
            return {f"{block}.{fused}_bias": (experts, shape[0] * (1 if fused == "down_proj" else 2))}
        rows, cols = (shape[0], shape[1]) if fused == "down_proj" else (2 * shape[0], shape[1])
        if not self.format.mxfp4:
            return {f"{block}.{fused}": (experts, cols, rows)}
        if cols % 32:
            raise ValueError(f"tensor {block}.{fused}_blocks: MXFP4 blocks of 32 need an input width "
                             f"divisible by 32, the model config implies {cols}")
        return {f"{block}.{fused}_blocks": (experts, rows, cols // 32, 16),
                f"{block}.{fused}_scales": (experts, rows, cols // 32)}

    def _read_oss(self, match: re.Match, shape: tuple[int, ...], dim: int, start: int,
                  stop: int) -> torch.Tensor:
        """Rows (``dim`` 0) or columns [start, stop) of one expert's gate / up / down weight or bias."""
        block, e, proj, kind = match[1], int(match[2]), match[3], match[4]
        folder = self._oss_shapes(block, proj, kind, shape)
        self.reader.check(folder)
        (name, full), *rest = folder.items()
        off = int(proj == "up_proj")
        if kind == "bias":  # [E, 2I] interleaved / [E, H]
            if proj == "down_proj":
                return self.reader.read_index(name, full, (e, slice(start, stop)))
            return self.reader.read_index(name, full, (e, slice(2 * start, 2 * stop)))[off::2]
        if not self.format.mxfp4:  # [E, H, 2I] interleaved / [E, I, H]: the transposes
            if proj == "down_proj":
                index = (e, slice(None), slice(start, stop)) if dim == 0 else (e, slice(start, stop))
                return self.reader.read_index(name, full, index).T
            return self.reader.read_index(name, full, (e, slice(None), slice(2 * start, 2 * stop))).T[off::2]
        scales, scales_shape = rest[0]
        if proj != "down_proj":  # rows [2 start, 2 stop) of [E, 2I, H]
            index = (e, slice(2 * start, 2 * stop))
            w = dequantize(self.reader.read_index(name, full, index),
                           self.reader.read_index(scales, scales_shape, index), name=scales)
            return w[off::2]
        if dim == 0:
            index = (e, slice(start, stop))
            return dequantize(self.reader.read_index(name, full, index),
                              self.reader.read_index(scales, scales_shape, index), name=scales)
        g0, g1 = start // 32, -(-stop // 32)  # the blocks of 32 that hold columns [start, stop)
        index = (e, slice(None), slice(g0, g1))
        w = dequantize(self.reader.read_index(name, full, index),
                       self.reader.read_index(scales, scales_shape, index), name=scales)
        return w[:, start - 32 * g0:stop - 32 * g0]

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
            oss = _OSS_EXPERT.match(name) if self.format.gpt_oss else None
            if oss is not None:
                self.reader.check(self._oss_shapes(oss[1], oss[3], oss[4], shape))
                continue
            fused = self._fused(name, shape)
            if fused is None:
                self.reader.check({self.format.to_folder(name): shape})
            else:
                self.reader.check({fused[0]: fused[1]})

    def read(self, name: str, expected_shape: tuple[int, ...], dim: int = 0,
             start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """``HFCheckpointReader.read`` by the engine's name (an expert's slice of a fused tensor; gpt-oss's
        transposed and interleaved, MXFP4 dequantised to fp32)."""
        oss = _OSS_EXPERT.match(name) if self.format.gpt_oss else None
        if oss is not None:
            if start is None and stop is None:
                start, stop = 0, expected_shape[dim]
            return self._read_oss(oss, expected_shape, dim, start, stop).contiguous()
        fused = self._fused(name, expected_shape)
        if fused is None:
            return self.reader.read(self.format.to_folder(name), expected_shape, dim, start, stop)
        folder_name, shape, e, offset = fused
        if start is None and stop is None:
            start, stop = 0, expected_shape[dim]
        if self.format.fused_columns:  # engine[r, c] = folder[e, c, offset + r]
            index = ((e, slice(None), slice(offset + start, offset + stop)) if dim == 0 else
                     (e, slice(start, stop), slice(offset, offset + expected_shape[0])))
            return self.reader.read_index(folder_name, shape, index).T.contiguous()
        if dim == 0:
            return self.reader.read_index(folder_name, shape, (e, slice(offset + start, offset + stop)))
        return self.reader.read_index(folder_name, shape, (e, slice(offset, offset + expected_shape[0]),
                                                          slice(start, stop)))


def folder_stream(stream: Iterator[tuple[str, torch.Tensor]], fmt: FolderFormat,
                  num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` (engine names, checkpoint order) in the folder's names: the prefixes (decoder, tower), and
    with fused experts a layer's ``gate_up_proj`` / ``down_proj`` (transposed: ``fused_columns``) after its
    last expert. Memory: one layer's experts."""
    if fmt.gpt_oss:
        yield from _oss_stream(stream, fmt, num_experts)
        return
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
            experts = range(num_experts)
            gate_up = [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in experts]
            down = [parts[(e, "down_proj")] for e in experts]
            if fmt.fused_columns:  # [E, H, 2F] / [E, F, H]
                gate_up, down = [t.T for t in gate_up], [t.T for t in down]
            yield fmt.to_folder(f"{match[1]}.gate_up_proj"), torch.stack(gate_up)
            yield fmt.to_folder(f"{match[1]}.down_proj"), torch.stack(down)
    if pending:
        raise ValueError(f"stream: experts of {sorted(pending)} missing")


def _oss_stream(stream: Iterator[tuple[str, torch.Tensor]], fmt: FolderFormat,
                num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`folder_stream` for gpt-oss folders: a layer's ``gate_up_proj`` ``[E, H, 2I]`` (interleaved),
    ``gate_up_proj_bias``, ``down_proj`` ``[E, I, H]`` and ``down_proj_bias`` after its last expert,
    dequantised names whether or not the folder is MXFP4. Memory: one layer's experts."""
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in stream:
        match = _OSS_EXPERT.match(name)
        if match is None:
            yield fmt.to_folder(name), t
            continue
        parts = pending.setdefault(match[1], {})
        parts[(int(match[2]), f"{match[3]}.{match[4]}")] = t
        if len(parts) < 6 * num_experts:
            continue
        del pending[match[1]]

        experts, block = range(num_experts), match[1]
        gate_up = torch.stack([_interleave(parts, e, "weight").T for e in experts])
        yield f"{block}.gate_up_proj", gate_up.contiguous()
        yield f"{block}.gate_up_proj_bias", torch.stack([_interleave(parts, e, "bias") for e in experts])
        down = torch.stack([parts[(e, "down_proj.weight")].T for e in experts])
        yield f"{block}.down_proj", down.contiguous()
        yield f"{block}.down_proj_bias", torch.stack([parts[(e, "down_proj.bias")] for e in experts])
    if pending:
        raise ValueError(f"stream: experts of {sorted(pending)} missing")


def _interleave(parts: dict[tuple[int, str], torch.Tensor], e: int, kind: str) -> torch.Tensor:
    """Expert ``e``'s gate and up ``kind`` (weight / bias) as rows ``gate_0, up_0, gate_1, ...``."""
    g, u = parts[(e, f"gate_proj.{kind}")], parts[(e, f"up_proj.{kind}")]
    return torch.stack([g, u], dim=1).reshape(2 * g.shape[0], *g.shape[1:])
