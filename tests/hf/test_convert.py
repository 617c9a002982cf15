"""``tools/convert.py``: HF -> engine checkpoint (TP=2) -> HF, bit for bit, on 2 gloo ranks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.hf.models import save_tiny_model
from tests.utils import run_distributed

TOOL = Path(__file__).resolve().parents[2] / "tools" / "convert.py"


def _convert_both_ways(rank: int, world_size: int, root: Path) -> None:
    spec = importlib.util.spec_from_file_location("convert_tool", TOOL)
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    convert.main(["hf-to-mcore", "--hf", str(root / "qwen3"), "--out", str(root / "ckpt"), "--tp", "2"])
    convert.main(["mcore-to-hf", "--ckpt", str(root / "ckpt"), "--out", str(root / "back"),
                  "--hf-base", str(root / "qwen3")])


@pytest.mark.slow  # two engine builds (model + DDP + optimizer) and a checkpoint on 2 ranks
def test_convert_round_trip_tp2(tmp_path):
    save_tiny_model("qwen3", tmp_path / "qwen3")
    (tmp_path / "qwen3" / "tokenizer_config.json").write_text("{}\n")
    run_distributed(_convert_both_ways, 2, tmp_path)
    assert (tmp_path / "ckpt" / "engine_config.yaml").is_file()
    original = load_file(tmp_path / "qwen3" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, t in original.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert (tmp_path / "back" / "tokenizer_config.json").read_text() == "{}\n"
