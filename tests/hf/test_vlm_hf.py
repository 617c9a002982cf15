"""The vision-language folders on the Hugging Face side: the tiny fixtures (``tests/hf/vlm_models.py``)
load in ``transformers`` as written, their image processor matches the tower, the tokenizer keeps
the vision tokens; ``config.json`` <-> ``ModelConfig.vision``; tower names / layout in and out."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from tests.hf import vlm_models as V


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return {kind: V.tiny_vlm_folder(kind, root / kind, seed=i) for i, kind in enumerate(V.KINDS)}


def _images(sizes, seed=0):
    g = np.random.default_rng(seed)
    return [(g.random((h, w, 3)) * 255).astype("uint8") for h, w in sizes]


# ----------------------------------------------------------------------------------------- fixtures
@pytest.mark.parametrize("kind", V.KINDS)
def test_fixture_folder_loads_and_runs_images(kind, folders):
    """The folder loads bit-identical to the built model, its tower tensors sit under the kind's prefix,
    its image processor makes patches the tower takes, and a two-image prompt runs in transformers."""
    from safetensors import safe_open
    from transformers import AutoImageProcessor

    path = folders[kind]
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == kind and config["architectures"] == [V.CLASSES[kind]]
    assert all(config[k] == v < V.VOCAB for k, v in V.VISION_TOKENS.items())
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    prefix = V.VISION_PREFIX[kind]
    lm = "model.layers." if kind == "qwen2_5_vl" else "model.language_model.layers."
    assert any(n.startswith(prefix + "blocks.0.") for n in names) and any(n.startswith(lm) for n in names)
    outer = ("model.embed_tokens", "model.norm", "model.language_model.embed_tokens",
             "model.language_model.norm", "lm_head")
    assert all(n.startswith((prefix, lm, *outer)) for n in names)
    assert ("lm_head.weight" in names) == (kind != "qwen3_vl")  # qwen3_vl: tied

    model = V.model_class(kind).from_pretrained(path, dtype=torch.float32).eval()
    ref = V.build_model(kind, seed=V.KINDS.index(kind))
    sd, rsd = model.state_dict(), ref.state_dict()
    assert sd.keys() == rsd.keys() and all(torch.equal(sd[k], rsd[k]) for k in sd)

    proc = AutoImageProcessor.from_pretrained(path)
    vision = model.config.vision_config
    assert (proc.patch_size, proc.temporal_patch_size, proc.merge_size) == (
        vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
    factor = vision.patch_size * vision.spatial_merge_size
    sizes = [(3 * factor, 5 * factor), (2 * factor + 3, 4 * factor - 5)]
    out = proc(images=_images(sizes), return_tensors="pt")
    grid = out["image_grid_thw"]
    assert out["pixel_values"].shape == (int(grid.prod(-1).sum()),
                                         3 * vision.temporal_patch_size * vision.patch_size ** 2)
    merged = (grid.prod(-1) // vision.spatial_merge_size ** 2).tolist()
    t = V.VISION_TOKENS
    ids = [5, 6, t["vision_start_token_id"], *[t["image_token_id"]] * merged[0], t["vision_end_token_id"], 7,
           t["vision_start_token_id"], *[t["image_token_id"]] * merged[1], t["vision_end_token_id"], 8, 9]
    ids = torch.tensor([ids])
    kw = dict(input_ids=ids, image_grid_thw=grid, mm_token_type_ids=V.mm_token_type_ids(ids))
    with torch.no_grad():
        logits = model(pixel_values=out["pixel_values"], **kw).logits
        other = model(pixel_values=out["pixel_values"] + 0.5, **kw).logits  # the images matter
    assert logits.shape == (1, ids.shape[1], V.VOCAB) and torch.isfinite(logits).all()
    assert (other[0, -1] - logits[0, -1]).abs().max() > 1e-4


def test_fixture_expert_layouts(tmp_path):
    """qwen3_vl_moe: Hub [E, H, 2I] / [E, I, H], save_pretrained's [E, 2I, H] / [E, H, I] and per-expert
    folders hold the same model (gate first in 2I); the two fused ones load in transformers (5.24 does
    not load per-expert Qwen3-VL-MoE tensors)."""
    from safetensors.torch import load_file

    models, files = {}, {}
    for layout in V.EXPERT_LAYOUTS:
        path = V.tiny_vlm_folder("qwen3_vl_moe", tmp_path / layout, seed=3, expert_layout=layout,
                                 tokenizer=False)
        files[layout] = load_file(str(path / "model.safetensors"))
        if layout != "per_expert":
            model = V.model_class("qwen3_vl_moe").from_pretrained(path, dtype=torch.float32)
            models[layout] = model.state_dict()
    blk = "model.language_model.layers.1.mlp.experts"
    hub, tf, per = files["hub"], files["transformers"], files["per_expert"]
    assert hub[f"{blk}.gate_up_proj"].shape == (4, 64, 48) and hub[f"{blk}.down_proj"].shape == (4, 24, 64)
    assert tf[f"{blk}.gate_up_proj"].shape == (4, 48, 64) and tf[f"{blk}.down_proj"].shape == (4, 64, 24)
    assert torch.equal(hub[f"{blk}.gate_up_proj"][2, :, :24].T, per[f"{blk}.2.gate_proj.weight"])
    assert torch.equal(hub[f"{blk}.gate_up_proj"][2, :, 24:].T, per[f"{blk}.2.up_proj.weight"])
    assert torch.equal(hub[f"{blk}.down_proj"][1].T, per[f"{blk}.1.down_proj.weight"])
    assert torch.equal(hub[f"{blk}.gate_up_proj"].transpose(1, 2), tf[f"{blk}.gate_up_proj"])
    ref, other = models["hub"], models["transformers"]
    assert ref.keys() == other.keys() and all(torch.equal(ref[k], other[k]) for k in ref)
    assert torch.equal(ref[f"{blk}.gate_up_proj"], tf[f"{blk}.gate_up_proj"])


def test_fixture_tokenizer_keeps_vision_tokens(folders):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folders["qwen2_5_vl"])
    content = [{"type": "image"}, {"type": "text", "text": "a b"}]
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                  tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    t = V.VISION_TOKENS
    start = ids.index(t["vision_start_token_id"])
    assert ids[start:start + 3] == [t["vision_start_token_id"], t["image_token_id"], t["vision_end_token_id"]]
    assert len(tok) == V.VOCAB and max(ids) < V.VOCAB
    assert tok.decode(ids[start + 3:start + 6]) == "a b"


# ------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kind", V.KINDS)
def test_config_vision_fields_and_round_trip(kind, folders):
    """from_hf_config fills ModelConfig.vision from the folder's config.json; to_hf_config writes it back
    (with the source: the same config.json; without: one transformers builds the same model from)."""
    import transformers

    from mcore_engine.hf.families import family_of
    from mcore_engine.hf.hf_config import from_hf_config, to_hf_config

    d = json.loads((folders[kind] / "config.json").read_text())
    cfg = from_hf_config(d)
    v = cfg.vision
    assert v.model_type == kind and v.vision_config == d["vision_config"]
    assert (v.image_token_id, v.video_token_id, v.vision_start_token_id) == (253, 254, 251)
    qwen3_5 = kind.startswith("qwen3_5")
    assert v.mrope_section == (V.QWEN3_5_MROPE_SECTION if qwen3_5 else V.MROPE_SECTION)
    assert v.mrope_interleaved == (kind != "qwen2_5_vl")
    assert v.tokens_per_second == (2.0 if kind == "qwen2_5_vl" else None)
    assert v.deepstack_visual_indexes == ([0, 1] if kind.startswith("qwen3_vl") else [])
    assert cfg.add_qkv_bias == (kind == "qwen2_5_vl") and cfg.qk_layernorm == (kind != "qwen2_5_vl")
    assert cfg.tie_word_embeddings == (kind == "qwen3_vl")
    text_families = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe",
                     "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
    assert family_of(cfg).model_type == text_families[kind]
    if kind == "qwen3_vl_moe":  # transformers' Qwen3-VL-MoE always renormalises the top-k weights
        assert (cfg.moe.num_experts, cfg.moe.router_topk, cfg.moe.ffn_hidden_size) == (4, 2, 24)
        assert not cfg.moe.router_pre_softmax and all(cfg.moe.layer_pattern(2))
    assert from_hf_config(d, vision=None).vision is None

    back = to_hf_config(cfg, base=d)
    assert from_hf_config(back) == cfg
    assert {k: v for k, v in back.items() if k != "torch_dtype"} == d
    fresh = to_hf_config(cfg)  # no source folder
    assert from_hf_config(fresh) == cfg
    config_cls = type(V.hf_config(kind))
    built = config_cls(**{k: x for k, x in fresh.items() if k != "model_type"})
    assert fresh["architectures"] == [V.CLASSES[kind]] and fresh["model_type"] == kind
    assert built.text_config.rope_parameters["mrope_section"] == v.mrope_section
    assert built.image_token_id == 253 and built.vision_config.depth == d["vision_config"]["depth"]
    model = V.model_class(kind)(built)
    assert sorted(model.state_dict()) == sorted(V.build_model(kind).state_dict())
    del transformers


def test_config_hub_flat_qwen2_5_vl_and_refusals():
    """The Hub's flat Qwen2.5-VL config.json (text fields at the top, rope_scaling type 'mrope') maps as
    the nested one and is written back nested; missing token ids / vision_config and a mismatched text
    family are refused naming the field."""
    import dataclasses

    from mcore_engine.hf.families import family_of
    from mcore_engine.hf.hf_config import from_hf_config, to_hf_config

    nested = V.hf_config_dict("qwen2_5_vl")
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters")
    flat = {k: v for k, v in nested.items() if k != "text_config"} | text
    flat |= {"model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"],
             "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    cfg = from_hf_config(flat)
    assert cfg == from_hf_config(nested)
    back = to_hf_config(cfg, base=flat)
    assert "text_config" in back and "hidden_size" not in back and from_hf_config(back) == cfg
    assert back["text_config"]["rope_parameters"]["mrope_section"] == rope["mrope_section"]
    for key in ("image_token_id", "vision_config"):
        with pytest.raises(ValueError, match=key):
            from_hf_config({k: v for k, v in nested.items() if k != key})
    with pytest.raises(ValueError, match="model.vision.model_type"):  # Qwen2.5-VL's text model has no QK-norm
        family_of(dataclasses.replace(cfg, qk_layernorm=True, add_qkv_bias=False))
    with pytest.raises(ValueError, match="model.head"):
        to_hf_config(dataclasses.replace(cfg, head="value"), base=nested)
    moe = from_hf_config(V.hf_config_dict("qwen3_vl_moe"))
    with pytest.raises(ValueError, match="router_pre_softmax"):
        to_hf_config(dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, router_pre_softmax=True)))


# ------------------------------------------------------------------------------------------- names
@pytest.mark.parametrize("kind,layout", [("qwen2_5_vl", "hub"), ("qwen3_vl", "hub"), ("qwen3_vl_moe", "hub"),
                                         ("qwen3_vl_moe", "transformers"), ("qwen3_vl_moe", "per_expert"),
                                         ("qwen3_5", "hub"), ("qwen3_5_moe", "hub"),
                                         ("qwen3_5_moe", "transformers")])
def test_names_read_and_streamed_back(kind, layout, tmp_path, caplog):
    """Every folder tensor (tower included) is placed and read by the engine's names; folder_stream of
    what was read gives the folder's names, layout and values; without ModelConfig.vision the tower is
    kept out (and still copied by export)."""
    from safetensors.torch import load_file

    from mcore_engine.hf.checkpoint_io import HFCheckpointReader
    from mcore_engine.hf.folder import FolderReader, folder_format, folder_stream, kept_out_names
    from mcore_engine.hf.hf_config import from_hf_config, read_hf_config
    from mcore_engine.hf.mapping import check_hf_names, hf_shapes, hf_stream_shapes, model_units, unit_rule

    path = V.tiny_vlm_folder(kind, tmp_path / kind, seed=4, expert_layout=layout, tokenizer=False)
    cfg = from_hf_config(read_hf_config(path), hf_path=str(path))
    shapes = hf_shapes(cfg)
    tower = [u for u in model_units(cfg) if u.startswith("vision.")]
    assert tower and model_units(cfg)[:len(tower)] == tower  # the tower first
    assert all(unit_rule(u, cfg).kind == "replicated" for u in tower)
    with HFCheckpointReader(path) as raw, FolderReader(raw, load_vision=True) as reader:
        assert sorted(reader.names()) == sorted(shapes)
        check_hf_names(reader.names(), cfg)
        reader.check(shapes)
        read = [(n, reader.read(n, s)) for n, s in shapes.items()]
        assert kept_out_names(raw, load_vision=True) == []
    fmt = folder_format(path)
    assert fmt.vision_prefix == V.VISION_PREFIX[kind] and fmt.prefix == (kind != "qwen2_5_vl")
    assert fmt.fused_columns == (kind == "qwen3_vl_moe" and layout == "hub")
    source = load_file(str(path / "model.safetensors"))
    streamed = dict(folder_stream(iter(read), fmt, cfg.moe.num_experts if cfg.moe else 0))
    assert sorted(streamed) == sorted(source)
    assert all(torch.equal(streamed[n], t) for n, t in source.items())
    assert list(hf_stream_shapes(cfg)) == list(streamed)
    assert all(hf_stream_shapes(cfg)[n] == tuple(t.shape) for n, t in streamed.items())

    text = from_hf_config(read_hf_config(path), hf_path=str(path), vision=None)
    prefix = V.VISION_PREFIX[kind]
    with (HFCheckpointReader(path) as raw, caplog.at_level(logging.INFO, logger="mcore_engine.hf.folder"),
          FolderReader(raw) as reader):
        assert sorted(reader.names()) == sorted(hf_shapes(text))
        assert sorted(kept_out_names(raw)) == sorted(n for n in source if n.startswith(prefix))
    assert not any(n.startswith(prefix) for n in hf_stream_shapes(text))
    said = [r.getMessage() for r in caplog.records if "kept out of the engine" in r.getMessage()]
    tower = sum(n.startswith(prefix) for n in source)
    assert said == [f"hf_path: {tower} tensors ({prefix}*) kept out of the engine: only the language model "
                    "is loaded"]


# ------------------------------------------------------------------------------------------ engine
# (folder kind, tp, ep, pp, with the tower): the tower loaded whole on every rank of the first stage,
# streamed and exported once under the folder's names; vision=None keeps today's text-only path
ENGINE_LAYOUTS = [("qwen2_5_vl", 2, 1, 1, True), ("qwen2_5_vl", 1, 1, 2, True),
                  ("qwen2_5_vl", 2, 1, 1, False), ("qwen3_vl", 2, 1, 1, True),
                  ("qwen3_vl_moe", 2, 1, 1, True), ("qwen3_vl_moe", 1, 2, 1, True),
                  ("qwen3_5", 2, 1, 1, True), ("qwen3_5_moe", 1, 2, 1, True)]


def _tag(kind, tp, ep, pp, tower):
    return f"{kind}_tp{tp}_ep{ep}_pp{pp}_{'vl' if tower else 'text'}"


def _check_engines(rank: int, world_size: int, root) -> None:
    from safetensors.torch import load_file

    from mcore_engine import MegatronEngine
    from mcore_engine.config import EngineConfig, ParallelConfig
    from mcore_engine.hf.hf_config import from_hf_config, read_hf_config
    from mcore_engine.hf.mapping import unwrap_chunk
    from mcore_engine.parallel.platform import destroy_distributed
    from mcore_engine.weight_sync import unflatten_bucket

    for kind, tp, ep, pp, tower in ENGINE_LAYOUTS:
        what = f"{_tag(kind, tp, ep, pp, tower)} rank={rank}"
        path = root / kind
        source = load_file(str(path / "model.safetensors"))
        prefix = V.VISION_PREFIX[kind]
        model = from_hf_config(read_hf_config(path), hf_path=str(path), **({} if tower else {"vision": None}))
        engine = MegatronEngine(EngineConfig(model=model, parallel=ParallelConfig(
            tensor_model_parallel_size=tp, expert_model_parallel_size=ep, pipeline_model_parallel_size=pp)))
        engine.initialize()
        first = unwrap_chunk(engine.model[0])
        if tower and (pp == 1 or rank == 0):  # the whole tower on every rank of the first stage
            params = dict(first.vision.named_parameters())
            in_folder = sorted(n for n in source if n.startswith(prefix))
            assert sorted(prefix + n for n in params) == in_folder, what
            for n, p in params.items():
                assert torch.equal(p.detach(), source[prefix + n]), f"{n} {what}"
        else:
            assert getattr(first, "vision", None) is None, what
        streamed = {n: t.clone() for n, t in engine.per_tensor_generator()}
        kept_out = ("mtp.",) if tower else ("mtp.", prefix)  # the Qwen3.5 folder's MTP module stays out
        want = {n: t for n, t in source.items() if not n.startswith(kept_out)}
        assert sorted(streamed) == sorted(want), what
        for n, t in want.items():
            assert streamed[n].dtype == t.dtype and torch.equal(streamed[n], t), f"{n} {what}"
        bucketed = {}
        for bucket, meta in engine.bucketed_weight_generator(1 << 16):
            bucketed.update({n: t.clone() for n, t in unflatten_bucket(bucket, meta).items()})
        assert list(bucketed) == list(streamed), what
        assert all(torch.equal(bucketed[n], t) for n, t in streamed.items()), what
        engine.export_hf(root / f"export_{_tag(kind, tp, ep, pp, tower)}")
        del engine
        destroy_distributed()


@pytest.mark.slow  # eight engine builds on 2 ranks
def test_engine_load_sync_and_export(tmp_path):
    """An engine built from each tiny folder holds exactly its tensors (the tower whole on each rank of
    the first stage, at TP = 2, EP = 2, PP = 2); per-tensor and bucketed sync stream the folder's names,
    layout and values (a Qwen3.5 folder's mtp.* module left out); export_hf writes the folder back
    (config.json and mtp.* included) and from_pretrained loads it to the source's state dict."""
    from safetensors.torch import load_file

    from tests.hf.qwen3_5_models import add_mtp_tensors
    from tests.utils import run_distributed

    for i, kind in enumerate(sorted({k for k, *_ in ENGINE_LAYOUTS})):
        V.tiny_vlm_folder(kind, tmp_path / kind, seed=20 + i, tokenizer=kind == "qwen2_5_vl")
    add_mtp_tensors(tmp_path / "qwen3_5", seed=3)  # as the Hub's: kept out, copied by export
    run_distributed(_check_engines, 2, tmp_path)

    states = {}
    for kind, tp, ep, pp, tower in ENGINE_LAYOUTS:
        out, path = tmp_path / f"export_{_tag(kind, tp, ep, pp, tower)}", tmp_path / kind
        source, exported = load_file(str(path / "model.safetensors")), {}
        for file in out.glob("*.safetensors"):
            exported.update(load_file(str(file)))
        assert sorted(exported) == sorted(source), out.name
        assert all(exported[n].dtype == t.dtype and torch.equal(exported[n], t) for n, t in source.items())
        config, source_config = (json.loads((p / "config.json").read_text()) for p in (out, path))
        assert {k: v for k, v in config.items() if k != "torch_dtype"} == source_config, out.name
        processor = "preprocessor_config.json"
        assert (out / processor).read_text() == (path / processor).read_text()
        if kind not in states:
            states[kind] = V.model_class(kind).from_pretrained(path, dtype=torch.float32).state_dict()
        got = V.model_class(kind).from_pretrained(out, dtype=torch.float32).state_dict()
        want = states[kind]
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), out.name


