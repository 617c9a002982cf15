"""The Qwen3.5 / Qwen3.5-MoE / Qwen3-Next families on the Hugging Face side (one process, no model build):
``config.json`` <-> ``ModelConfig``, the names ``save_pretrained`` writes all placed, the new TP layouts
(gated ``q_proj``, GDN ``in_proj_qkv`` / ``conv1d``, Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``) shard
and gather back exactly, vision-language folders (prefix, vision tower kept out), fused experts, and the
refusals."""

from __future__ import annotations

import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_engine.hf.checkpoint_io import HFCheckpointReader
from mcore_engine.hf.families import family_of, hf_family_of
from mcore_engine.hf.folder import FolderReader, folder_format, folder_stream
from mcore_engine.hf.hf_config import from_hf_config, to_hf_config
from mcore_engine.hf.hybrid import assemble_parts, row_map
from mcore_engine.hf.layout import gathered_names, hf_from_gathered, shard_from_hf
from mcore_engine.hf.load import check_shapes
from mcore_engine.hf.mapping import check_hf_names, hf_shapes, hf_stream_shapes, model_units, unit_rule
from tests.hf import qwen3_5_models as M


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One save_pretrained folder per kind, plus a Hub-layout (fused experts) Qwen3.5-MoE VL folder."""
    root = tmp_path_factory.mktemp("qwen3_5")
    out = {kind: M.save_tiny_model(kind, root / kind, seed=i, mtp=kind in ("qwen3_next", "qwen3_5_vl"))
           for i, kind in enumerate(M.KINDS)}
    out["qwen3_5_moe_vl_fused"] = M.save_tiny_model("qwen3_5_moe_vl", root / "fused", seed=9,
                                                    fused_experts=True)
    return out


# ------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kind", M.KINDS)
def test_config_fields_and_round_trip(kind, tmp_path):
    import transformers

    d = M.hf_config_dict(kind)
    cfg = from_hf_config(d)
    text = M.text_fields(kind)
    g = cfg.linear_attention
    assert (g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim, g.conv_kernel_dim) == (
        text["linear_num_key_heads"], text["linear_num_value_heads"], text["linear_key_head_dim"],
        text["linear_value_head_dim"], text["linear_conv_kernel_dim"])
    assert g.layer_pattern(4) == [True, True, True, False]
    assert cfg.attention_output_gate and cfg.zero_centered_norm and cfg.qk_layernorm and not cfg.add_qkv_bias
    assert cfg.rotary_percent == 0.25 and cfg.vocab_size == M.VOCAB and cfg.mtp_num_layers == 0
    assert cfg.tie_word_embeddings == (kind == "qwen3_5")
    if "moe" in kind or kind == "qwen3_next":
        moe = cfg.moe
        assert (moe.num_experts, moe.router_topk, moe.ffn_hidden_size,
                moe.shared_expert_ffn_hidden_size) == (4, 2, 24, 40)
        assert moe.shared_expert_gate and not moe.router_pre_softmax  # top-k renormalised
        assert moe.layer_pattern(4) == ([1, 0, 1, 1] if kind == "qwen3_next" else [1, 1, 1, 1])
    else:
        assert cfg.moe is None
    assert family_of(cfg).model_type == M.MODEL_TYPES[kind] or kind == "qwen3_next"

    back = to_hf_config(cfg, base=d)
    assert from_hf_config(back) == cfg
    assert back["architectures"] == d["architectures"] and back["model_type"] == d["model_type"]
    if "text_config" in d:  # the vision-language folder stays one, its vision config untouched
        assert back["vision_config"] == d["vision_config"]
        assert {k: back["text_config"].get(k) for k in d["text_config"]} == d["text_config"]
    else:
        assert {k: back.get(k) for k in d if k != "dtype"} == {k: v for k, v in d.items() if k != "dtype"}
    (tmp_path / "config.json").write_text(json.dumps(back))
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is type(M.hf_config(kind))
    assert from_hf_config(json.loads(loaded.to_json_string(use_diff=False))) == cfg
    if kind != "qwen3_next":  # without a base: the family of the ModelConfig (Qwen3-Next: Qwen3.5-MoE)
        assert from_hf_config(to_hf_config(cfg)) == cfg


def test_qwen3_next_keeps_its_family_and_defaults():
    d = M.hf_config_dict("qwen3_next", mlp_only_layers=[])
    cfg = from_hf_config(d)
    assert family_of(cfg).model_type == "qwen3_5_moe_text"  # same math
    assert to_hf_config(cfg, base=d)["architectures"] == ["Qwen3NextForCausalLM"]  # the source's layout kept
    d.pop("norm_topk_prob")
    assert not from_hf_config(d).moe.router_pre_softmax  # transformers' default: renormalised
    assert from_hf_config({**d, "norm_topk_prob": False}).moe.router_pre_softmax
    # a Qwen3-Next pattern Qwen3.5-MoE cannot express maps to Qwen3-Next without a base
    assert to_hf_config(from_hf_config(M.hf_config_dict("qwen3_next")))["model_type"] == "qwen3_next"


def test_multimodal_ties_by_the_outer_flag():
    d = M.hf_config_dict("qwen3_5_vl")
    d["tie_word_embeddings"] = True  # text_config keeps its own False, as Hub folders may
    cfg = from_hf_config(d)
    assert cfg.tie_word_embeddings
    assert to_hf_config(cfg, base=d) == {**d, "dtype": "float32"}


def test_full_attention_interval_without_layer_types():
    d = M.hf_config_dict("qwen3_5")
    d.pop("layer_types")
    d["full_attention_interval"] = 2
    cfg = from_hf_config(d)
    assert cfg.linear_attention.layer_pattern(4) == [True, False, True, False]
    back = to_hf_config(cfg, base=d)
    assert back["layer_types"] == ["linear_attention", "full_attention"] * 2 and from_hf_config(back) == cfg


@pytest.mark.parametrize("change, field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, "rope_scaling"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
     "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_key_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attn_output_gate": False}, "attn_output_gate"),
])
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe_vl"])
def test_config_refusals(kind, change, field):
    d = M.hf_config_dict(kind)
    (d["text_config"] if "text_config" in d else d).update(change)
    with pytest.raises(ValueError, match=f"^{field}"):
        from_hf_config(d)


def test_export_refusals():
    cfg = from_hf_config(M.hf_config_dict("qwen3_5"))
    for change, field in (({"attention_output_gate": False}, "attention_output_gate"),
                          ({"mtp_num_layers": 2}, "mtp_num_layers")):
        with pytest.raises(ValueError, match=field):
            to_hf_config(dataclasses.replace(cfg, **change))


# ------------------------------------------------------------------------------------------ names
@pytest.mark.parametrize("kind", [*M.KINDS, "qwen3_5_moe_vl_fused"])
def test_saved_names_all_placed(kind, folders, caplog):
    path = folders[kind]  # the language model alone (vision=None): the tower kept out
    cfg = from_hf_config(json.loads((path / "config.json").read_text()), hf_path=str(path), vision=None)
    with HFCheckpointReader(path) as raw, caplog.at_level(logging.INFO, logger="mcore_engine.hf.folder"):
        reader = FolderReader(raw)
        names = reader.names()
        check_hf_names(names, cfg)
        shapes = hf_shapes(cfg)
        reader.check(shapes)
        assert set(shapes) == set(names)  # every tensor loaded, every parameter found
        assert ("lm_head.weight" in raw.names()) != (kind == "qwen3_5")  # tied folders have none
        vision = [n for n in raw.names() if n.startswith("model.visual.")]
        mtp = [n for n in raw.names() if n.startswith("mtp.")]
        assert bool(vision) == ("_vl" in kind) and bool(mtp) == (kind in ("qwen3_next", "qwen3_5_vl"))
        said = [r.getMessage() for r in caplog.records if "kept out of the engine" in r.getMessage()]
        assert len(said) == (1 if vision or mtp else 0)
        assert not said or said[0].startswith(f"hf_path: {len(vision) + len(mtp)} tensors")
    fmt = folder_format(path)
    assert fmt.prefix == ("_vl" in kind) and fmt.fused_experts == kind.endswith("fused")
    # the sync / export stream has exactly the folder's language-model names
    kept_out = ("model.visual.", "mtp.")
    assert set(hf_stream_shapes(cfg)) == {n for n in raw_names(path) if not n.startswith(kept_out)}
    units = model_units(cfg)
    gdn = [u for u in units if ".in_proj_qkv." in u]
    assert [u.split(".")[2] for u in gdn] == ["0", "1", "2"]
    assert [u.split(".")[2] for u in units if ".linear_qkv." in u] == ["3"]


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe_vl_fused"])
def test_stream_order_is_the_sync_plan(kind, folders):
    """The engine-order stream (units, Qwen3-Next parts, per-expert tensors) through assemble_parts and
    folder_stream gives hf_stream_shapes' names, shapes and order (what the bucketed sync plans by)."""
    path = folders[kind]
    cfg = from_hf_config(json.loads((path / "config.json").read_text()), hf_path=str(path), vision=None)
    shapes = hf_shapes(cfg)

    def engine_stream():
        for unit in model_units(cfg):
            rule = unit_rule(unit, cfg)
            for name in gathered_names(rule):
                base, _, part = name.partition("#")
                rows = row_map(part, cfg, 1).numel() if part else shapes[base][0]
                yield name, torch.empty((rows, *shapes[base][1:]), device="meta")

    got = folder_stream(assemble_parts(engine_stream(), cfg, 1), folder_format(path), cfg.moe.num_experts)
    assert [(n, tuple(t.shape)) for n, t in got] == list(hf_stream_shapes(cfg).items())


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_vl"])
def test_mtp_module_placed_when_asked(kind, folders):
    """model.mtp_num_layers = 1: every mtp.* tensor has its unit (fc, norms, a full-attention layer) and
    is in the sync stream; more modules than the folder's one are refused."""
    path = folders[kind]
    cfg = from_hf_config(json.loads((path / "config.json").read_text()), hf_path=str(path), mtp_num_layers=1,
                         vision=None)  # a vision-language model has no MTP here: its language model alone
    with HFCheckpointReader(path) as raw:
        reader = FolderReader(raw, load_mtp=True)
        names = reader.names()
        check_hf_names(names, cfg)
        reader.check(hf_shapes(cfg))
        assert set(hf_shapes(cfg)) == set(names)
        assert any(n.startswith("mtp.layers.0.self_attn.") for n in names)
    mtp = {n for n in names if n.startswith("mtp.")}
    assert {n for n in hf_stream_shapes(cfg) if n.startswith("mtp.")} == mtp
    back = to_hf_config(cfg)  # without a base: the module count written
    assert (back.get("text_config") or back)["mtp_num_hidden_layers"] == 1
    assert from_hf_config(back, hf_path=str(path), mtp_num_layers=1, vision=None) == cfg
    with pytest.raises(ValueError, match="mtp_num_layers"):
        to_hf_config(dataclasses.replace(cfg, mtp_num_layers=2))


