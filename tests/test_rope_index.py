"""mcore_engine.data.rope_index: exact integer equality with ``transformers`` 5.24's ``get_rope_index``
(Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE; the smallest model of each built on the meta
device) on random samples: text only, 1 and 2 images of several grids, videos with t > 1 (Qwen3-VL /
Qwen3.5: a timestamp and a vision_start before every frame), images and videos mixed, spatial merge 2
and 3; and every malformed input -> ValueError naming the field."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from mcore_engine.config.vision import VisionConfig
from mcore_engine.data.rope_index import check_vision_inputs, rope_index

IMAGE, VIDEO, START, END = 60, 61, 62, 63  # token ids of the tiny configs (text tokens: 0..59)
SECTION = [2, 3, 3]
MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
PER_FRAME = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
TOKENS_PER_SECOND = 2


@functools.cache
def _hf_model(model_type: str, merge: int):
    """The smallest ``transformers`` model of ``model_type`` (meta device: only its config and its
    ``get_rope_index`` are used)."""
    import transformers as T

    text = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=32, head_dim=16, bos_token_id=None,
                eos_token_id=None)
    rope = {"rope_type": "default", "mrope_section": SECTION}
    moe = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                  patch_size=2, spatial_merge_size=merge)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
               vision_end_token_id=END)
    qwen3_vision = {**vision, "deepstack_visual_indexes": []}
    config, cls = {
        "qwen2_5_vl": lambda: (T.Qwen2_5_VLConfig(
            text_config={**text, "rope_parameters": rope},
            vision_config={**vision, "tokens_per_second": TOKENS_PER_SECOND, "fullatt_block_indexes": [0]},
            **ids), T.Qwen2_5_VLModel),
        "qwen3_vl": lambda: (T.Qwen3VLConfig(
            text_config={**text, "rope_parameters": {**rope, "mrope_interleaved": True}},
            vision_config=qwen3_vision, **ids), T.Qwen3VLModel),
        "qwen3_vl_moe": lambda: (T.Qwen3VLMoeConfig(
            text_config={**text, **moe, "rope_parameters": {**rope, "mrope_interleaved": True}},
            vision_config=qwen3_vision, **ids), T.Qwen3VLMoeModel),
        "qwen3_5": lambda: (T.Qwen3_5Config(text_config={**text, "layer_types": ["full_attention"]},
                                           vision_config=vision, **ids), T.Qwen3_5Model),
        "qwen3_5_moe": lambda: (T.Qwen3_5MoeConfig(
            text_config={**text, **moe, "layer_types": ["full_attention"],
                         "shared_expert_intermediate_size": 8},
            vision_config=vision, **ids), T.Qwen3_5MoeModel),
    }[model_type]()
    with torch.device("meta"):
        model = cls(config)
    assert model.config.vision_config.spatial_merge_size == merge
    return model


def _vision(model_type: str, merge: int = 2, **overrides) -> VisionConfig:
    fields = dict(model_type=model_type, vision_config={"spatial_merge_size": merge}, image_token_id=IMAGE,
                  video_token_id=VIDEO, vision_start_token_id=START, mrope_section=SECTION,
                  mrope_interleaved=model_type != "qwen2_5_vl",
                  tokens_per_second=TOKENS_PER_SECOND if model_type == "qwen2_5_vl" else None)
    return VisionConfig(**(fields | overrides))


def _expected(model_type: str, merge: int, ids: torch.Tensor, images, videos, seconds) -> torch.Tensor:
    """``transformers``' positions of the one sample ``ids`` ``[L]`` -> ``[3, L]``."""
    kinds = ((ids == IMAGE).int() + 2 * (ids == VIDEO).int())[None]
    extra = {"second_per_grid_ts": seconds} if seconds is not None else {}
    pos, _ = _hf_model(model_type, merge).get_rope_index(
        ids[None], kinds, image_grid_thw=images, video_grid_thw=None if videos is None else videos.clone(),
        **extra)
    return pos[:, 0]


