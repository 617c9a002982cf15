"""Vision-language models (``ModelConfig.vision``) on every layout against one rank, images in the batch
as verl sends them (``tests.vlm_batches``: random images of several sizes through the Qwen2-VL image
processor, 0 / 1 / 2 images per sample).

Three models on the tiny GPTs of ``tests.parallel_setup`` (4 layers, head dim 16): ``"vl25"``, a
Qwen2.5-VL tower (windowed attention with one full-attention block, sectioned mRoPE [2, 3, 3]) on the
dense QKV-bias model; ``"vl3-moe"``, a Qwen3-VL-MoE tower (learned position embeddings, DeepStack
into decoder layers 0 and 1, interleaved mRoPE) on the QK-norm MoE; ``"vl35"``, a Qwen3.5 tower on
the Qwen3.5 hybrid (3 Gated DeltaNet layers, 1 gated attention; interleaved mRoPE on its quarter
of rotary channels, sections [1, 1, 0]). The towers' biases are drawn ``N(0, 0.1)`` as trained ones
(``transformers`` initialises them to 0).

Launch 1 (one gloo rank), per model: a batch whose image grid disagrees with its pixels fails by
sample and field and changes nothing; the fp32 reference (inference outputs, two ``train_batch`` steps,
the first step's gradients, the weights after each step; the tower's weights move); each sequence of
a pack equals itself alone (fp32 1e-6); a frozen tower (``freeze_vision_tower``) stays bit-identical
over two steps, gets no gradient and no optimizer state, while the rest trains; for ``"vl25"`` also the
reference of one rank holding the DP=2 run's two batches.

Launch 2 (two gloo ranks) replays the references on identical weights: TP=2 + SP (thd, the tower
replicated and its weights equal on both ranks), TP=2 bshd, PP=2 (the tower on stage 0, DeepStack
there), CP=2 (thd and bshd: the split after the image features are in place; GDN's CP for the
hybrid), EP=2, and DP=2 with one
rank's batch text-only (no hang, no skipped reduce): outputs, loss, grad norm, every gradient of step
1 and the weights after each step (``tests.compare``: fp32 1e-5, two Adam steps 1e-4).
"""

from __future__ import annotations

import dataclasses

import torch

from tests.engine_setup import flat_values, full_state, load_full_state, local_params
from tests.parallel_setup import FLAGS, TOL, compare, config, run_steps, same_tensors, trained_like
from tests.utils import run_distributed
from tests.vlm_batches import image_batch

TOKENS = dict(image_token_id=240, video_token_id=241, vision_start_token_id=242, vision_end_token_id=243)
TOWERS = {
    "vl25": ("qwen2_5_vl", dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                                out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                                temporal_patch_size=2,
                                window_size=56, fullatt_block_indexes=[1], in_chans=3, tokens_per_second=2)),
    "vl3-moe": ("qwen3_vl_moe", dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                                     out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                                     temporal_patch_size=2, num_position_embeddings=64,
                                     deepstack_visual_indexes=[0, 1], in_channels=3)),
    "vl35": ("qwen3_5", dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                             patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                             num_position_embeddings=64, in_channels=3)),
}
BASES = {"vl25": "dense", "vl3-moe": "moe", "vl35": "hybrid"}  # tests.parallel_setup.config's models
# mRoPE sections: head dim 16 (8 rotary pairs); the hybrid rotates a quarter of it (2 pairs)
SECTIONS = {"vl25": [2, 3, 3], "vl3-moe": [2, 3, 3], "vl35": [1, 1, 0]}
IMAGES = ([1, 0, 2, 1, 0, 1], [2, 1, 0, 0, 1, 1])  # images per sample of the two batches
# name -> (model, config kwargs)
LAYOUTS = [
    ("vl25 tp2-sp", "vl25", dict(tp=2, sp=True)),
    ("vl25 tp2-bshd", "vl25", dict(tp=2, data_format="bshd")),
    ("vl25 pp2", "vl25", dict(pp=2)),
    ("vl25 cp2", "vl25", dict(cp=2)),
    ("vl25 cp2-bshd", "vl25", dict(cp=2, data_format="bshd")),
    ("vl3-moe tp2-sp", "vl3-moe", dict(tp=2, sp=True)),
    ("vl3-moe ep2", "vl3-moe", dict(ep=2)),
    ("vl3-moe pp2", "vl3-moe", dict(pp=2)),
    ("vl3-moe cp2", "vl3-moe", dict(cp=2)),
    ("vl35 tp2-sp", "vl35", dict(tp=2, sp=True)),
    ("vl35 pp2", "vl35", dict(pp=2)),
    ("vl35 cp2", "vl35", dict(cp=2)),
]