def raw_names(path) -> list[str]:
    with HFCheckpointReader(path) as raw:
        return raw.names()


def test_fused_experts_read_and_written_back(folders):
    per_expert, fused = folders["qwen3_5_moe_vl"], folders["qwen3_5_moe_vl_fused"]
    cfg = from_hf_config(json.loads((fused / "config.json").read_text()), hf_path=str(fused))
    shapes = hf_shapes(cfg)
    tensors = load_file(str(per_expert / "model.safetensors"))
    with HFCheckpointReader(fused) as raw, HFCheckpointReader(per_expert) as raw2:
        a, b = FolderReader(raw), FolderReader(raw2)
        for name in [n for n in shapes if ".experts." in n]:
            ref = b.read(name, shapes[name])
            assert torch.equal(ref, tensors[name.replace("model.", "model.language_model.", 1)])
            # a seed-9 folder differs from seed 4: compare the fused folder with its own source tensors
            full = a.read(name, shapes[name])
            rows = shapes[name][0]
            assert torch.equal(a.read(name, shapes[name], 0, 1, rows), full[1:])
            assert torch.equal(a.read(name, shapes[name], 1, 2, 5), full[:, 2:5])
    fused_tensors = load_file(str(fused / "model.safetensors"))
    engine = {}
    with HFCheckpointReader(fused) as raw:
        reader = FolderReader(raw)
        for name in shapes:
            engine[name] = reader.read(name, shapes[name])
    out = dict(folder_stream(iter(engine.items()), folder_format(fused), cfg.moe.num_experts))
    assert set(out) | {n for n in fused_tensors if n.startswith("model.visual.")} == set(fused_tensors)
    for name, t in out.items():
        assert torch.equal(t, fused_tensors[name]), name


