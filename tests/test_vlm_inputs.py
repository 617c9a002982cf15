"""Images in the batch (``data.multimodal``) and the vision config: bad input raises ``ValueError``
naming the sample and the field, before anything runs (no launch); the packed visual-token slots and
3-D positions of a micro-batch, and a context-parallel rank's share of them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack

from mcore_engine.config import ConfigError, EngineConfig, ModelConfig, ParallelConfig, VisionConfig
from mcore_engine.data.multimodal import check_multi_modal_inputs, sample_entries, vision_batch
from mcore_engine.data.packing import pack_micro_batch
from tests.test_vlm_layouts import TOKENS, TOWERS, hf_like
from tests.vlm_batches import image_batch


def _vision(name: str = "vl25") -> VisionConfig:
    model_type, tower = TOWERS[name]
    return VisionConfig(model_type=model_type, vision_config=tower, mrope_section=[2, 3, 3],
                        mrope_interleaved=model_type != "qwen2_5_vl",
                        **{k: v for k, v in TOKENS.items() if k != "vision_end_token_id"})


def _batch(images=(1, 0, 2)):
    return image_batch(hf_like("vl25"), list(images), seed=3)


def _with_entry(batch, i: int, **changes):
    entries = sample_entries(batch)
    entry = dict(entries[i] or {})
    entry.update(changes)
    entries[i] = {k: v for k, v in entry.items() if v is not None} or None
    out = batch.clone()
    out["multi_modal_inputs"] = NonTensorStack(*[NonTensorData(e) for e in entries])
    return out


def test_good_batch_passes_and_packs():
    vision, batch = _vision(), _batch()
    check_multi_modal_inputs(batch, vision)
    inputs = pack_micro_batch(batch, data_format="thd", temperature=1.0)
    vb = vision_batch(batch, inputs, vision)
    ids = inputs.input_ids.reshape(-1)
    assert torch.equal(ids[vb.token_slots], torch.full_like(vb.token_slots, TOKENS["image_token_id"]))
    entries = sample_entries(batch)
    grids = torch.cat([e["image_grid_thw"] for e in entries if e is not None])
    assert torch.equal(vb.grid_thw, grids) and vb.num_visual_tokens == int(grids.prod(-1).sum()) // 4
    assert vb.positions.shape == (3, *inputs.input_ids.shape)
    text = ids != TOKENS["image_token_id"]
    first = slice(0, int(inputs.lengths[0]))  # text tokens: t = h = w
    pos = vb.positions.reshape(3, -1)[:, first]
    assert torch.equal(pos[0][text[first]], pos[1][text[first]])
    # CP = 2: each rank's share holds its own visual tokens, together all of them once
    slots = torch.randperm(ids.numel())
    halves = slots.chunk(2)
    kept = [vb.local(h) for h in halves]
    assert sum(k.token_slots.numel() for k in kept) == vb.token_slots.numel()
    for half, k in zip(halves, kept, strict=True):
        assert torch.equal(half[k.token_slots], vb.token_slots[k.feature_index])


@pytest.mark.parametrize("case, match", [
    ("text_model", r"multi_modal_inputs\[0\]: images for a text-only model"),
    ("grid_rows", r"multi_modal_inputs\[2\]\.image_grid_thw .* patch rows but pixel_values has"),
    ("tokens", r"multi_modal_inputs\[0\]\.input_ids has .* tokens of id 240 but image_grid_thw"),
    ("width", r"multi_modal_inputs\[0\]\.pixel_values rows must be 1176 wide"),
    ("merge", r"multi_modal_inputs\[0\]\.image_grid_thw entries must be >= 1 with h and w multiples"),
    ("alone", r"multi_modal_inputs\[0\]: pixel_values and image_grid_thw come together"),
    ("unknown", r"multi_modal_inputs\[0\]: unknown field\(s\) \['pixels'\]"),
    ("no_images", r"multi_modal_inputs\[1\]\.input_ids has 4 image tokens"),
    ("nan", r"multi_modal_inputs\[0\]\.pixel_values has NaN"),
    ("float_grid", r"multi_modal_inputs\[0\]\.image_grid_thw must be an int tensor \[n, 3\]"),
])
def test_bad_images_name_sample_and_field(case, match):
    vision, batch = _vision(), _batch()
    entry = sample_entries(batch)[0]
    pixels, grid = entry["pixel_values"], entry["image_grid_thw"]
    if case == "text_model":
        vision = None
    elif case == "grid_rows":
        e2 = sample_entries(batch)[2]
        batch = _with_entry(batch, 2, image_grid_thw=e2["image_grid_thw"] * torch.tensor([1, 2, 1]))
    elif case == "tokens":
        batch = _with_entry(batch, 0, pixel_values=torch.cat([pixels, pixels]),
                            image_grid_thw=grid * torch.tensor([2, 1, 1]))
    elif case == "width":
        batch = _with_entry(batch, 0, pixel_values=pixels[:, :-1])
    elif case == "merge":
        batch = _with_entry(batch, 0, image_grid_thw=grid + torch.tensor([0, 1, 0]))
    elif case == "alone":
        batch = _with_entry(batch, 0, image_grid_thw=None)
    elif case == "unknown":
        batch = _with_entry(batch, 0, pixels=pixels)
    elif case == "no_images":
        ids = list(batch["input_ids"].unbind())
        ids[1] = torch.cat([ids[1], torch.full((4,), TOKENS["image_token_id"])])
        batch = batch.clone()
        batch["input_ids"] = torch.nested.nested_tensor(ids, layout=torch.jagged)
    elif case == "nan":
        bad = pixels.clone()
        bad[0, 0] = float("nan")
        batch = _with_entry(batch, 0, pixel_values=bad)
    elif case == "float_grid":
        batch = _with_entry(batch, 0, image_grid_thw=grid.float())
    with pytest.raises(ValueError, match=match):
        check_multi_modal_inputs(batch, vision)


def test_three_d_positions_need_a_vision_model():
    batch = _batch((0, 0))
    ids = batch["input_ids"].unbind()
    batch["position_ids"] = torch.nested.nested_tensor(
        [torch.arange(len(x))[:, None].expand(-1, 3).contiguous() for x in ids], layout=torch.jagged)
    check_multi_modal_inputs(batch, _vision())
    with pytest.raises(ValueError, match="position_ids: a trailing dimension"):
        check_multi_modal_inputs(batch, None)
    # given positions are honoured: the packed 3-D positions are the batch's
    inputs = pack_micro_batch(batch, data_format="thd", temperature=1.0)
    shifted = batch.clone()
    shifted["position_ids"] = torch.nested.nested_tensor([p + 5 for p in batch["position_ids"].unbind()],
                                                         layout=torch.jagged)
    vb = vision_batch(shifted, inputs, _vision())
    flat = vb.positions.reshape(3, -1)[:, inputs.token_index]
    assert torch.equal(flat.T, torch.cat(shifted["position_ids"].unbind()))


def _model(**changes) -> dict:
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=250, max_sequence_length=128,
                vision=_vision("vl3-moe"))
    return {**base, **changes}


def test_vision_config_refusals():
    with pytest.raises(ConfigError, match=r"mrope_section \[2, 3, 4\] must sum to half the rotary dimension"):
        ModelConfig(**_model(vision=dataclasses.replace(_vision(), mrope_section=[2, 3, 4])))
    with pytest.raises(ConfigError, match="model_type must be"):
        VisionConfig(model_type="llava", mrope_section=[2, 3, 3], image_token_id=1, video_token_id=2,
                     vision_start_token_id=3)
    with pytest.raises(ConfigError, match="freeze_vision_tower needs a vision tower"):
        ModelConfig(**_model(vision=None, freeze_vision_tower=True))
    with pytest.raises(ConfigError, match="DeepStack .* first 2 decoder layers"):
        EngineConfig(model=ModelConfig(**_model()), parallel=ParallelConfig(pipeline_model_parallel_size=4))
    with pytest.raises(ConfigError, match="recompute_granularity='full' with DeepStack"):
        EngineConfig(model=ModelConfig(**_model()), recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
    with pytest.raises(ConfigError, match="multi-token prediction is not supported"):
        ModelConfig(**_model(mtp_num_layers=1))
