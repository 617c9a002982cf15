"""Vision-language folders through ``MegatronEngine(model.hf_path=...)`` against ``transformers``.

One launch on 2 gloo ranks, per tiny folder of ``tests.hf.vlm_models`` (Qwen2.5-VL, Qwen3-VL with
tied embeddings and DeepStack, Qwen3-VL-MoE with the Hub's fused experts, Qwen3.5 and Qwen3.5-MoE
with their towers): ``infer_batch`` on a batch built as verl builds it (``tests.vlm_batches``: random
images of several sizes through the folder's image processor, 0 / 1 / 2 images per sample) at TP=2
with sequence parallelism, packed (thd), against ``ForConditionalGeneration`` in float64 one sample at
a time (its 3-D positions from ``mm_token_type_ids``): log-probs and entropy at temperature 0.8, fp32
1e-4; bf16 within bf16's tolerance of the float64 model. The engine computes the positions itself.
The Qwen2.5-VL and Qwen3-VL batches also hold a sample with an image and a video of two temporal
patches (Qwen2.5-VL: one run, ``second_per_grid_ts`` 1.5 s; Qwen3-VL: a run per frame after its
timestamp).
"""

from __future__ import annotations

import dataclasses

import torch

from tests.utils import REL_TOL, assert_rel_close, run_distributed
from tests.vlm_batches import image_batch

KINDS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
IMAGES = [1, 0, 2, 1]
TEMPERATURE = 0.8
FP32_TOL = 1e-4


def _reference(folder, hf_config: dict, batch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """float64 ``transformers`` log-probs of each next token and entropies, one sample at a time."""
    import transformers

    from mcore_engine.data.multimodal import sample_entries

    cls = getattr(transformers, hf_config["architectures"][0])
    model = cls.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager").eval()
    log_probs, entropies = [], []
    for ids, entry in zip(batch["input_ids"].unbind(), sample_entries(batch), strict=True):
        kwargs = {}
        if entry is not None:
            types = ((ids == hf_config["image_token_id"]).to(torch.int64)
                     + 2 * (ids == hf_config["video_token_id"]).to(torch.int64))[None]
            kwargs = {k: v.double() if v.is_floating_point() else v for k, v in entry.items()}
            kwargs["mm_token_type_ids"] = types
        with torch.no_grad():
            logits = model(input_ids=ids[None], **kwargs).logits[0].double() / TEMPERATURE
        logp = torch.log_softmax(logits, -1)
        log_probs.append(logp[:-1].gather(-1, ids[1:, None])[:, 0])
        entropies.append(-(logp.exp() * logp).sum(-1)[:-1])
    return log_probs, entropies


def _with_video(batch, hf_config: dict, per_frame: bool):
    """``batch`` plus a sample holding a random video (``video_grid_thw`` [[2, 4, 4]]) after an image.
    Qwen2.5-VL: one run of video tokens, 1.5 s per temporal grid (``second_per_grid_ts``: the time
    axis spaced by ``tokens_per_second``); Qwen3-VL (``per_frame``): each temporal patch its own run
    after a timestamp (random text here) and ``<|vision_start|>``, as its processor writes it."""
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    from mcore_engine.data.multimodal import sample_entries

    g = torch.Generator().manual_seed(11)
    vision = hf_config["vision_config"]
    width = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    image = sample_entries(batch)[0]
    grid = torch.tensor([[2, 4, 4]])
    text = lambda n: torch.randint(3, 200, (n,), generator=g)  # noqa: E731
    ids = torch.cat([text(4), torch.tensor([hf_config["vision_start_token_id"]]),
                     torch.full((int(image["image_grid_thw"].prod()) // 4,), hf_config["image_token_id"]),
                     torch.tensor([hf_config["vision_end_token_id"]]),
                     *[torch.cat([text(2) if per_frame else text(0),
                                  torch.tensor([hf_config["vision_start_token_id"]]),
                                  torch.full((4 if per_frame else 8,), hf_config["video_token_id"]),
                                  torch.tensor([hf_config["vision_end_token_id"]])])
                       for _ in range(2 if per_frame else 1)], text(5)])
    entry = {**image, "pixel_values_videos": torch.randn(32, width, generator=g), "video_grid_thw": grid}
    if not per_frame:
        entry["second_per_grid_ts"] = torch.tensor([1.5])
    rows = list(batch["input_ids"].unbind()) + [ids]
    entries = sample_entries(batch) + [entry]
    new = TensorDict({"input_ids": torch.nested.nested_tensor(rows, layout=torch.jagged)},
                     batch_size=[len(rows)])
    new["multi_modal_inputs"] = NonTensorStack(*[NonTensorData(e) for e in entries])
    return new


def _check(rank: int, world_size: int, root: str) -> None:
    from pathlib import Path

    from mcore_engine.config import EngineConfig, OptimizerConfig, ParallelConfig
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.hf import from_hf_config, read_hf_config
    from mcore_engine.parallel.platform import destroy_distributed
    for kind in KINDS:
        folder = Path(root) / kind
        hf_config = read_hf_config(folder)
        batch = image_batch(hf_config, IMAGES, seed=7)
        if kind in ("qwen2_5_vl", "qwen3_vl"):  # and a video (2 temporal patches of 4 x 4) after an image
            batch = _with_video(batch, hf_config, per_frame=kind == "qwen3_vl")
        batch.set_non_tensor("calculate_entropy", True)
        batch.set_non_tensor("temperature", TEMPERATURE)
        ref_lp, ref_ent = _reference(folder, hf_config, batch)
        for precision in ("fp32", "bf16"):
            model = dataclasses.replace(from_hf_config(hf_config), hf_path=str(folder),
                                        max_sequence_length=512)
            cfg = EngineConfig(model=model, parallel=ParallelConfig(tensor_model_parallel_size=2,
                                                                    sequence_parallel=True),
                               optimizer=OptimizerConfig(lr=1e-4), precision=precision, micro_batch_size=2,
                               forward_only=True)
            engine = MegatronEngine(cfg)
            engine.initialize()
            out = engine.infer_batch(batch)
            tol = FP32_TOL if precision == "fp32" else REL_TOL[torch.bfloat16]
            for i, (lp, ent) in enumerate(zip(ref_lp, ref_ent, strict=True)):
                what = f"{kind} {precision} sample {i}"
                assert_rel_close(out["log_probs"][i][:-1].double(), lp, tol, f"{what} log_probs")
                assert_rel_close(out["entropy"][i][:-1].double(), ent, tol, f"{what} entropy")
            del engine
            destroy_distributed()


def test_vlm_folders_match_transformers(tmp_path):
    from tests.hf.vlm_models import tiny_vlm_folder

    for kind in KINDS:
        tiny_vlm_folder(kind, tmp_path / kind)
    run_distributed(_check, 2, str(tmp_path))