# ----------------------------------------------------------------------------------------- layouts
def _reader(tensors):
    def read(name, dim=0, start=None, stop=None):
        t = tensors[name]
        if start is None:
            return t
        return t[start:stop] if dim == 0 else t[:, start:stop]
    return read


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("tp", [1, 2])
def test_layouts_shard_and_gather_back(kind, tp):
    """Every unit of every layer: the TP shards of random Hugging Face tensors, concatenated, give the
    tensors back (Qwen3-Next's parts reassembled)."""
    cfg = from_hf_config(M.hf_config_dict(kind))
    torch.manual_seed(0)
    tensors = {n: torch.randn(s, dtype=torch.float64) for n, s in hf_shapes(cfg).items()}
    read = _reader(tensors)
    out = []
    for unit in model_units(cfg):
        rule = unit_rule(unit, cfg)
        if rule.expert and tp > 1:
            continue
        if unit == "output_layer.weight":
            continue
        full_shape = list(_engine_shape(rule, tensors))
        local = list(full_shape)
        if rule.tp_dim is not None:
            local[rule.tp_dim] //= tp
        shards = [shard_from_hf(rule, read, cfg, r, tp, torch.Size(local)) for r in range(tp)]
        full = shards[0] if rule.tp_dim is None else torch.cat(shards, dim=rule.tp_dim)
        out += hf_from_gathered(rule, full, cfg, tp)
    back = dict(assemble_parts(iter(out), cfg, tp))
    for name, t in tensors.items():
        if name in back:
            assert torch.equal(back[name], t), name
    assert {n for n in tensors if ".experts." not in n or tp == 1} - {"lm_head.weight"} <= set(back)


