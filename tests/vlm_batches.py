"""Image batches as verl builds them (a helper, not collected): random RGB images of several sizes
through ``transformers``' Qwen2-VL image processor (PIL backend: no torchvision here) into
``pixel_values`` / ``image_grid_thw``, one ``multi_modal_inputs`` entry per sample (None for a
text-only one), and ``input_ids`` holding ``<|vision_start|> <|image_pad|> x n <|vision_end|>`` per
image between random text tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

# image sizes (height, width) in pixels: grids of 2x2 to 8x6 patches of 14 at merge 2
SIZES = ((28, 56), (56, 28), (42, 70), (84, 56), (56, 56), (28, 28))
TEXT_VOCAB = 200  # random text ids below the special tokens of tests.hf.vlm_models


def image_processor(vision_config: dict, *, max_pixels: int = 112 * 112):
    """The Qwen2-VL image processor of a tower config (patch, temporal patch and merge sizes), PIL
    backend, small ``min_pixels`` so tiny images keep their size."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    patch = int(vision_config["patch_size"])
    merge = int(vision_config.get("spatial_merge_size", 2))
    temporal = int(vision_config["temporal_patch_size"])
    return Qwen2VLImageProcessorPil(patch_size=patch, temporal_patch_size=temporal, merge_size=merge,
                                    min_pixels=(patch * merge) ** 2, max_pixels=max_pixels)


def random_images(sizes: Sequence[tuple[int, int]], seed: int) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def sample_ids(grids: torch.Tensor | None, tokens: dict[str, int], merge: int, g: torch.Generator,
               text: tuple[int, int] = (3, 9)) -> torch.Tensor:
    """Random text, then per image ``start, pad x (t h w / merge^2), end`` and more text."""
    def words() -> torch.Tensor:
        return torch.randint(0, TEXT_VOCAB, (int(torch.randint(text[0], text[1] + 1, (1,), generator=g)),),
                             generator=g)

    parts = [words()]
    for t, h, w in ([] if grids is None else grids.tolist()):
        pads = torch.full((t * h * w // merge ** 2,), tokens["image"])
        parts += [torch.tensor([tokens["vision_start"]]), pads, torch.tensor([tokens["vision_end"]]), words()]
    return torch.cat(parts)


def image_batch(hf_config: dict, images_per_sample: Sequence[int], *, seed: int = 0,
                sizes: Sequence[tuple[int, int]] = SIZES, text: tuple[int, int] = (3, 9)) -> TensorDict:
    """A jagged batch for the vision-language ``hf_config`` (a ``config.json`` dict): sample ``i`` has
    ``images_per_sample[i]`` random images (sizes cycling through ``sizes``), plus ``advantages`` and a
    ``loss_mask`` (a few zeros) per token."""
    vision = hf_config["vision_config"]
    processor = image_processor(vision)
    merge = int(vision.get("spatial_merge_size", 2))
    tokens = {"image": hf_config["image_token_id"], "vision_start": hf_config["vision_start_token_id"],
              "vision_end": hf_config["vision_end_token_id"]}
    g = torch.Generator().manual_seed(seed)
    ids, entries, k = [], [], 0
    for i, n in enumerate(images_per_sample):
        entry = None
        if n:
            chosen = [sizes[(k + j) % len(sizes)] for j in range(n)]
            k += n
            out = processor(images=random_images(chosen, seed * 1000 + i), return_tensors="pt")
            entry = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        ids.append(sample_ids(None if entry is None else entry["image_grid_thw"], tokens, merge, g, text))
        entries.append(entry)
    lengths = [len(x) for x in ids]
    nested = lambda rows: torch.nested.nested_tensor(rows, layout=torch.jagged)  # noqa: E731
    batch = TensorDict({
        "input_ids": nested(ids),
        "advantages": nested([torch.randn(n, generator=g) for n in lengths]),
        "loss_mask": nested([(torch.rand(n, generator=g) > 0.15).to(torch.int64) for n in lengths]),
    }, batch_size=[len(ids)])
    batch["multi_modal_inputs"] = NonTensorStack(*[NonTensorData(e) for e in entries])
    return batch