def hf_like(name: str) -> dict:
    """The ``config.json`` fields ``tests.vlm_batches.image_batch`` reads."""
    return {"vision_config": TOWERS[name][1], **TOKENS}


def vl_config(name: str, *, freeze: bool = False, **kwargs):
    from mcore_engine.config import VisionConfig

    model_type, tower = TOWERS[name]
    cfg = config(BASES[name], **kwargs)
    vision = VisionConfig(model_type=model_type, vision_config=tower, mrope_section=SECTIONS[name],
                          mrope_interleaved=model_type != "qwen2_5_vl",
                          **{k: v for k, v in TOKENS.items() if k != "vision_end_token_id"})
    model = dataclasses.replace(cfg.model, vision=vision, freeze_vision_tower=freeze, max_sequence_length=128)
    return dataclasses.replace(cfg, model=model)


def vl_batches(name: str, images=IMAGES) -> list:
    out = []
    for i, per_sample in enumerate(images):
        batch = image_batch(hf_like(name), per_sample, seed=31 + i)
        for key, value in FLAGS.items():
            batch.set_non_tensor(key, value)
        out.append(batch)
    return out


def _engine(cfg):
    from mcore_engine.engine import MegatronEngine

    engine = MegatronEngine(cfg)
    engine.initialize()
    return engine


def _kind(name: str) -> str:
    return BASES[name]


def _tower_keys(state: dict) -> list[str]:
    return [k for k in state if k.startswith("vision.")]


def _tower_biases(engine, seed: int = 0) -> None:
    """The tower's biases ``N(0, 0.1)``, as in a trained checkpoint: ``transformers`` initialises
    them to 0, where two Adam steps leave ~lr-sized tensors whose relative error is the noise of their
    near-zero gradient entries (measured 2.5e-4 on the Qwen3.5 tower at TP=2 + SP)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for chunk in engine.model:
            for name, p in chunk.module.named_parameters():
                if name.startswith("vision.") and name.endswith(".bias"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    engine.optimizer.reload_model_params()


def _pack_vs_alone(engine, batch) -> None:
    """Each sequence of the pack equals itself alone (fp32 1e-6): images and positions per sample."""
    packed = engine.infer_batch(batch)
    for i in range(batch.batch_size[0]):
        alone = engine.infer_batch(batch[i:i + 1])
        for key in ("log_probs", "entropy"):
            got, want = packed[key][i], flat_values(alone[key])
            err = float((got - want).abs().max())
            assert err <= 1e-6 * max(1.0, float(want.abs().max())), f"sequence {i} {key}: {err}"


def _frozen(name: str, full0: dict) -> None:
    """A frozen tower: no gradient, no optimizer state, bit-identical after two steps; the rest moves."""
    from mcore_engine.step.optimizer import sub_optimizers

    engine = _engine(vl_config(name, freeze=True))
    load_full_state(engine, full0)
    (chunk,) = engine.model
    tower = dict(chunk.module.vision.named_parameters())
    assert tower and not any(p.requires_grad for p in tower.values())
    stepped = {id(p) for sub in sub_optimizers(engine.optimizer) for g in sub.optimizer.param_groups
               for p in g["params"]}
    assert not any(id(p) in stepped for p in tower.values()), "the frozen tower is in the optimizer"
    from tests.engine_setup import policy_loss

    for batch in vl_batches(name):
        assert engine.train_batch(batch, policy_loss).get_non_tensor("metrics")["update_skipped"] == 0.0
    after = full_state(engine)
    for key in _tower_keys(full0):
        assert torch.equal(after[key], full0[key]), f"frozen tower weight {key} changed"
    moved = [k for k in full0 if not k.startswith("vision.") and not torch.equal(after[k], full0[k])]
    assert len(moved) > 10, "the language model did not train under a frozen tower"


def _bad_batch_changes_nothing(engine, name: str) -> None:
    """A grid that disagrees with its pixels fails ``train_batch`` by sample and field; the weights,
    the optimizer state and the step counters are unchanged."""
    import pytest
    from tensordict import NonTensorData, NonTensorStack

    from mcore_engine.data.multimodal import sample_entries
    from tests.engine_setup import engine_snapshot, policy_loss
    from tests.utils import assert_identical

    batch = vl_batches(name)[0]
    entries = sample_entries(batch)
    entries[2] = {**entries[2], "image_grid_thw": entries[2]["image_grid_thw"] * torch.tensor([1, 2, 1])}
    batch["multi_modal_inputs"] = NonTensorStack(*[NonTensorData(e) for e in entries])
    before = engine_snapshot(engine, counters=True)
    with pytest.raises(ValueError, match=r"multi_modal_inputs\[2\]\.image_grid_thw"):
        engine.train_batch(batch, policy_loss)
    assert_identical(engine_snapshot(engine, counters=True), before, f"{name}: a rejected image batch")


def _reference(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.parallel.platform import destroy_distributed

    refs = {}
    for name in TOWERS:
        engine = _engine(vl_config(name))
        if BASES[name] == "hybrid":  # trained-like GDN decays and norms (tests.parallel_setup)
            trained_like(engine)
        _tower_biases(engine)
        full0 = full_state(engine)
        assert _tower_keys(full0), "no vision tower on the one-rank engine"
        _bad_batch_changes_nothing(engine, name)
        _pack_vs_alone(engine, vl_batches(name)[0])
        ref = {"full0": full0, **run_steps(engine, _kind(name), data=vl_batches(name))}
        ref["full2"] = full_state(engine)
        still = [k for k in _tower_keys(full0) if torch.equal(full0[k], ref["full2"][k])]
        assert not still, f"{name}: tower weights not trained: {still}"
        del engine
        destroy_distributed()
        _frozen(name, full0)
        destroy_distributed()
        refs[name] = ref
    # DP=2 with rank 1's batches text-only = one rank holding both ranks' batches
    engine = _engine(vl_config("vl25", micro_batch_size=2))
    load_full_state(engine, refs["vl25"]["full0"])
    joined = [torch.cat([a, b]) for a, b in zip(vl_batches("vl25"), _text_only("vl25"), strict=True)]
    for batch in joined:
        for key, value in FLAGS.items():
            batch.set_non_tensor(key, value)
    refs["dp2-mixed"] = {"full0": refs["vl25"]["full0"], **run_steps(engine, "dense", data=joined)}
    refs["dp2-mixed"]["full2"] = full_state(engine)
    del engine
    destroy_distributed()
    torch.save(refs, path)


def _text_only(name: str) -> list:
    return vl_batches(name, images=([0] * 6, [0] * 6))


def _tower_equal_over_tp(engine) -> None:
    """The replicated tower holds the same weights on every tensor-parallel rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    for chunk in engine.model:
        tower = getattr(chunk.module, "vision", None)
        if tower is None:
            continue
        flat = torch.cat([p.detach().reshape(-1).float() for p in tower.parameters()])
        other = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
        dist.all_gather(other, flat, group=group)
        assert all(torch.equal(o, flat) for o in other), "tower weights differ across TP ranks"


