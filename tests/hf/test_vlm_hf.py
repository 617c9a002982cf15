"""The vision-language folders on the Hugging Face side: the tiny fixtures (``tests/hf/vlm_models.py``)
load in ``transformers`` as written, their image processor matches the tower, the tokenizer keeps
the vision tokens; ``config.json`` <-> ``ModelConfig.vision``; tower names / layout in and out."""

from __future__ import annotations

import json

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