def _sample(rng: random.Random, model_type: str, merge: int, n_images: int, n_videos: int):
    """Random text around ``n_images`` images and ``n_videos`` videos in random order, as the processors
    write them: ``<vision_start> pads <vision_end>``; Qwen3-VL / Qwen3.5 videos one such group per frame,
    each after a few timestamp tokens. Returns ids, image grids, video grids, seconds per grid."""
    def text(lo: int = 0, hi: int = 6) -> list[int]:
        return [rng.randrange(0, IMAGE) for _ in range(rng.randint(lo, hi))]

    def grid(video: bool) -> list[int]:
        t = rng.randint(2, 4) if video else rng.choice([1, 1, 1, 2])  # an image with t = 2 also occurs
        return [t, merge * rng.randint(1, 5), merge * rng.randint(1, 5)]

    order = ["image"] * n_images + ["video"] * n_videos
    rng.shuffle(order)
    ids, images, videos = text(1), [], []
    for kind in order:
        g = grid(kind == "video")
        (videos if kind == "video" else images).append(g)
        if kind == "video" and model_type in PER_FRAME:
            for _ in range(g[0]):
                ids += text(1, 3) + [START] + [VIDEO] * (g[1] * g[2] // merge**2) + [END]
        else:
            ids += [START] + [IMAGE if kind == "image" else VIDEO] * (g[0] * g[1] * g[2] // merge**2) + [END]
        ids += text()
    seconds = None
    if videos and rng.random() < 0.75:
        values = [rng.choice([0.5, 1.0, 2 / 24, 1 / 3, rng.uniform(0.05, 3.0)]) for _ in videos]
        seconds = torch.tensor(values) if rng.random() < 0.5 else values  # a float32 tensor or Python floats
    as_grid = lambda rows: torch.tensor(rows, dtype=torch.long) if rows else None  # noqa: E731
    return torch.tensor(ids, dtype=torch.long), as_grid(images), as_grid(videos), seconds


CASES = [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 2), (3, 1)]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_matches_transformers_on_random_samples(model_type):
    rng = random.Random(MODEL_TYPES.index(model_type))
    checked = 0
    for merge in (2, 3):
        vision = _vision(model_type, merge)
        for n_images, n_videos in CASES:
            for _ in range(6):
                ids, images, videos, seconds = _sample(rng, model_type, merge, n_images, n_videos)
                inputs = [x for x in (ids, images, videos) if x is not None]
                snapshot = [x.clone() for x in inputs]
                got = rope_index(ids, vision, images, videos, seconds)
                assert all(map(torch.equal, inputs, snapshot)), "inputs were modified"
                want = _expected(model_type, merge, ids, images, videos, seconds)
                assert got.dtype == torch.long and got.shape == (3, ids.numel())
                assert torch.equal(got, want), (model_type, merge, ids.tolist(), images, videos, seconds,
                                                got.tolist(), want.tolist())
                checked += 1
    assert checked == 2 * len(CASES) * 6


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_fixed_grids(model_type):
    """The grids the brief names, one and two images, then a video, against transformers."""
    vision = _vision(model_type)
    for grids in ([[1, 4, 4]], [[1, 6, 8]], [[1, 2, 10]], [[1, 4, 4], [1, 6, 8]], [[1, 2, 10], [1, 4, 4]]):
        ids = [7, 8]
        for t, h, w in grids:
            ids += [START] + [IMAGE] * (t * h * w // 4) + [END, 9]
        ids = torch.tensor(ids)
        images = torch.tensor(grids)
        assert torch.equal(rope_index(ids, vision, images), _expected(model_type, 2, ids, images, None, None))
    # a 2-frame video: t advances by tokens_per_second * seconds on Qwen2.5-VL, per frame on Qwen3-VL
    if model_type == "qwen2_5_vl":
        ids = torch.tensor([5, START] + [VIDEO] * 8 + [END, 6])
    else:
        ids = torch.tensor([5, 1, START] + [VIDEO] * 4 + [END, 2, START] + [VIDEO] * 4 + [END, 6])
    videos = torch.tensor([[2, 4, 4]])
    got = rope_index(ids, vision, video_grid_thw=videos, second_per_grid_ts=torch.tensor([1.5]))
    assert torch.equal(got, _expected(model_type, 2, ids, None, videos, torch.tensor([1.5])))
    if model_type == "qwen2_5_vl":  # frames at 2 + 0 and 2 + int(1 * 2 * 1.5)
        assert got[0, 2:10].tolist() == [2] * 4 + [5] * 4


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_real_grids(model_type):
    """The grids the image processor gives real photo sizes (``smart_resize``; patch 14 for Qwen2.5-VL,
    16 otherwise) and a 6-frame video, in one sample, against transformers."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # no torchvision

    patch = 14 if model_type == "qwen2_5_vl" else 16
    sizes = ((480, 640), (1080, 1920), (200, 300), (90, 500))
    images = [[1, *(x // patch for x in smart_resize(h, w, factor=2 * patch, max_pixels=1280 * 28 * 28))]
              for h, w in sizes]
    video = [3, *(x // patch for x in smart_resize(360, 640, factor=2 * patch))]
    rng = random.Random(1)
    ids = [rng.randrange(IMAGE) for _ in range(12)]
    for g in images:
        ids += [START] + [IMAGE] * (g[1] * g[2] // 4) + [END, 5, 6]
    if model_type in PER_FRAME:
        for _ in range(video[0]):
            ids += [7, 8, START] + [VIDEO] * (video[1] * video[2] // 4) + [END]
    else:
        ids += [START] + [VIDEO] * (video[0] * video[1] * video[2] // 4) + [END]
    ids = torch.tensor(ids + [9] * 20)
    images, videos, seconds = torch.tensor(images), torch.tensor([video]), torch.tensor([2 / 2.0])
    got = rope_index(ids, _vision(model_type), images, videos, seconds)
    assert ids.numel() > 2000
    assert torch.equal(got, _expected(model_type, 2, ids, images, videos, seconds))


def test_text_only_and_rule():
    vision = _vision("qwen3_vl")
    ids = torch.tensor([3, 4, 5, 6])
    assert torch.equal(rope_index(ids, vision), torch.arange(4).expand(3, 4))
    # text, one 1x4x6 image (merge 2: 2 rows x 3 columns), text from the cursor + max(2, 3)
    ids = torch.tensor([1, START] + [IMAGE] * 6 + [END, 2])
    got = rope_index(ids, vision, torch.tensor([[1, 4, 6]]))
    assert got.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
                            [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
                            [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]]


def test_tokens_per_second_from_vision_config():
    """Qwen2.5-VL reads tokens_per_second from VisionConfig, else its vision_config dict."""
    ids = torch.tensor([START] + [VIDEO] * 12 + [END])
    videos, seconds = torch.tensor([[3, 4, 4]]), torch.tensor([0.5])
    want = _expected("qwen2_5_vl", 2, ids, None, videos, seconds)
    plain = _vision("qwen2_5_vl", tokens_per_second=None,
                    vision_config={"spatial_merge_size": 2, "tokens_per_second": TOKENS_PER_SECOND})
    assert torch.equal(rope_index(ids, plain, video_grid_thw=videos, second_per_grid_ts=seconds), want)
    ours = rope_index(ids, _vision("qwen2_5_vl"), video_grid_thw=videos, second_per_grid_ts=seconds)
    assert torch.equal(ours, want)


def _image_ids(*grids, merge: int = 2) -> torch.Tensor:
    ids = [1]
    for t, h, w in grids:
        ids += [START] + [IMAGE] * (t * h * w // merge**2) + [END]
    return torch.tensor(ids)


@pytest.mark.parametrize("bad, match", [
    (dict(image_grid_thw=torch.tensor([[1.0, 4.0, 4.0]])), "image_grid_thw must be an integer tensor"),
    (dict(image_grid_thw=torch.tensor([1, 4, 4])), r"image_grid_thw must be an integer tensor \[n, 3\]"),
    (dict(image_grid_thw=torch.tensor([[1, 4, 4, 1]])), r"image_grid_thw must be an integer tensor \[n, 3\]"),
    (dict(image_grid_thw=[[1, 4, 4]]), "image_grid_thw must be an integer tensor"),
    (dict(image_grid_thw=torch.tensor([[0, 4, 4]])), "image_grid_thw row 0 .* >= 1"),
    (dict(image_grid_thw=torch.tensor([[1, 4, 3]])),
     "image_grid_thw row 0 .* divisible by spatial_merge_size 2"),
    (dict(image_grid_thw=torch.tensor([[1, 4, 8]])),
     "input_ids has 4 image tokens .* image_grid_thw .* needs 8"),
    (dict(image_grid_thw=None), "input_ids has 4 image tokens .* image_grid_thw \\[\\] needs 0"),
    (dict(video_grid_thw=torch.tensor([[2, 2, 2]])),
     "input_ids has 0 video tokens .* video_grid_thw .* needs 2"),
    (dict(input_ids=torch.tensor([[1, 2]])), "input_ids must be a 1-D integer tensor"),
    (dict(input_ids=torch.tensor([1.0, 2.0])), "input_ids must be a 1-D integer tensor"),
    (dict(input_ids=torch.tensor([1, START, IMAGE, IMAGE, END, START, IMAGE, IMAGE, END]),
          image_grid_thw=torch.tensor([[1, 4, 4]])), "input_ids has 2 runs of image tokens .* 1 images"),
    (dict(input_ids=torch.tensor([1, 2, IMAGE, IMAGE, IMAGE, IMAGE])),
     "image 0 .* must follow a vision_start"),
    (dict(input_ids=torch.tensor([IMAGE, IMAGE, IMAGE, IMAGE, END])),
     "image 0 .* must follow a vision_start"),
    (dict(input_ids=_image_ids([1, 4, 4], [1, 2, 4]), image_grid_thw=torch.tensor([[1, 2, 4], [1, 4, 4]])),
     "image 0 has 4 contiguous image tokens but its grid \\[1, 2, 4\\] in image_grid_thw needs 2"),
    (dict(input_ids=torch.tensor([START] + [IMAGE] * 4 + [START] + [IMAGE] * 4),
          image_grid_thw=torch.tensor([[1, 4, 8]])), "2 runs of image tokens .* 1 images"),
])
def test_bad_input_names_the_field(bad, match):
    args = dict(input_ids=_image_ids([1, 4, 4]), image_grid_thw=torch.tensor([[1, 4, 4]]),
                video_grid_thw=None) | bad
    vision = _vision("qwen2_5_vl")
    for fn in (rope_index, check_vision_inputs):
        with pytest.raises(ValueError, match=match):
            fn(args["input_ids"], vision, args["image_grid_thw"], args["video_grid_thw"])
    with pytest.raises(ValueError, match="^sample 3: "):
        check_vision_inputs(args["input_ids"], vision, args["image_grid_thw"], args["video_grid_thw"],
                            sample=3)


def test_bad_videos():
    video = torch.tensor([[2, 2, 4]])  # 4 tokens, 2 per frame
    whole = torch.tensor([1, START] + [VIDEO] * 4 + [END])
    framed = torch.tensor([1, START, VIDEO, VIDEO, END, 5, START, VIDEO, VIDEO, END])
    # Qwen3-VL / Qwen3.5: one run per frame
    with pytest.raises(ValueError, match="1 runs of video tokens but video_grid_thw gives 2 frames"):
        rope_index(whole, _vision("qwen3_vl"), video_grid_thw=video)
    assert torch.equal(rope_index(framed, _vision("qwen3_5"), video_grid_thw=video),
                       _expected("qwen3_5", 2, framed, None, video, None))
    # Qwen2.5-VL: one run per video
    with pytest.raises(ValueError, match="2 runs of video tokens but video_grid_thw gives 1 videos"):
        rope_index(framed, _vision("qwen2_5_vl"), video_grid_thw=video)
    wrong = ((torch.tensor([1.0, 2.0]), "tensor of shape \\(2,\\)"), ([1.0, 2.0], "sequence of 2"),
             (torch.tensor([[1.0]]), "shape \\(1, 1\\)"), ("1", "str"), ([True], "sequence of 1"))
    for seconds, what in wrong:
        with pytest.raises(ValueError, match=f"second_per_grid_ts must be one number per video .*{what}"):
            rope_index(whole, _vision("qwen2_5_vl"), video_grid_thw=video, second_per_grid_ts=seconds)
    for seconds in (torch.tensor([float("nan")]), [-1.0]):
        with pytest.raises(ValueError, match="second_per_grid_ts must be finite and >= 0"):
            rope_index(whole, _vision("qwen2_5_vl"), video_grid_thw=video, second_per_grid_ts=seconds)
    with pytest.raises(ValueError, match="video_grid_thw row 0 .* divisible by spatial_merge_size 2"):
        rope_index(whole, _vision("qwen2_5_vl"), video_grid_thw=torch.tensor([[2, 2, 3]]))
