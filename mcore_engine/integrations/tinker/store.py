"""Checkpoint archives of the Tinker backend (controller side: staging folders, tars, metadata).

- Training state (``save_state``): an **uncompressed** tar of a staging folder holding ``engine/``
  (the engine's reshardable ``torch_dist`` checkpoint) and ``tinker_meta.json`` (:data:`FORMAT`, base
  model, role, LoRA rank / alpha / targets or null), written to ``path + ".tmp"`` then renamed.
- Sampler weights (``save_weights_for_sampler``): a **gzip** tar whose root is a PEFT folder
  (``adapter_config.json`` + ``adapter_model.safetensors``: LoRA), a Hugging Face folder (full fine-
  tuning) or a single ``MARKER`` file (full fine-tuning with ``persist=False``: the weights live in
  the sampler's memory only). SkyRL's ``download_and_unpack`` reads these (``"r:gz"``).

Staging folders sit next to the archive (``<dir>/.staging-<uuid>``, the same file system, visible to
every rank) and are removed afterwards. Extraction uses ``filter="data"`` (no path traversal).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import uuid
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "MARKER", "META", "check_inside", "check_meta", "extract", "read_meta", "remove",
           "staging_dir", "write_marker", "write_meta", "write_tar"]

FORMAT = "mcore_engine.torch_dist/1"
META = "tinker_meta.json"
MARKER = "MARKER"


def check_inside(path: str | os.PathLike, base: str | os.PathLike | None, what: str = "path") -> Path:
    """``path`` resolved; ``ValueError`` naming ``what`` when ``base`` is given and it is not inside."""
    resolved = Path(path).resolve()
    if base is not None and not resolved.is_relative_to(Path(base).resolve()):
        raise ValueError(f"{what}: {str(path)!r} is outside the checkpoints folder {str(base)!r}")
    return resolved


def staging_dir(archive: str | os.PathLike) -> Path:
    """A fresh, not yet created, staging folder next to ``archive``."""
    return Path(archive).resolve().parent / f".staging-{uuid.uuid4().hex}"


def remove(folder: str | os.PathLike) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _atomic(output_path: str | os.PathLike, mode: str, fill) -> None:
    out = Path(output_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with tarfile.open(tmp, mode) as tar:
            fill(tar)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def write_tar(source_dir: str | os.PathLike, output_path: str | os.PathLike, *, gzip: bool) -> None:
    """``source_dir``'s contents at the archive root, written atomically (``.tmp`` + rename)."""
    src = Path(source_dir)

    def fill(tar: tarfile.TarFile) -> None:
        for child in sorted(src.iterdir()):
            tar.add(child, arcname=child.name)

    _atomic(output_path, "w:gz" if gzip else "w", fill)


def write_marker(output_path: str | os.PathLike, model_id: str) -> None:
    """A gzip tar holding only :data:`MARKER` (weights kept in memory, ``persist=False``)."""
    text = (f"mcore_engine sampler marker for {model_id}: weights live in the server's memory "
            "(persist=False)\n").encode()

    def fill(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(MARKER)
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))

    _atomic(output_path, "w:gz", fill)


def extract(archive: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Unpack ``archive`` (plain or gzip tar) into ``dest``; ``ValueError`` naming the path when it is
    missing or not a tar."""
    if not Path(archive).is_file():
        raise ValueError(f"path: checkpoint {str(archive)!r} does not exist")
    try:
        with tarfile.open(archive, "r:*") as tar:
            tar.extractall(dest, filter="data")
    except tarfile.TarError as exc:
        raise ValueError(f"path: {str(archive)!r} is not a readable checkpoint archive ({exc})") from exc


def write_meta(folder: str | os.PathLike, meta: dict[str, Any]) -> None:
    Path(folder, META).write_text(json.dumps({"format": FORMAT, **meta}, indent=1, sort_keys=True))


def read_meta(folder: str | os.PathLike) -> dict[str, Any]:
    """The archive's :data:`META`; ``ValueError`` when absent or of another format."""
    file = Path(folder, META)
    if not file.is_file():
        raise ValueError(f"path: the archive has no {META} (not a checkpoint of this server's save_state)")
    meta = json.loads(file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"path: checkpoint format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def check_meta(meta: dict[str, Any], expected: dict[str, Any]) -> None:
    """``ValueError`` naming the first of role / LoRA settings where the checkpoint and the model differ."""
    if meta.get("role") != expected["role"]:
        raise ValueError(f"model_role: the checkpoint is of a {meta.get('role')!r} model, this model is "
                         f"a {expected['role']!r}")
    saved, want = meta.get("lora"), expected["lora"]
    if (saved is None) != (want is None):
        def kind(x: Any) -> str:
            return "full fine-tuning (rank 0)" if x is None else f"LoRA rank {x['rank']}"

        raise ValueError(f"lora_config.rank: the checkpoint is {kind(saved)}, this model {kind(want)}")
    if saved is not None:
        for key in ("rank", "alpha", "targets"):
            if saved.get(key) != want[key]:
                raise ValueError(f"lora_config.{key}: the checkpoint has {saved.get(key)!r}, this model "
                                 f"{want[key]!r}")
