"""The adapter's image path (``mcore_engine.integrations.verl_multimodal``) on verl-style batches built
by verl's own code, no engine: a padded ``DataProto`` with ``position_ids`` ``[B, 4, L]`` (verl's agent
loop: text row + mRoPE ``t, h, w``) and per-sample ``multi_modal_inputs`` (dicts with
``images_seqlens``, ``{}`` and None), through ``DataProto.to_tensordict`` +
``left_right_2_no_padding`` and a pickle round trip (Ray's), exactly what ``TrainingWorker`` hands the
engine. Checked: the core's ``[B, j, 3]`` per-token positions equal rows 1-3 of each sample's valid
tokens, the entries keep the media tensors (bit-identical) and drop verl's bookkeeping, text batches
stay as they were, and bad input raises ``ValueError`` naming the sample and the field."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl is installed by `make setup` (pip install --no-deps verl==0.9.1)")

from mcore_engine.integrations.verl_multimodal import (  # noqa: E402
    media_entries,
    positions_3d,
    prepare_multimodal,
)

P, R = 7, 5  # padded prompt / response widths


def verl_batch(seed: int, entries: list, rows: int = 4, text: bool = False):
    """verl's padded batch -> its no-padding TensorDict (as the trainer sends it to the workers);
    returns it with each sample's valid ``[4, L]`` positions and ``input_ids``."""
    from verl.protocol import DataProto
    from verl.utils.tensordict_utils import maybe_fix_3d_position_ids
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    B, L = len(entries), P + R
    ids = torch.randint(3, 200, (B, L), generator=g)
    mask = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):  # left-padded prompts of 3..P tokens, right-padded responses of 1..R
        mask[b, P - int(torch.randint(3, P + 1, (1,), generator=g)):P] = 1
        mask[b, P:P + int(torch.randint(1, R + 1, (1,), generator=g))] = 1
    pos = torch.zeros(B, rows, L, dtype=torch.long)
    valid = []
    for b in range(B):
        n = int(mask[b].sum())
        sample = torch.randint(0, 50, (rows, n), generator=g)  # distinct values per row: catches a swap
        pos[b][:, mask[b].bool()] = sample
        valid.append((sample, ids[b][mask[b].bool()]))
    tensors = {"input_ids": ids, "attention_mask": mask, "response_mask": mask[:, P:].clone(),
               "position_ids": pos[:, 0] if text else pos}
    media = {"multi_modal_inputs": np.array(entries, dtype=object)}
    data = DataProto.from_dict(tensors=tensors, non_tensors=media)
    td = pickle.loads(pickle.dumps(left_right_2_no_padding(data.to_tensordict())))  # Ray's hop
    maybe_fix_3d_position_ids(td)
    return td, valid


def image(seed: int, grids: list[list[int]]) -> dict:
    g = torch.Generator().manual_seed(seed)
    thw = torch.tensor(grids)
    n = int(thw.prod(-1).sum())
    return {"pixel_values": torch.randn(n, 1176, generator=g), "image_grid_thw": thw,
            "images_seqlens": torch.repeat_interleave(thw[:, 1] * thw[:, 2], thw[:, 0])}


@pytest.mark.parametrize("rows", [4, 3])
def test_positions_and_media_as_the_core_takes_them(rows):
    entries = [image(1, [[1, 4, 6]]), {}, image(2, [[1, 2, 2], [1, 4, 4]]), None]
    originals = [None if e is None else {k: v.clone() for k, v in e.items()} for e in entries]
    td, valid = verl_batch(0, entries, rows=rows)
    assert td["position_ids"].is_nested and td["position_ids"].dim() == 3
    prepare_multimodal(td)
    pos = td["position_ids"]
    assert pos.is_nested and pos._ragged_idx == 1 and pos.dtype == torch.int64
    assert pos.offsets().equal(td["input_ids"].offsets())  # the layout of input_ids
    assert pos.shape[:2] == td["input_ids"].shape and pos.shape[2] == 3  # [B, j, 3], the same j
    for (want, ids), got, have_ids in zip(valid, pos.unbind(), td["input_ids"].unbind(), strict=True):
        assert torch.equal(have_ids, ids)
        assert got.shape == (len(ids), 3) and torch.equal(got, want[-3:].T), "not rows (t, h, w) per token"
    media = td["multi_modal_inputs"]
    assert len(media) == 4 and media[1] is None and media[3] is None
    for got, want in ((media[0], originals[0]), (media[2], originals[2])):
        assert sorted(got) == ["image_grid_thw", "pixel_values"]  # images_seqlens dropped
        assert all(torch.equal(got[k], want[k]) for k in got)
    sub = td[2:4]  # the core's micro-batching slices the non-tensor stack with the tensors
    assert sub["multi_modal_inputs"][1] is None and torch.equal(
        sub["multi_modal_inputs"][0]["image_grid_thw"], originals[2]["image_grid_thw"])


