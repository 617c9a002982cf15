"""Set-up of the verl VLM trainer run: a tiny random Qwen2.5-VL folder with its processor files (a
character-level tokenizer with Qwen's vision tokens, the image processor's ``preprocessor_config.json``,
a chat template that renders an image as ``<|vision_start|><|image_pad|><|vision_end|>``) and a
synthetic image dataset in verl's RL parquet layout (PNG bytes in the ``images`` column, ``<image>`` in
the prompt), all built locally."""

from __future__ import annotations

import io
import string

import torch

from tests.integrations.verl_setup import VOCAB
from tests.integrations.verl_trainer_setup import SPECIALS

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_IDS = dict(zip(VISION_TOKENS, range(VOCAB - len(VISION_TOKENS), VOCAB), strict=True))
PATCH, MERGE = 14, 2  # the image processor's and the vision tower's
# verl's RLHFDataset / agent loop messages: content a list of {"type": "image"} / {"type": "text"}
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}:{% endif %}")
# image sizes (height, width) in pixels: a multiple of PATCH * MERGE each, so the processor keeps
# them; merged tokens = (h / 28) * (w / 28): 4, 6, 6, 9
IMAGE_SIZES = [(56, 56), (56, 84), (84, 56), (84, 84)]
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "white": (250, 250, 250)}


def make_vlm_tokenizer(path: str):
    """The character-level tokenizer of ``verl_trainer_setup.make_tokenizer`` (VOCAB ids) whose last
    four ids are Qwen's vision tokens (special: verl's decode with ``skip_special_tokens`` drops them),
    with :data:`VLM_CHAT_TEMPLATE`; saved into ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    tokens = SPECIALS + chars
    tokens += [f"<x{i}>" for i in range(VOCAB - len(VISION_TOKENS) - len(tokens))] + VISION_TOKENS
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<pad>", extra_special_tokens=VISION_TOKENS)
    assert [fast.convert_tokens_to_ids(t) for t in VISION_TOKENS] == list(VISION_IDS.values())
    fast.chat_template = VLM_CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_image_processor(path: str):
    """Qwen2-VL's image processor (the PIL backend: no torchvision here), patch 14, merge 2, pixel
    bounds that keep :data:`IMAGE_SIZES` as they are; writes ``preprocessor_config.json``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                    min_pixels=28 * 28, max_pixels=112 * 112)
    proc.save_pretrained(path)
    return proc


def make_vlm_model(path: str, seed: int) -> None:
    """A tiny random Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``, fp32): language model 2 layers,
    hidden 64, 4 query / 2 key-value heads of 16, mRoPE sections [2, 3, 3]; vision tower 2 blocks
    (the second full attention), hidden 32, patch 14, merge 2, out 64. Saved with the vision token ids
    of :func:`make_vlm_tokenizer`."""
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1], in_chans=3)
    ids = VISION_IDS
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=VISION_IDS["<|vision_start|>"],
                           vision_end_token_id=VISION_IDS["<|vision_end|>"],
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path)


def png(colour: str, size: tuple[int, int], seed: int) -> bytes:
    """A solid-``colour`` PNG of ``size`` (h, w) with a little noise (distinct pixel values)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    base = torch.tensor(COLOURS[colour], dtype=torch.int16).view(1, 1, 3)
    pixels = (base + torch.randint(-20, 21, (*size, 3), generator=g, dtype=torch.int16)).clamp(0, 255)
    buf = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(buf, format="PNG")
    return buf.getvalue()


def make_vlm_dataset(path: str, n: int = 16, seed: int = 0) -> None:
    """verl's RL parquet layout with images: ``prompt`` ``"<image>colour?"``, ``images`` one PNG (a
    solid colour, one of :data:`IMAGE_SIZES`), ``reward_model.ground_truth`` the colour's name (the
    rule reward: ``verl_trainer_reward.compute_score``)."""
    import pandas as pd

    names = sorted(COLOURS)
    rows = []
    for i in range(n):
        # every colour and every size in each group of four prompts (a step's batch)
        colour, size = names[i % len(names)], IMAGE_SIZES[(3 * i + i // 4) % len(IMAGE_SIZES)]
        rows.append({"data_source": "image_colour", "prompt": [{"role": "user", "content": "<image>colour?"}],
                     "images": [{"bytes": png(colour, size, seed + i)}], "ability": "vision",
                     "reward_model": {"style": "rule", "ground_truth": colour}, "extra_info": {"index": i}})
    pd.DataFrame(rows).to_parquet(path)


def make_vlm_folder(path: str, seed: int = 0) -> str:
    """:func:`make_vlm_model`, :func:`make_vlm_tokenizer` and :func:`make_image_processor` in one folder
    (a Hub checkpoint's layout: verl's ``model.path`` and ``tokenizer_path``); returns ``path``."""
    make_vlm_model(path, seed)
    make_vlm_tokenizer(path)
    make_image_processor(path)
    return path