def _engine_shape(rule, tensors):
    if rule.kind == "qkv":
        rows = sum(tensors[n].shape[0] for n in rule.hf_names)
        return (rows, *tensors[rule.hf_names[0]].shape[1:])
    if rule.kind == "gate_up":
        return (2 * tensors[rule.hf_names[0]].shape[0], *tensors[rule.hf_names[0]].shape[1:])
    t = tensors[rule.hf_names[0]]
    if rule.kind in ("next_qkv", "next_z", "next_b", "next_a"):
        rows = {"next_qkv": 64 + 64, "next_z": 64, "next_b": 4, "next_a": 4}[rule.kind]
        return (rows, *t.shape[1:])
    return tuple(t.shape)


def test_gated_q_proj_layout():
    """Megatron's rows per query group [q heads; gate heads; k; v] (attention.py with the output gate)
    against transformers' q_proj, which holds per head [q_h; gate_h]."""
    cfg = from_hf_config(M.hf_config_dict("qwen3_5"))
    rule = unit_rule("decoder.layers.3.self_attention.linear_qkv.weight", cfg)
    shapes = hf_shapes(cfg)
    tensors = {n: torch.randn(shapes[n]) for n in rule.hf_names}
    full = shard_from_hf(rule, _reader(tensors), cfg, 0, 1, torch.Size((4 * 32 + 2 * 32, 64)))
    q, k, v = (tensors[n] for n in rule.hf_names)
    d, heads, groups = 16, 4, 2
    q_h, gate_h = q.view(heads, 2, d, 64).unbind(1)  # transformers: view(..., -1, 2d).chunk(2)
    per = heads // groups
    expected = torch.cat([torch.cat([q_h[g * per:(g + 1) * per].reshape(-1, 64),
                                     gate_h[g * per:(g + 1) * per].reshape(-1, 64),
                                     k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]) for g in range(groups)])
    assert torch.equal(full, expected)
    # rank 1 of TP 2 holds query group 1 whole
    assert torch.equal(shard_from_hf(rule, _reader(tensors), cfg, 1, 2, torch.Size((96, 64))), expected[96:])