def _check_tensors(name: str, model: str, engine, got: dict, ref: dict) -> None:
    """Step 1's gradients and the weights after it (fp32 1e-5), the weights after two steps
    (``tests.compare.FP32_TWO_STEPS``), the tower's included."""
    same_tensors(f"{name}: gradients of step 1", engine, got["grads"], ref["grads"][0])
    same_tensors(f"{name}: weights after step 1", engine, got["weights1"], ref["weights1"][0],
                 steps_from=ref["grads"][0], steps=1)
    same_tensors(f"{name}: weights after 2 steps", engine, local_params(engine), ref["full2"],
                 steps_from=ref["grads"][0])


def _layouts(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.parallel.platform import destroy_distributed

    refs = torch.load(path, weights_only=False)
    for name, model, kwargs in LAYOUTS:
        ref = refs[model]
        engine = _engine(vl_config(model, **kwargs))
        load_full_state(engine, ref["full0"])
        data = vl_batches(model)
        got = run_steps(engine, _kind(model), data=data)
        compare(name, got, ref, False, TOL, data)
        _check_tensors(name, model, engine, got, ref)
        if kwargs.get("tp", 1) > 1:
            _tower_equal_over_tp(engine)
        del engine
        destroy_distributed()
    # DP=2: rank 0 images, rank 1 text only; the loss and the weights as one rank holding both
    ref = refs["dp2-mixed"]
    engine = _engine(vl_config("vl25"))
    load_full_state(engine, ref["full0"])
    data = vl_batches("vl25") if rank == 0 else _text_only("vl25")
    got = run_steps(engine, "dense", data=data)
    for i, (g, r) in enumerate(zip(got["steps"], ref["steps"], strict=True)):
        tol = TOL if i == 0 else 1e-4
        assert abs(float(g["loss"]) - float(r["loss"])) <= tol * abs(float(r["loss"])), \
            f"dp2-mixed step {i} loss"
        assert abs(float(g["grad_norm"]) - float(r["grad_norm"])) <= tol * float(r["grad_norm"])
    same_tensors("dp2-mixed: weights after 2 steps", engine, local_params(engine), ref["full2"],
                 steps_from=ref["grads"][0])
    del engine
    destroy_distributed()


def test_vlm_layouts_match_one_rank(tmp_path):
    path = str(tmp_path / "reference.pt")
    run_distributed(_reference, 1, path)
    run_distributed(_layouts, 2, path)
