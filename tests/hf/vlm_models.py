"""Tiny random vision-language folders written by ``transformers`` 5.24 ``save_pretrained`` (fp32,
seeded, no downloads): :func:`tiny_vlm_folder` for ``KINDS``.

Language model (every kind): vocab 256, hidden 64, 2 layers (``qwen3_vl_moe``: 2 MoE layers; Qwen3.5:
4 layers, GDN x 3 then gated attention, as ``tests/hf/qwen3_5_models.py``), 4 query heads / 2 KV heads
of head_dim 16, MLP width 96, ``mrope_section`` [2, 3, 3] (sum 8 = head_dim / 2; Qwen3.5: partial
rotary 0.5, so [2, 1, 1] over its 4 rotary pairs), rope theta 10000.
``qwen2_5_vl``: q/k/v biases, sectioned mRoPE, untied lm-head. ``qwen3_vl``: q/k norms, interleaved mRoPE,
TIED embeddings (as Qwen3-VL-2B / 4B; the folder has no ``lm_head.weight``). ``qwen3_vl_moe``: 4 experts
of width 24, top-2, untied; its folder holds the experts FUSED in the released (Hub) layout
``mlp.experts.gate_up_proj`` [E, H, 2I] = [4, 64, 48] (gate = ``[..., :I]``, up = ``[..., I:]``) and
``mlp.experts.down_proj`` [E, I, H] = [4, 24, 64] (``expert_layout`` picks the others).

Vision tower:

- ``qwen2_5_vl`` (``Qwen2_5_VisionTransformerPretrainedModel``): depth 2, hidden 32, 2 heads, SwiGLU MLP
  48, ``patch_size`` 14, ``temporal_patch_size`` 2, ``spatial_merge_size`` 2, ``window_size`` 56 (a window
  = 2 x 2 merged patches = 4 x 4 patches, so a 112 x 112 image has 4 windows), ``fullatt_block_indexes``
  [1] (block 0 windowed, block 1 full), ``tokens_per_second`` 2, ``out_hidden_size`` 64.
- ``qwen3_vl`` / ``qwen3_vl_moe`` (``Qwen3VLVisionModel`` / ``Qwen3VLMoeVisionModel``): depth 2, hidden
  32, 2 heads, GELU MLP 48, ``patch_size`` 16, ``temporal_patch_size`` 2, ``spatial_merge_size`` 2,
  ``num_position_embeddings`` 64 (an 8 x 8 grid, interpolated), ``deepstack_visual_indexes`` [0, 1].
- ``qwen3_5`` / ``qwen3_5_moe``: ``tests/hf/qwen3_5_models.py``'s ``qwen3_5_vl`` / ``qwen3_5_moe_vl``
  (tower depth 1, hidden 16, ``patch_size`` 2, 16 position embeddings) with the token ids below.

Token ids (top level of config.json, all < vocab): ``<|vision_start|>`` 251, ``<|vision_end|>`` 252,
``<|image_pad|>`` 253, ``<|video_pad|>`` 254; pad 0, bos 1, eos 2 (``TOKENS``).

Every norm weight is ``1 + N(0, 0.1)`` (Qwen3.5's zero-centred ones ``N(0, 0.1)``), every bias
``N(0, 0.1)``, MoE routers ``N(0, 0.2)`` (no near-ties), the rest ``transformers``' seeded init.

Beside the weights the folder holds ``preprocessor_config.json``: a ``Qwen2VLImageProcessor`` whose
``patch_size`` / ``temporal_patch_size`` / ``merge_size`` match the tower, ``min_pixels`` = 4 merged
patches, ``max_pixels`` = 64 merged patches (``image_processor(kind, path)`` builds it offline), and a
character-level tokenizer (``tokenizer.json``; ``make_tokenizer``) whose vocab holds the four vision
tokens at the ids above and a Qwen-VL style chat template (image / video content items). ``AutoTokenizer``
loads it as is for the Qwen-VL kinds; beside a Qwen3.5 ``config.json`` it picks ``Qwen3_5Tokenizer``
(byte-level pre-tokenizer): load those with ``PreTrainedTokenizerFast.from_pretrained``.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path
from typing import Any

import torch

KINDS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
VOCAB = 256
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
VISION_TOKENS = dict(vision_start_token_id=251, vision_end_token_id=252, image_token_id=253,
                     video_token_id=254)
SPECIAL_NAMES = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                 "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}
MROPE_SECTION = [2, 3, 3]
QWEN3_5_MROPE_SECTION = [2, 1, 1]
EXPERT_LAYOUTS = ("hub", "transformers", "per_expert")

_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-6, **TOKENS)
_MOE = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[],
            decoder_sparse_step=1)
_QWEN2_5_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                       patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
                       fullatt_block_indexes=[1], tokens_per_second=2)
_QWEN3_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                     patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64,
                     deepstack_visual_indexes=[0, 1])
CLASSES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
           "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration", "qwen3_5": "Qwen3_5ForConditionalGeneration",
           "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
VISION_PREFIX = {"qwen2_5_vl": "visual.", "qwen3_vl": "model.visual.", "qwen3_vl_moe": "model.visual.",
                 "qwen3_5": "model.visual.", "qwen3_5_moe": "model.visual."}
"""Where ``save_pretrained`` (5.24) puts each kind's tower (the language model: ``model.layers.*`` for
``qwen2_5_vl``, ``model.language_model.layers.*`` for the others)."""


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def hf_config(kind: str, **text_overrides: Any):
    """The ``transformers`` config object of the tiny ``kind`` (``text_overrides``: text config fields)."""
    import transformers as T

    _check_kind(kind)
    top = dict(VISION_TOKENS, architectures=[CLASSES[kind]])
    if kind in ("qwen3_5", "qwen3_5_moe"):
        from tests.hf import qwen3_5_models as Q

        vl = "qwen3_5_vl" if kind == "qwen3_5" else "qwen3_5_moe_vl"
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "mrope_section": list(QWEN3_5_MROPE_SECTION), "mrope_interleaved": True}
        text = Q.text_fields(vl) | dict(vocab_size=VOCAB, rope_parameters=rope, max_position_embeddings=512,
                                        **TOKENS) | text_overrides
        cls = T.Qwen3_5Config if kind == "qwen3_5" else T.Qwen3_5MoeConfig
        cfg = cls(text_config=text, vision_config=Q._VISION, tie_word_embeddings=False, **top)
        return cfg
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(MROPE_SECTION)}
    if kind == "qwen2_5_vl":
        text = _TEXT | dict(rope_parameters=rope) | text_overrides
        return T.Qwen2_5_VLConfig(text_config=text, vision_config=_QWEN2_5_VISION, tie_word_embeddings=False,
                                  **top)
    rope["mrope_interleaved"] = True
    if kind == "qwen3_vl":
        text = _TEXT | dict(rope_parameters=rope, tie_word_embeddings=True) | text_overrides
        return T.Qwen3VLConfig(text_config=text, vision_config=_QWEN3_VISION, tie_word_embeddings=True, **top)
    text = _TEXT | _MOE | dict(rope_parameters=rope, tie_word_embeddings=False) | text_overrides
    return T.Qwen3VLMoeConfig(text_config=text, vision_config=_QWEN3_VISION, tie_word_embeddings=False, **top)


def hf_config_dict(kind: str, **text_overrides: Any) -> dict[str, Any]:
    """``config.json`` content of the tiny ``kind``, as ``save_pretrained`` writes it."""
    return json.loads(hf_config(kind, **text_overrides).to_json_string(use_diff=False))


def model_class(kind: str):
    """The ``transformers`` ``...ForConditionalGeneration`` class of ``kind``."""
    import transformers as T

    _check_kind(kind)
    return getattr(T, CLASSES[kind])


def build_model(kind: str, seed: int = 0, **text_overrides: Any) -> torch.nn.Module:
    """The random tiny ``kind`` in fp32, eval mode (see the module docstring for the values)."""
    torch.manual_seed(seed)
    model = model_class(kind)(hf_config(kind, **text_overrides)).float().eval()
    zero_centred = kind.startswith("qwen3_5")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") and p.dim() == 2 and p.shape[0] == _MOE["num_experts"]:
                p.normal_(0.0, 0.2)
            elif "norm" in name and p.dim() == 1 and name.endswith("weight"):
                lm_norm = zero_centred and "visual" not in name and "linear_attn.norm" not in name
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if lm_norm else 1.0))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 1.0).log())
            elif p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1)
    return model


def tiny_vlm_folder(kind: str, path: str | Path, seed: int = 0, expert_layout: str = "hub",
                    tokenizer: bool = True) -> Path:
    """Write the tiny ``kind`` (:func:`build_model`) to ``path`` with ``save_pretrained``, its image
    processor config and (``tokenizer``) its tokenizer; returns ``Path(path)``.

    ``expert_layout`` (MoE kinds): ``"hub"`` (default) the released folders' fused experts
    (``qwen3_vl_moe``: ``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]; ``qwen3_5_moe``:
    ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]); ``"transformers"`` what 5.24's
    ``save_pretrained`` writes (``qwen3_vl_moe``: fused in the module's layout [E, 2I, H] / [E, H, I];
    ``qwen3_5_moe``: one tensor per expert); ``"per_expert"``: ``experts.{e}.{gate,up,down}_proj.weight``.
    """
    _check_kind(kind)
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    path = Path(path)
    model = build_model(kind, seed)
    model.save_pretrained(path)
    if kind in ("qwen3_vl_moe", "qwen3_5_moe"):
        rewrite_experts(path, kind, expert_layout)
    save_image_processor(kind, path)
    if tokenizer:
        make_tokenizer(path)
    return path


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    for file in Path(path).glob("*.safetensors*"):
        file.unlink()
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(Path(path) / "model.safetensors"),
              metadata={"format": "pt"})


def rewrite_experts(path: str | Path, kind: str, layout: str) -> None:
    """Rewrite the expert tensors of the folder ``path`` (written by ``save_pretrained`` for ``kind``) in
    ``layout`` (see :func:`tiny_vlm_folder`)."""
    tensors = _load_tensors(Path(path))
    out, fused, split = {}, {}, {}
    for name, t in tensors.items():
        m = re.match(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        s = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            fused.setdefault(m[1], {})[m[2]] = t
        elif s:
            split.setdefault(s[1], {})[(int(s[2]), s[3])] = t
        else:
            out[name] = t
    # module layout: gate_up [E, 2I, H], down [E, H, I]
    for block, parts in split.items():
        n = len(parts) // 3
        gate_up = [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(n)]
        fused[block] = {"gate_up_proj": torch.stack(gate_up),
                        "down_proj": torch.stack([parts[(e, "down_proj")] for e in range(n)])}
    for block, parts in fused.items():
        gate_up, down = parts["gate_up_proj"], parts["down_proj"]
        if layout == "per_expert":
            i = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                out[f"{block}.{e}.gate_proj.weight"] = gate_up[e, :i]
                out[f"{block}.{e}.up_proj.weight"] = gate_up[e, i:]
                out[f"{block}.{e}.down_proj.weight"] = down[e]
        elif layout == "hub" and kind == "qwen3_vl_moe":
            out[f"{block}.gate_up_proj"] = gate_up.transpose(1, 2)
            out[f"{block}.down_proj"] = down.transpose(1, 2)
        elif layout == "transformers" and kind == "qwen3_5_moe":
            n, i = gate_up.shape[0], gate_up.shape[1] // 2
            for e in range(n):
                out[f"{block}.{e}.gate_proj.weight"] = gate_up[e, :i]
                out[f"{block}.{e}.up_proj.weight"] = gate_up[e, i:]
                out[f"{block}.{e}.down_proj.weight"] = down[e]
        else:
            out[f"{block}.gate_up_proj"], out[f"{block}.down_proj"] = gate_up, down
    _save_tensors(Path(path), out)


def mm_token_type_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """``transformers``' per-token modality (0 text, 1 image, 2 video) of ``input_ids`` (any shape), as
    the processor returns it. 5.24's Qwen-VL models need it to compute the 3-D positions: Qwen3-VL /
    Qwen3.5 raise without it, Qwen2.5-VL silently falls back to 1-D positions."""
    out = torch.zeros_like(input_ids)
    out[input_ids == VISION_TOKENS["image_token_id"]] = 1
    out[input_ids == VISION_TOKENS["video_token_id"]] = 2
    return out


def image_processor_kwargs(kind: str) -> dict[str, Any]:
    """``Qwen2VLImageProcessor`` arguments matching ``kind``'s tower: patch / temporal patch / merge
    sizes, 4 to 64 merged patches per image."""
    _check_kind(kind)
    vision = hf_config(kind).vision_config
    factor = vision.patch_size * vision.spatial_merge_size
    qwen2 = kind == "qwen2_5_vl"
    mean = [0.48145466, 0.4578275, 0.40821073] if qwen2 else [0.5, 0.5, 0.5]
    std = [0.26862954, 0.26130258, 0.27577711] if qwen2 else [0.5, 0.5, 0.5]
    return dict(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                merge_size=vision.spatial_merge_size, min_pixels=4 * factor * factor,
                max_pixels=64 * factor * factor, image_mean=mean, image_std=std)


def image_processor(kind: str, path: str | Path | None = None):
    """The image processor (``Qwen2VLImageProcessorPil``: torchvision does not import here) of ``kind``:
    loaded from the folder ``path`` when given, else built from :func:`image_processor_kwargs`."""
    from transformers import Qwen2VLImageProcessorPil

    if path is not None:
        return Qwen2VLImageProcessorPil.from_pretrained(str(path))
    return Qwen2VLImageProcessorPil(**image_processor_kwargs(kind))


def save_image_processor(kind: str, path: str | Path) -> None:
    """Write ``preprocessor_config.json`` (:func:`image_processor_kwargs`) into ``path``."""
    image_processor(kind).save_pretrained(str(path))


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or 'image' in c %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif c['type'] == 'video' or 'video' in c %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def make_tokenizer(path: str | Path):
    """A character-level ``PreTrainedTokenizerFast`` with exactly ``VOCAB`` ids: ``<pad>`` ``<s>`` ``</s>``
    (0, 1, 2), printable ASCII and newline, ``<|im_start|>`` / ``<|im_end|>``, fillers ``<xN>``, and the
    vision tokens at ``VISION_TOKENS``' ids (special: never split); a Qwen-VL chat template (a content
    item ``{"type": "image"}`` becomes ``<|vision_start|><|image_pad|><|vision_end|>``); saved into
    ``path``. The image processor expands each ``<|image_pad|>`` to the image's merged-patch count."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    tokens = ["<pad>", "<s>", "</s>", *chars, "<|im_start|>", "<|im_end|>"]
    vision = {i: SPECIAL_NAMES[k] for k, i in VISION_TOKENS.items()}
    fill = iter(range(VOCAB))
    while len(tokens) < VOCAB:
        n = len(tokens)
        tokens.append(vision[n] if n in vision else f"<x{next(fill)}>")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", *vision.values()]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast
