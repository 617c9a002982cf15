"""Config mapping, TP layout transforms and safetensors I/O of ``mcore_engine.hf`` (one process, fast)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_engine.config import ModelConfig
from mcore_engine.hf.checkpoint_io import HFCheckpointReader, ShardedSafetensorsWriter
from mcore_engine.hf.hf_config import from_hf_config, to_hf_config
from mcore_engine.hf.layout import hf_from_gathered, shard_from_hf
from mcore_engine.hf.mapping import (
    canonical_unit,
    check_hf_names,
    hf_shapes,
    iter_units,
    model_units,
    unit_rule,
)
from tests.hf.models import FAMILIES, hf_config_dict


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_config_fields(family):
    d = hf_config_dict(family)
    cfg = from_hf_config(d, hf_path="/x")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups) == (
        d["num_hidden_layers"], d["hidden_size"], d["num_attention_heads"], d["num_key_value_heads"])
    assert (cfg.ffn_hidden_size, cfg.vocab_size, cfg.max_sequence_length) == (
        d["intermediate_size"], d["vocab_size"], d["max_position_embeddings"])
    assert cfg.rotary_base == d["rope_parameters"]["rope_theta"] and cfg.norm_epsilon == d["rms_norm_eps"]
    assert cfg.tie_word_embeddings == d["tie_word_embeddings"] and cfg.hf_path == "/x"
    assert (cfg.add_qkv_bias, cfg.qk_layernorm) == {"llama": (False, False), "qwen2": (True, False),
                                                    "qwen3": (False, True)}[family]
    assert cfg.normalization == "RMSNorm" and cfg.swiglu


@pytest.mark.parametrize("family", FAMILIES)
def test_to_hf_config_round_trip(family):
    d = hf_config_dict(family)
    cfg = from_hf_config(d)
    back = to_hf_config(cfg, dtype=torch.bfloat16, base=d)
    assert from_hf_config(back) == cfg
    assert back["dtype"] == "bfloat16" and back["architectures"] == d["architectures"]
    assert from_hf_config(to_hf_config(cfg)) == cfg  # without a base config too


def test_legacy_rope_theta_key():
    d = hf_config_dict("qwen2")
    d.pop("rope_parameters")
    d["rope_theta"] = 1e6
    assert from_hf_config(d).rotary_base == 1e6


@pytest.mark.parametrize("change, field", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "rope_scaling"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "use_sliding_window"),
])
def test_from_hf_config_refusals(change, field):
    d = hf_config_dict("llama") | change
    with pytest.raises(ValueError, match=field):
        from_hf_config(d)


def test_head_dim_other_than_hidden_over_heads():
    d = hf_config_dict("qwen3") | {"head_dim": 32}  # Qwen3-0.6B-like: heads * head_dim != hidden
    cfg = from_hf_config(d)
    assert cfg.kv_channels == 32 and hf_shapes(cfg)["model.layers.0.self_attn.q_proj.weight"] == (128, 64)
    assert to_hf_config(cfg)["head_dim"] == 32
    assert from_hf_config(hf_config_dict("qwen3")).kv_channels is None  # head_dim 16 = 64 / 4


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_llama3_rope_scaling_maps_to_rope_scaling_factor():
    cfg = from_hf_config(hf_config_dict("llama") | {"rope_parameters": LLAMA3_ROPE})
    assert cfg.rope_scaling_factor == 32.0 and cfg.rotary_base == 5e5
    assert to_hf_config(cfg)["rope_parameters"] == LLAMA3_ROPE
    assert from_hf_config(to_hf_config(cfg)) == cfg
    # the legacy keys (transformers < 5): rope_theta at the top, rope_scaling with "rope_type" or "type"
    legacy = {k: v for k, v in hf_config_dict("llama").items() if k != "rope_parameters"}
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    for key in ("rope_type", "type"):
        d = legacy | {"rope_theta": 5e5, "rope_scaling": {key: "llama3", **scaling}}
        d["rope_scaling"].pop("rope_type" if key == "type" else "type", None)
        assert from_hf_config(d) == cfg
    assert from_hf_config(hf_config_dict("llama")).rope_scaling_factor is None
    assert to_hf_config(from_hf_config(hf_config_dict("llama")))["rope_parameters"]["rope_type"] == "default"


@pytest.mark.parametrize("change", [{"low_freq_factor": 2.0}, {"high_freq_factor": 8.0},
                                    {"original_max_position_embeddings": 4096}, {"factor": -1.0},
                                    {"rope_type": "yarn"}])
def test_llama3_rope_scaling_other_than_megatrons_is_refused(change):
    d = hf_config_dict("llama") | {"rope_parameters": LLAMA3_ROPE | change}
    with pytest.raises(ValueError, match="rope_scaling") as err:
        from_hf_config(d)
    if "rope_type" not in change:
        assert next(iter(change)) in str(err.value) or "factor" in str(err.value)


def test_units_names_and_te_aliases():
    cfg = from_hf_config(hf_config_dict("qwen3"))
    assert canonical_unit("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", 5) == (
        "decoder.layers.5.input_layernorm.weight")
    assert canonical_unit("decoder.layers.1.mlp.linear_fc1.layer_norm_weight", 0) == (
        "decoder.layers.0.pre_mlp_layernorm.weight")
    with pytest.raises(ValueError, match="linear_fc1.bias"):  # dense MLP biases: no family has them
        canonical_unit("decoder.layers.0.mlp.linear_fc1.bias", 0)
    # gpt-oss's o_proj bias is a unit, but not of a model without add_bias_linear
    assert "decoder.layers.0.self_attention.linear_proj.bias" not in model_units(cfg)
    names = [n for u in model_units(cfg) for n in unit_rule(u, cfg).hf_names]
    assert names == list(hf_shapes(cfg))
    assert "model.layers.1.self_attn.k_norm.weight" in names and "lm_head.weight" in names
    check_hf_names(names, cfg)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.bias"):
        check_hf_names(names + ["model.layers.0.self_attn.q_proj.bias"], cfg)


# --------------------------------------------------------------------------------- layout transforms
def _random_hf(cfg: ModelConfig, unit: str):
    rule = unit_rule(unit, cfg)
    shapes = hf_shapes(cfg)
    return rule, {n: torch.randn(shapes[n], dtype=torch.float64) for n in rule.hf_names}


def _reference_full(kind, hf, names, cfg, tp, padded_vocab):
    """The gathered Megatron tensor written out from the layout definitions (float64)."""
    if kind == "replicated" or kind == "row":
        return hf[names[0]]
    if kind == "vocab":
        t = hf[names[0]]
        return torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
    if kind == "gate_up":
        gate, up = (hf[n].chunk(tp) for n in names)
        return torch.cat([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
    ng = cfg.num_query_groups
    d = cfg.hidden_size // cfg.num_attention_heads
    q, k, v = hf[names[0]], hf[names[1]], hf[names[2]]
    qg = q.shape[0] // ng
    return torch.cat([torch.cat([q[g * qg:(g + 1) * qg], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]])
                      for g in range(ng)])


@pytest.mark.parametrize("heads, groups, tp", [(6, 3, 3), (6, 1, 2), (4, 4, 2), (8, 2, 4), (6, 2, 1)])
@pytest.mark.parametrize("unit", [f"decoder.layers.0.{s}" for s in (
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight",
    "self_attention.linear_proj.weight", "input_layernorm.weight")] + ["embedding.word_embeddings.weight"])
def test_shard_and_gather_inverse(heads, groups, tp, unit):
    cfg = ModelConfig(num_layers=1, hidden_size=heads * 5, num_attention_heads=heads, num_query_groups=groups,
                      ffn_hidden_size=12 * tp, vocab_size=37, max_sequence_length=8, add_qkv_bias=True,
                      make_vocab_size_divisible_by=4)
    rule, hf = _random_hf(cfg, unit)
    calls = []

    def read(name, dim=0, start=None, stop=None):
        t = hf[name]
        t = t if start is None else t.narrow(dim, start, stop - start)
        calls.append(t.numel())
        return t

    padded = -(-cfg.vocab_size // (4 * tp)) * 4 * tp
    full_ref = _reference_full(rule.kind, hf, rule.hf_names, cfg, tp, padded)
    dim = rule.tp_dim
    local_ref = [full_ref] * tp if dim is None else list(full_ref.chunk(tp, dim=dim))
    shards = []
    for r in range(tp):
        calls.clear()
        shard = shard_from_hf(rule, read, cfg, r, tp, local_ref[r].shape)
        torch.testing.assert_close(shard, local_ref[r], rtol=0, atol=0)
        assert len(calls) <= len(rule.hf_names)  # one read per source tensor, of its shard's rows only
        assert sum(calls) <= shard.numel()
        shards.append(shard)
    gathered = shards[0] if dim is None else torch.cat(shards, dim=dim)
    back = dict(hf_from_gathered(rule, gathered, cfg, tp))
    assert list(back) == list(rule.hf_names)
    for name, t in back.items():
        assert t.dtype == hf[name].dtype and torch.equal(t, hf[name]), name


# ------------------------------------------------------------------------------------- safetensors io
def test_sharded_writer_and_reader(tmp_path):
    tensors = {f"t{i}": torch.randn(5 + i, 3) for i in range(5)}
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=2 * 7 * 3 * 4)
    for name, t in tensors.items():
        writer.add(name, t)
    files = writer.close()
    assert len(files) > 1 and all((tmp_path / f).is_file() for f in files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    with HFCheckpointReader(tmp_path) as reader:
        assert sorted(reader.names()) == sorted(tensors)
        assert torch.equal(reader.read("t3", (8, 3), 0, 2, 5), tensors["t3"][2:5])
        assert torch.equal(reader.read("t4", (9, 3), 1, 1, 3), tensors["t4"][:, 1:3])
        with pytest.raises(ValueError, match="'t2' has shape"):
            reader.read("t2", (8, 3))
        with pytest.raises(ValueError, match="'t9' is missing"):
            reader.check({"t0": (5, 3), "t9": (1,)})
    w = ShardedSafetensorsWriter(tmp_path)  # over the sharded export: stale shards and index go
    w.add("a", tensors["t0"][1:])  # a view with an offset storage
    assert w.close() == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert torch.equal(load_file(tmp_path / "model.safetensors")["a"], tensors["t0"][1:])


def test_reader_refuses_bad_folders(tmp_path):
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        HFCheckpointReader(tmp_path)
    save_file({"w": torch.randn(4, 4)}, str(tmp_path / "model.safetensors"))
    raw = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(raw[:20])
    with pytest.raises(ValueError, match="model.safetensors"):
        HFCheckpointReader(tmp_path)
    index = {"weight_map": {"w": "gone.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'w'"):
        HFCheckpointReader(tmp_path)


def _fake_chunk(layer_numbers: list[int], qkv_bias: bool) -> torch.nn.Module:
    """A module with GPTModel's parameter names: decoder.layers.<local>.self_attention.linear_qkv."""
    layers = torch.nn.ModuleList()
    for number in layer_numbers:
        layer = torch.nn.Module()
        layer.layer_number = number
        layer.self_attention = torch.nn.Module()
        layer.self_attention.linear_qkv = torch.nn.Linear(4, 4, bias=qkv_bias)
        layers.append(layer)
    chunk = torch.nn.Module()
    chunk.decoder = torch.nn.Module()
    chunk.decoder.layers = layers
    wrapper = torch.nn.Module()  # as DDP wraps it
    wrapper.module = chunk
    return wrapper


def test_iter_units_global_layers_and_mismatch():
    cfg = from_hf_config(hf_config_dict("llama") | {"num_hidden_layers": 4})
    units = [u for u, _, _ in iter_units(_fake_chunk([2, 4], qkv_bias=False), cfg)]
    assert units == ["decoder.layers.1.self_attention.linear_qkv.weight",
                     "decoder.layers.3.self_attention.linear_qkv.weight"]
    with pytest.raises(ValueError, match="decoder.layers.0.self_attention.linear_qkv.bias"):
        list(iter_units(_fake_chunk([1], qkv_bias=True), cfg))