def test_qwen3_next_split_matches_transformers():
    """The engine's in_proj_qkv / z / b / a rows read from in_proj_qkvz / in_proj_ba give what
    Qwen3NextGatedDeltaNet.fix_query_key_value_ordering computes."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    cfg = from_hf_config(M.hf_config_dict("qwen3_next"))
    shapes = hf_shapes(cfg)
    qkvz_name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    ba_name = "model.layers.0.linear_attn.in_proj_ba.weight"
    tensors = {qkvz_name: torch.randn(shapes[qkvz_name], dtype=torch.float64),
               ba_name: torch.randn(shapes[ba_name], dtype=torch.float64)}
    # the weights' columns as tokens: the split is a pure permutation, compared exactly
    owner = SimpleNamespace(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)
    q, k, v, z, b, a = Qwen3NextGatedDeltaNet.fix_query_key_value_ordering(
        owner, tensors[qkvz_name].T[None], tensors[ba_name].T[None])
    read = _reader(tensors)

    def unit(suffix, rows, tp=1, rank=0):
        rule = unit_rule(f"decoder.layers.0.self_attention.{suffix}", cfg)
        return shard_from_hf(rule, read, cfg, rank, tp, torch.Size((rows // tp, 64)))

    assert torch.equal(unit("in_proj_qkv.weight", 128).T[None], torch.cat([q.flatten(2), k.flatten(2),
                                                                          v.flatten(2)], -1))
    assert torch.equal(unit("in_proj_z.weight", 64).T[None], z.flatten(2))
    assert torch.equal(unit("in_proj_b.weight", 4).T[None], b)
    assert torch.equal(unit("in_proj_a.weight", 4).T[None], a)
    # TP 2: rank 1 holds key head 1 and value heads 2, 3: [q_1; k_1; v_2,3]
    qkv1 = unit("in_proj_qkv.weight", 128, 2, 1).T[None]
    assert torch.equal(qkv1, torch.cat([q[:, :, 1], k[:, :, 1], v[:, :, 2:].flatten(2)], -1))


# ----------------------------------------------------------------------------------- bad folders
def _rewrite(path, tmp_path, edit):
    out = tmp_path / "bad"
    out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.update({"model.layers.1.linear_attn.in_proj_qkv.weight":
                         t["model.layers.1.linear_attn.in_proj_qkv.weight"][:-16]}),
     r"in_proj_qkv.*config.json: layer 1 is 'linear_attention'.*linear_num_key_heads="),
    (lambda t: t.update({"model.layers.0.linear_attn.conv1d.weight":
                         t["model.layers.0.linear_attn.conv1d.weight"][..., :3].contiguous()}),
     r"conv1d.*linear_conv_kernel_dim=4"),
    (lambda t: t.update({"model.layers.3.linear_attn.A_log": torch.zeros(4)}),
     r"layers.3.linear_attn.A_log.*config.json: layer 3 is 'full_attention' in layer_types"),
])
def test_folder_disagreeing_with_its_config_is_refused(folders, tmp_path, edit, match):
    bad = _rewrite(folders["qwen3_5"], tmp_path, edit)
    cfg = from_hf_config(json.loads((bad / "config.json").read_text()), hf_path=str(bad))
    with HFCheckpointReader(bad) as raw, pytest.raises(ValueError, match=match):
        reader = FolderReader(raw)
        check_hf_names(reader.names(), cfg)
        check_shapes(reader, hf_shapes(cfg), cfg)


def test_hf_family_of_multimodal():
    assert hf_family_of(M.hf_config_dict("qwen3_5_vl")).model_type == "qwen3_5_text"
    assert hf_family_of({"model_type": "qwen3_5_moe"}).model_type == "qwen3_5_moe_text"


def test_engine_config_must_match_the_folder():
    from mcore_engine.hf.load import check_config_matches

    folder = from_hf_config(M.hf_config_dict("qwen3_5_moe"))
    gdn = folder.linear_attention
    check_config_matches(dataclasses.replace(folder, linear_attention=dataclasses.replace(gdn, chunk_size=8)),
                         folder)  # the chunk size is the engine's choice
    for change, field in (({"conv_kernel_dim": 3}, "linear_attention.conv_kernel_dim"),
                          ({"layer_types": ["linear_attention"] * 2 + ["full_attention"] * 2},
                           "linear_attention.layer_types"),
                          ({"num_value_heads": 2}, "linear_attention.num_value_heads")):
        engine = dataclasses.replace(folder, linear_attention=dataclasses.replace(gdn, **change))
        with pytest.raises(ValueError, match=f"model.{field}"):
            check_config_matches(engine, folder)
    for change, field in (({"linear_attention": None}, "linear_attention"),
                          ({"attention_output_gate": False}, "attention_output_gate"),
                          ({"zero_centered_norm": False}, "zero_centered_norm")):
        with pytest.raises(ValueError, match=f"model.{field}"):
            check_config_matches(dataclasses.replace(folder, **change), folder)
