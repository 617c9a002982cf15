"""Mismatched or corrupt Hugging Face folders are refused with a ValueError naming the culprit.

All of these checks run before ``load_hf_weights`` touches a parameter or a process group, so one
process and no model are enough here (the 2-rank test checks that parameters stay unchanged).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_engine.config import EngineConfig
from mcore_engine.hf import from_hf_config, load_hf_weights, read_hf_config
from tests.hf.models import save_tiny_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "llama"
    save_tiny_model("llama", path)
    return path


def _copy(src: Path, dst: Path, edit=None, config_edit=None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    if config_edit is not None:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _cfg(path: Path) -> EngineConfig:
    return EngineConfig(model=from_hf_config(read_hf_config(path), hf_path=str(path)))


def test_missing_tensor(llama, tmp_path):
    bad = _copy(llama, tmp_path / "bad", edit=lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(ValueError, match="'model.layers.1.self_attn.v_proj.weight' is missing"):
        load_hf_weights([], bad, _cfg(llama))


def test_wrong_shape(llama, tmp_path):
    def edit(t):
        t["model.embed_tokens.weight"] = torch.randn(249, 64)

    bad = _copy(llama, tmp_path / "bad", edit=edit)
    expected = r"'model.embed_tokens.weight' has shape \(249, 64\), expected \(250, 64\)"
    with pytest.raises(ValueError, match=expected):
        load_hf_weights([], bad, _cfg(llama))


def test_unexpected_tensor(llama, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.q_proj.bias"] = torch.randn(64)

    bad = _copy(llama, tmp_path / "bad", edit=edit)
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_proj.bias'"):
        load_hf_weights([], bad, _cfg(llama))


def test_unknown_architecture(llama, tmp_path):
    def config_edit(c):
        c.update(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")

    bad = _copy(llama, tmp_path / "bad", config_edit=config_edit)
    with pytest.raises(ValueError, match="architectures: unknown architecture.*GPTNeoXForCausalLM"):
        load_hf_weights([], bad, _cfg(llama))


def test_config_mismatch(llama):
    cfg = _cfg(llama)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_query_groups=4))
    with pytest.raises(ValueError, match="model.num_query_groups"):
        load_hf_weights([], llama, cfg)


def test_corrupt_or_absent_files(llama, tmp_path):
    bad = _copy(llama, tmp_path / "truncated")
    raw = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_hf_weights([], bad, _cfg(llama))

    no_config = _copy(llama, tmp_path / "no_config")
    (no_config / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_weights([], no_config, _cfg(llama))

    only_bin = _copy(llama, tmp_path / "only_bin")
    (only_bin / "model.safetensors").rename(only_bin / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_hf_weights([], only_bin, _cfg(llama))