def test_load_refuses_another_tower(folders):
    """check_config_matches compares ModelConfig.vision with the folder's (a text model, vision None,
    matches the folder's language model)."""
    import dataclasses

    from mcore_engine.hf.hf_config import from_hf_config, read_hf_config
    from mcore_engine.hf.load import check_config_matches

    folder = read_hf_config(folders["qwen3_vl"])
    cfg = from_hf_config(folder)
    check_config_matches(cfg, from_hf_config(folder))
    check_config_matches(dataclasses.replace(cfg, vision=None), from_hf_config(folder, vision=None))
    other = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, image_token_id=7))
    with pytest.raises(ValueError, match="model.vision"):
        check_config_matches(other, from_hf_config(folder))


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_peft_adapter_prefix(kind, folders):
    """PEFT keys a vision-language model's adapters under model.language_model.layers (Qwen2.5-VL's
    too, whose weight files say model.layers): decoder_prefix says so."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from mcore_engine.hf.peft import VL_PREFIX, decoder_prefix

    model = get_peft_model(V.build_model(kind), LoraConfig(r=2, target_modules=["q_proj"]))
    keys = list(get_peft_model_state_dict(model))
    assert keys and all(k.startswith("base_model.model." + VL_PREFIX + "layers.") for k in keys)
    assert decoder_prefix(folders[kind]) == VL_PREFIX


def _convert(rank: int, world_size: int, root, kind: str) -> None:
    import importlib.util
    from pathlib import Path

    tool = Path(__file__).resolve().parents[2] / "tools" / "convert.py"
    spec = importlib.util.spec_from_file_location("convert_tool", tool)
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    convert.main(["hf-to-mcore", "--hf", str(root / kind), "--out", str(root / "ckpt"), "--tp", "2"])
    convert.main(["mcore-to-hf", "--ckpt", str(root / "ckpt"), "--out", str(root / "back"),
                  "--hf-base", str(root / kind)])


@pytest.mark.slow  # two engine builds and a checkpoint on 2 ranks
def test_convert_round_trip_with_tower(tmp_path):
    """tools/convert.py: a Qwen3-VL-MoE folder (Hub layout) -> engine checkpoint (TP=2, the tower
    inside) -> the same folder, bit for bit, with its tokenizer and image processor files."""
    from safetensors.torch import load_file

    from tests.utils import run_distributed

    V.tiny_vlm_folder("qwen3_vl_moe", tmp_path / "qwen3_vl_moe", seed=8)
    run_distributed(_convert, 2, tmp_path, "qwen3_vl_moe")
    source = load_file(str(tmp_path / "qwen3_vl_moe" / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(source) and any(n.startswith("model.visual.") for n in back)
    assert all(torch.equal(back[n], t) for n, t in source.items())
    for name in ("preprocessor_config.json", "tokenizer.json"):
        assert (tmp_path / "back" / name).read_text() == (tmp_path / "qwen3_vl_moe" / name).read_text()


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl_moe", "qwen3_5_moe"])
def test_names_without_a_folder_are_the_released_ones(kind, folders):
    """A vision-language model with no hf_path streams (and exports) the released folders' names and
    expert layout: those of the tiny folder (written in the Hub's layout)."""
    import dataclasses

    from safetensors import safe_open

    from mcore_engine.hf.hf_config import from_hf_config, read_hf_config
    from mcore_engine.hf.mapping import hf_stream_shapes

    path = folders[kind]
    cfg = dataclasses.replace(from_hf_config(read_hf_config(path)), hf_path=None)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        released = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    assert sorted(hf_stream_shapes(cfg).items()) == sorted(released.items())