def test_positions_after_verl_rechunking():
    """verl's ``chunk_tensordict`` fallback (taken once Ray's pickling has lost the 3-D jagged tensor's
    ragged dimension): every sample ``[4, S]`` padded to the longest, re-packed along the rows
    (``nested_tensor_from_tensor_list(..., ragged_idx=1)``: values ``[B * 4, S]``). The adapter cuts
    each sample back to its ``input_ids`` length."""
    from verl.utils import tensordict_utils as tu

    td, valid = verl_batch(6, [image(4, [[1, 2, 2]]), None, image(5, [[1, 4, 2]])])
    padded = td["position_ids"].to_padded_tensor(0)  # [B, 4, S]
    td["position_ids"] = tu.nested_tensor_from_tensor_list(list(padded.unbind(0)), ragged_idx=1)
    assert td["position_ids"].values().shape == (3 * 4, padded.shape[-1])
    prepare_multimodal(td)
    pos = td["position_ids"]
    assert pos.offsets().equal(td["input_ids"].offsets())
    for (want, _), got in zip(valid, pos.unbind(), strict=True):
        assert torch.equal(got, want[-3:].T)


def test_text_batches_are_left_alone():
    """verl's agent loop gives text samples ``{}`` (no processor): no media -> no key; 2-D positions
    (text models) untouched."""
    td, valid = verl_batch(3, [{}, {}, {}], text=True)
    before = td["position_ids"]
    prepare_multimodal(td)
    assert "multi_modal_inputs" not in td.keys()
    assert td["position_ids"] is before and before.dim() == 2
    # a Qwen-VL batch without a single image: positions converted (t = h = w there), no media key
    td, valid = verl_batch(4, [None, {}], rows=4)
    prepare_multimodal(td)
    assert "multi_modal_inputs" not in td.keys() and td["position_ids"].shape[-1] == 3


def test_dense_positions():
    pos = torch.randint(0, 9, (2, 4, 6))
    got = positions_3d(pos, [6, 6])
    assert got.shape == (2, 6, 3) and torch.equal(got, pos[:, 1:].transpose(1, 2))


def test_bad_input_names_sample_and_field():
    with pytest.raises(ValueError, match=r"multi_modal_inputs\[1\] has keys \['pixel_attention_mask'\]"):
        media_entries([None, {"pixel_values": torch.zeros(1, 2), "pixel_attention_mask": torch.ones(1)}], 2)
    with pytest.raises(ValueError, match=r"multi_modal_inputs\[0\]\['image_grid_thw'\] must be a tensor"):
        media_entries([{"pixel_values": torch.zeros(4, 2), "image_grid_thw": [[1, 2, 2]]}], 1)
    with pytest.raises(ValueError, match="one entry per sample"):
        media_entries([None], 2)
    with pytest.raises(ValueError, match=r"position_ids must be \[B, 4 \(text row \+ t, h, w\) or 3, L\]"):
        bad = [torch.zeros(5, 6, dtype=torch.long), torch.zeros(5, 7, dtype=torch.long)]
        positions_3d(torch.nested.as_nested_tensor(bad, layout=torch.jagged))
    with pytest.raises(ValueError, match=r"position_ids\[1\] has 7 positions but input_ids\[1\] has 5"):
        good = [torch.zeros(4, 6, dtype=torch.long), torch.zeros(4, 7, dtype=torch.long)]
        positions_3d(torch.nested.as_nested_tensor(good, layout=torch.jagged), [6, 5])
    with pytest.raises(ValueError, match=r"position_ids has 6 positions a sample but input_ids has \[5\]"):
        positions_3d(torch.zeros(1, 4, 6, dtype=torch.long), [5])
    with pytest.raises(ValueError, match="int64"):
        positions_3d(torch.zeros(1, 4, 6))
    td, _ = verl_batch(5, [image(3, [[1, 2, 2]]), {"pixel_values": torch.zeros(1, 2), "foo": torch.ones(1)}])
    keys = set(td.keys())
    with pytest.raises(ValueError, match=r"multi_modal_inputs\[1\]"):
        prepare_multimodal(td)
    assert set(td.keys()) == keys and td["position_ids"].shape[1] == 4  # nothing changed
